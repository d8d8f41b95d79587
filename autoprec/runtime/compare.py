"""Convergence check: a policy's loss curve against FP32 and ``torch.autocast`` (``autoprec train --compare``).

Every configuration starts from the same initial weights (one ``build_model()`` state dict loaded into
each fresh model), sees the same batches (``get_batch(step)``) and the same global RNG seed, and uses
the model file's optimizer. The configurations:

* ``policy``: the policy file applied with :func:`autoprec.apply` (compiled unless ``compile=False``),
  with a :class:`DynamicLossScaler` when the policy uses fp16;
* ``fp32``: the unmodified model, eager, fp32 (the reference; always run);
* ``autocast``: the unmodified model under ``torch.autocast(device, dtype=torch.get_autocast_dtype(device))``
  (bf16 on CPU, fp16 on CUDA; fp16 gets a loss scaler), eager: standard AMP.

For each curve the maximum relative deviation from the FP32 curve, ``max_k |L_k − L32_k| / |L32_k|``
(DESIGN §5 ``traj_rel``), and the final held-out loss (mean over ``heldout_batches`` batches of
``get_heldout_batch(j)``, or of ``get_batch(10**6 + j)`` when the model file has none, evaluated
under ``torch.no_grad`` in the configuration's own precision) are reported, and written with the curves
to ``convergence.json`` and ``convergence.png`` (matplotlib, Agg backend).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from autoprec.modelspec import ModelSpec, call_model, load_model_spec
from autoprec.policy import Policy
from autoprec.runtime.apply import apply
from autoprec.runtime.monitor import json_safe
from autoprec.runtime.train import TrainStep, autocast_scaler, make_scaler
from autoprec.search.measure import resolve_device

__all__ = ["BASELINES", "CompareResult", "compare", "cpu_name", "max_rel_dev", "plot_curves"]

#: Baseline names accepted by ``--compare``.
BASELINES = ("fp32", "autocast")

#: Offset of the training-batch steps used as held-out data when the model file has no get_heldout_batch.
FAR_STEP = 10**6


@dataclass
class CompareResult:
    """Curves and summary numbers of :func:`compare`.

    Attributes:
        curves: Loss per step for each configuration (``"policy"``, ``"fp32"``, ``"autocast"``).
        heldout_loss: Final held-out loss per configuration.
        max_rel_dev: ``max_k |L_k − L32_k| / |L32_k|`` per configuration (0 for fp32; inf if a loss
            is non-finite).
        seconds_per_step: Median wall-clock seconds per training step per configuration.
        skipped: Skipped (non-finite) steps per configuration.
        meta: Model, policy summary, steps, device, CPU, torch version, date (UTC, ISO 8601).
    """

    curves: dict[str, list[float]] = field(default_factory=dict)
    heldout_loss: dict[str, float] = field(default_factory=dict)
    max_rel_dev: dict[str, float] = field(default_factory=dict)
    seconds_per_step: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (non-finite floats as ``"inf"``/``"nan"`` strings)."""
        return json_safe({"meta": self.meta, "max_rel_dev_vs_fp32": self.max_rel_dev,
                          "heldout_loss": self.heldout_loss, "seconds_per_step": self.seconds_per_step,
                          "skipped": self.skipped, "curves": self.curves})


def max_rel_dev(losses: list[float], ref: list[float]) -> float:
    """``max_k |L_k − ref_k| / |ref_k|`` over the common steps; inf if any loss is non-finite."""
    worst = 0.0
    for a, b in zip(losses, ref):
        if not (math.isfinite(a) and math.isfinite(b)):
            return math.inf
        worst = max(worst, abs(a - b) / max(abs(b), 1e-30))
    return worst


def cpu_name() -> str:
    """The CPU model name (``/proc/cpuinfo`` on Linux, else ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _heldout(spec: ModelSpec, j: int, dev: torch.device) -> Any:
    return spec.heldout_batch(j, dev) if spec.heldout_batch is not None else spec.get_batch(FAR_STEP + j, dev)


def _run(name: str, spec: ModelSpec, init: dict[str, torch.Tensor], policy: Policy, steps: int,
         dev: torch.device, compile: bool, heldout_batches: int, seed: int,
         log: Callable[[int, str], None]) -> tuple[list[float], float, float, int]:
    """Train one configuration; returns (losses, heldout loss, median s/step, skipped steps)."""
    model = spec.build_model().to(dev)
    model.load_state_dict(init)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    first = spec.get_batch(0, dev)
    autocast_dtype, scaler, module = None, None, model
    if name == "policy":
        module = apply(model, policy, first, compile=compile)
        scaler = make_scaler(policy)
    elif name == "autocast":
        autocast_dtype = torch.get_autocast_dtype(dev.type)
        scaler = autocast_scaler(autocast_dtype)()
    step = TrainStep(module, params, spec.make_optimizer(params), spec.loss_fn, scaler=scaler,
                     autocast_dtype=autocast_dtype, device_type=dev.type)
    torch.manual_seed(seed)
    losses, times, skipped = [], [], 0
    for i in range(steps):
        batch = first if i == 0 else spec.get_batch(i, dev)
        st, seconds = step.timed(batch)
        times.append(seconds)
        losses.append(st.loss)
        skipped += int(st.skipped)
        log(i, f"[{name}] step {i:4d}  loss {st.loss:.4f}  {times[-1]:.2f}s")
    with torch.no_grad(), step._context():
        held = [float(spec.loss_fn(call_model(module, b), b).float())
                for b in (_heldout(spec, j, dev) for j in range(heldout_batches))]
    timed = sorted(times[1:] or times)
    return losses, sum(held) / len(held), timed[len(timed) // 2], skipped


def compare(model_path: str | os.PathLike, policy_path: str | os.PathLike, steps: int,
            baselines: tuple[str, ...] | list[str] = BASELINES, device: str = "auto", compile: bool = True,
            out_dir: str | os.PathLike | None = None, heldout_batches: int = 4, seed: int = 0,
            quiet: bool = False, log_every: int = 10) -> CompareResult:
    """Train the policy and the baselines from the same weights on the same batches; compare the curves.

    Args:
        model_path: Model file (DESIGN §2). policy_path: Policy JSON file.
        steps: Optimizer steps per configuration.
        baselines: Any of :data:`BASELINES`; ``fp32`` is always run (it is the reference).
        device: ``auto``, ``cpu`` or ``cuda``. compile: Compile the policy's graph (baselines run eager).
        out_dir: Write ``convergence.json`` and ``convergence.png`` there (created), or None.
        heldout_batches: Number of held-out batches averaged for the final held-out loss.
        seed: Global torch seed set before each configuration's first step.
        quiet: Print nothing. log_every: Print every n-th step's loss.

    Returns:
        A :class:`CompareResult`.

    Raises:
        ValueError: ``steps`` < 1 or an unknown baseline name (lists the valid ones).
        ModelSpecError / PolicyError / CaptureError / PassError: as for ``autoprec train``.
    """
    if steps < 1:
        raise ValueError(f"steps must be ≥ 1, got {steps}")
    unknown = [b for b in baselines if b not in BASELINES]
    if unknown:
        raise ValueError(f"unknown --compare baseline {unknown[0]!r}; valid: {', '.join(BASELINES)}")
    policy = Policy.load(policy_path)
    spec = load_model_spec(model_path)
    dev = resolve_device(device)
    init = {k: v.detach().clone() for k, v in spec.build_model().state_dict().items()}
    names = ["fp32", "policy"] + [b for b in BASELINES if b in baselines and b != "fp32"]
    res = CompareResult(meta={
        "model": os.fspath(model_path), "policy_file": os.fspath(policy_path), "policy": policy.summary(),
        "steps": steps, "device": str(dev), "cpu": cpu_name(), "torch": torch.__version__,
        "compile_policy": compile, "seed": seed, "heldout_batches": heldout_batches,
        "heldout_source": "get_heldout_batch" if spec.heldout_batch is not None else f"get_batch({FAR_STEP}+j)",
        "autocast_dtype": str(torch.get_autocast_dtype(dev.type)).replace("torch.", ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    })

    def log(i: int, msg: str) -> None:
        if not quiet and (i % max(log_every, 1) == 0 or i == steps - 1):
            print(msg, flush=True)

    for name in names:
        losses, held, sps, skipped = _run(name, spec, init, policy, steps, dev, compile, heldout_batches, seed, log)
        res.curves[name], res.heldout_loss[name] = losses, held
        res.seconds_per_step[name], res.skipped[name] = sps, skipped
    for name in names:
        res.max_rel_dev[name] = max_rel_dev(res.curves[name], res.curves["fp32"])
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "convergence.json").write_text(json.dumps(res.to_dict(), indent=1, allow_nan=False) + "\n")
        plot_curves(res, out / "convergence.png")
    return res


def plot_curves(res: CompareResult, path: str | os.PathLike) -> None:
    """Plot the loss curves (top) and their relative deviation from FP32 (bottom) to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, dev_ax) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(2, 1))
    ref = res.curves["fp32"]
    style = {"fp32": ("k", "-"), "policy": ("C0", "-"), "autocast": ("C1", "--")}
    for name, losses in res.curves.items():
        color, ls = style.get(name, (None, "-"))
        label = f"{name} (max rel dev {res.max_rel_dev.get(name, math.nan):.2e}, held-out {res.heldout_loss[name]:.4f})"
        ax.plot(range(len(losses)), losses, label=label, lw=1.2, color=color, ls=ls)
        if name != "fp32":
            dev = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, ref)]
            dev_ax.semilogy(range(len(dev)), [max(d, 1e-12) for d in dev], label=name, lw=1.0, color=color, ls=ls)
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
