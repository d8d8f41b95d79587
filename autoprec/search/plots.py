"""The report's plots (matplotlib, Agg backend: no display needed): the trials' Pareto plot and the
per-module dtype map (docs/architecture.md#search, "Report").

Each ``*_figure`` function returns the :class:`matplotlib.figure.Figure` (tests read its title,
labels and legend); :func:`save_figure` writes and closes it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

__all__ = ["DTYPE_COLOURS", "NO_NODES", "dtype_map_figure", "pareto_figure", "save_figure"]

#: Colour of each storage dtype in the dtype map (fp32, bf16, fp16).
DTYPE_COLOURS = {"fp32": "#4c72b0", "bf16": "#dd8452", "fp16": "#c44e52"}
#: Legend label of a white cell of the dtype map: the module has no node of that op class.
NO_NODES = "no nodes of that class"
#: What the Pareto plot's speeds are, said in its title, axis and note.
EAGER_NOTE = ("Speeds are eager screening (each trial's few eager steps); the written policy's numbers "
              "come from the head-to-head (compiled unless --no-compile)")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def pareto_figure(rows: list[dict[str, Any]], front: list[dict[str, Any]], fp32_tps: float | None,
                  budget: float | None, chosen: dict[str, Any] | None = None,
                  chosen_compiled: float | None = None) -> Any:
    """The trials on (drift, eager screening speedup), coloured by peak memory, the Pareto front
    ringed, the drift budget dashed, and the chosen policy marked.

    Args:
        rows: :func:`autoprec.search.report.trial_rows` (COMPLETE rows with tokens/s and drift
            are drawn). front: Its Pareto front.
        fp32_tps: fp32 eager tokens/s, the y axis' unit (None: relative to the fastest trial).
        budget: The drift budget (a dashed line), or None.
        chosen: The trial row whose policy was written (a star), or None when it is no trial.
        chosen_compiled: The written policy's compiled speedup vs fp32 eager (its ``measured``
            block), named in the star's label and the note.

    Returns:
        A matplotlib Figure (title, y axis and note say the speeds are eager screening).
    """
    plt = _pyplot()
    ok = [r for r in rows if r["state"] == "COMPLETE" and r["tokens_per_s"] and r["grad_rel_l2"] is not None]
    base = fp32_tps or max((r["tokens_per_s"] for r in ok), default=1.0)
    fig, ax = plt.subplots(figsize=(6, 4.4), dpi=110)
    compiled = f"; compiled {chosen_compiled:.2f}x" if chosen_compiled else ""
    if ok:
        sc = ax.scatter([max(r["grad_rel_l2"], 1e-9) for r in ok], [r["tokens_per_s"] / base for r in ok],
                        c=[(r["peak_bytes"] or 0) / 2**20 for r in ok], cmap="viridis", s=30)
        fig.colorbar(sc, ax=ax, label="peak memory (MiB)")
        ax.scatter([max(r["grad_rel_l2"], 1e-9) for r in front], [r["tokens_per_s"] / base for r in front],
                   s=90, facecolors="none", edgecolors="red", label="Pareto front (speed, drift, memory)")
        if chosen is not None and chosen in ok:
            y = chosen["tokens_per_s"] / base
            ax.scatter([max(chosen["grad_rel_l2"], 1e-9)], [y], marker="*", s=220, color="gold",
                       edgecolors="black", zorder=3,
                       label=f"chosen policy: trial {chosen['number']} (eager {y:.2f}x{compiled})")
        if budget is not None:
            ax.axvline(max(budget, 1e-9), color="grey", ls="--", lw=1, label=f"drift budget {budget:.2g}")
        ax.legend(loc="best", fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("grad_rel_l2 vs FP32 (log; 0 shown at 1e-9)")
    ax.set_ylabel("eager screening speedup vs fp32 eager" if fp32_tps else "relative eager tokens/s")
    ax.set_title("autoprec trials (eager screening speeds)")
    note = EAGER_NOTE + (f": {chosen_compiled:.2f}x fp32 eager" if chosen_compiled else "")
    if chosen is None and ok:
        note += ("; the chosen policy is not one of these trials (a memory lever or the head-to-head "
                 "changed it)")
    fig.text(0.01, 0.01, note, fontsize=6, wrap=True)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def dtype_map_figure(dm: dict[str, dict[str, str]],
                     classes: tuple[str, ...] = ("matmul", "sensitive", "follow")
                     ) -> Any:
    """A module x op class grid coloured by storage dtype (:func:`autoprec.search.report.dtype_map`'s
    labels, their first word before ``:``); a white cell is a module with no node of that class,
    and the legend says so (:data:`NO_NODES`).

    Returns:
        A matplotlib Figure.
    """
    plt = _pyplot()
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    mods = list(dm)
    order = list(DTYPE_COLOURS)
    # colour by storage dtype (the label's first word before ":"); compute and saved are in show's listing
    grid = [[order.index(d) if (d := dm[m].get(c, "").split(":")[0].split(" ")[0]) in order else math.nan
             for c in classes] for m in mods]
    fig, ax = plt.subplots(figsize=(5, max(2.0, 0.18 * len(mods) + 1)), dpi=110)
    ax.imshow(grid or [[math.nan] * len(classes)], aspect="auto",
              cmap=ListedColormap(list(DTYPE_COLOURS.values())), vmin=0, vmax=len(order) - 1)
    ax.set_xticks(range(len(classes)), classes)
    ax.xaxis.tick_top()  # the legend goes below the grid
    ax.set_yticks(range(len(mods)), [m or "<root>" for m in mods], fontsize=6)
    ax.set_title("dtype per module and op class", fontsize=8)
    handles = [Patch(color=c, label=d) for d, c in DTYPE_COLOURS.items()]
    handles.append(Patch(facecolor="white", edgecolor="grey", label=NO_NODES))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=4,
              fontsize=7, frameon=False)
    fig.tight_layout()
    return fig


def save_figure(fig: Any, path: str | Path) -> None:
    """Write ``fig`` to ``path`` (the legend below the axes kept: ``bbox_inches="tight"``) and close it."""
    plt = _pyplot()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def micro_batch_figure(block: dict[str, Any]) -> Any:
    """Tokens/s against peak memory of every configuration ``tune --global-batch`` measured
    (:meth:`autoprec.search.batch_phase.BatchChoice.report`): each timed point labelled with its
    micro-batch (``m x accumulation``), one colour per configuration, the memory budget a vertical
    line, the chosen point a star and the baseline to beat ringed. Points only measured for memory
    (over the budget, or smaller than the largest that fits) are small crosses at 0 tokens/s.

    Returns:
        A matplotlib Figure (x: peak MiB; y: tokens/s per global step).
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=110)
    rows = [r for r in block["rows"] if r["error"] is None]
    names = list(dict.fromkeys(r["config"] for r in rows))
    for i, name in enumerate(names):
        pts = [r for r in rows if r["config"] == name and r["tokens_per_s"]]
        untimed = [r for r in rows if r["config"] == name and not r["tokens_per_s"]]
        ax.scatter([r["peak_bytes"] / 2**20 for r in pts], [r["tokens_per_s"] for r in pts],
                   color=f"C{i}", s=36, label=name)
        ax.scatter([r["peak_bytes"] / 2**20 for r in untimed], [0.0] * len(untimed), color=f"C{i}", s=14,
                   marker="x")
        for r in pts:
            ax.annotate(f"{r['micro_batch']}x{r['accumulation']}",
                        (r["peak_bytes"] / 2**20, r["tokens_per_s"]),
                        textcoords="offset points", xytext=(4, 3), fontsize=7)
    label = lambda r: f"{r['config']} @ {r['micro_batch']}x{r['accumulation']}"  # noqa: E731
    for r in rows:
        if label(r) == block.get("chosen"):
            ax.scatter([r["peak_bytes"] / 2**20], [r["tokens_per_s"]], marker="*", s=260, color="gold",
                       edgecolors="black", zorder=3, label=f"chosen: {label(r)}")
        if label(r) == block.get("baseline"):
            ax.scatter([r["peak_bytes"] / 2**20], [r["tokens_per_s"]], s=160, facecolors="none",
                       edgecolors="red", zorder=3, label=f"baseline to beat: {label(r)}")
    if block.get("memory_budget"):
        ax.axvline(block["memory_budget"] / 2**20, color="grey", ls="--", lw=1,
                   label=f"memory budget {block['memory_budget'] / 2**20:.1f} MiB")
    ax.set_xlabel("peak memory of a micro-step (MiB)")
    ax.set_ylabel("tokens/s per global step")
    ax.set_title("micro-batch x memory lever (global batch fixed)")
    ax.legend(loc="best", fontsize=7)
    fig.tight_layout()
    return fig
