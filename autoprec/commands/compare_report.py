"""``autoprec train --compare``'s results (:func:`autoprec.commands.compare.compare`): the curves and
numbers of each configuration, the summary table the CLI prints, and the plot."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoprec._io import json_safe

__all__ = ["CompareResult", "plot_curves", "summary_table"]


@dataclass
class CompareResult:
    """Curves and summary numbers of :func:`autoprec.commands.compare.compare`.

    Attributes:
        curves: Loss per step for each configuration (``"policy"``, ``"fp32"``, ``"autocast"``).
        heldout_loss: Final held-out loss per configuration.
        max_rel_dev: ``max_k |L_k − L32_k| / |L32_k|`` per configuration (0 for fp32; inf if a loss
            is non-finite).
        seconds_per_step: Median wall-clock seconds per training step per configuration.
        skipped: Skipped (non-finite) steps per configuration.
        notes: Per configuration, how it was run where that differs from the plain run (torch.autocast's
            GEMMs as fp32 products after a slow native step).
        meta: Model, policy summary, steps, device, CPU, torch version, date (UTC, ISO 8601).
    """

    curves: dict[str, list[float]] = field(default_factory=dict)
    heldout_loss: dict[str, float] = field(default_factory=dict)
    max_rel_dev: dict[str, float] = field(default_factory=dict)
    seconds_per_step: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (non-finite floats as ``"inf"``/``"nan"`` strings)."""
        return json_safe({"meta": self.meta, "max_rel_dev_vs_fp32": self.max_rel_dev,
                          "heldout_loss": self.heldout_loss, "seconds_per_step": self.seconds_per_step,
                          "skipped": self.skipped, "notes": self.notes, "curves": self.curves})


def plot_curves(res: CompareResult, path: str | os.PathLike) -> None:
    """Plot the loss curves (top) and their relative deviation from FP32 (bottom) to a PNG; a
    configuration's note (:attr:`CompareResult.notes`), shortened, under its legend entry."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, dev_ax) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(2, 1))
    ref = res.curves["fp32"]
    style = {"fp32": ("k", "-"), "policy": ("C0", "-"), "autocast": ("C1", "--")}
    for name, losses in res.curves.items():
        color, ls = style.get(name, (None, "-"))
        label = (f"{name} (max rel dev {res.max_rel_dev.get(name, math.nan):.2e}, "
                 f"held-out {res.heldout_loss[name]:.4f})")
        if name in res.notes:  # "steps 2+ compute torch.autocast's GEMMs as fp32 products ..." in short
            label += "\n  " + res.notes[name].split(" rounded")[0]
        ax.plot(range(len(losses)), losses, label=label, lw=1.2, color=color, ls=ls)
        if name != "fp32":
            dev = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, ref)]
            dev_ax.semilogy(range(len(dev)), [max(d, 1e-12) for d in dev], label=name, lw=1.0, color=color,
                            ls=ls)
    m = res.meta
    ax.set_title(f"{Path(m.get('model', '')).name}: {m.get('policy', '')}\n"
                 f"{m.get('steps')} steps, {m.get('device')}, {m.get('cpu', '')}, torch {m.get('torch', '')}",
                 fontsize=8)
    ax.set_ylabel("training loss")
    ax.legend(fontsize=7)
    dev_ax.set_ylabel("|L − L_fp32| / L_fp32")
    dev_ax.set_xlabel("optimizer step")
    dev_ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_table(res: CompareResult) -> str:
    """The table ``autoprec train --compare`` prints: per configuration its max relative deviation
    from FP32's curve, held-out loss, median seconds per step and skipped steps; a configuration
    with a note (torch.autocast timed on its native step only) is marked ``*`` and its note follows."""
    lines = [f"{'config':10s} {'max rel dev vs fp32':>20s} {'held-out loss':>14s} {'s/step':>8s} "
             f"{'skipped':>8s}"]
    for name in res.curves:
        mark = "*" if name in res.notes else " "
        lines.append(f"{name:10s} {res.max_rel_dev[name]:20.3e} {res.heldout_loss[name]:14.4f} "
                     f"{res.seconds_per_step[name]:8.3f}{mark}{res.skipped[name]:8d}")
    lines += [f"* {name}: {note}" for name, note in res.notes.items()]
    return "\n".join(lines)
