"""``autoprec train``: train a model file with a policy, with monitoring and checkpoint/resume.

Batches are ``get_batch(step, device)`` for step = 0..steps-1, so a run resumed from a checkpoint at
step k sees exactly the batches the uninterrupted run sees from k on.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoprec.capture import capture
from autoprec.errors import AutoprecError
from autoprec.modelspec import load_model_spec
from autoprec.policy import Policy
from autoprec.runtime.apply import apply
from autoprec.runtime.checkpoint import load_checkpoint, save_checkpoint
from autoprec.runtime.monitor import Monitor
from autoprec.runtime.train import TrainStep, make_scaler
from autoprec.search.measure import resolve_device

__all__ = ["TrainResult", "train"]


@dataclass
class TrainResult:
    """Outcome of :func:`train`.

    Attributes:
        losses: Loss per step run in this call (fp32 floats; a skipped step's loss is still recorded).
        final_loss: Mean loss of the last ``min(5, len(losses))`` steps (NaN if no step ran).
        tokens_per_s: Median tokens/s over the steps after the first (which compiles).
        skipped: Steps skipped for non-finite gradients (in this call).
        loss_scale: Final loss scale (1.0 without a scaler).
        start_step: First step run (``> 0`` when resumed from a checkpoint).
        summary: :meth:`Monitor.summary` of the steps run.
    """

    losses: list[float] = field(default_factory=list)
    final_loss: float = math.nan
    tokens_per_s: float = 0.0
    skipped: int = 0
    loss_scale: float = 1.0
    start_step: int = 0
    summary: dict[str, Any] = field(default_factory=dict)


def _same_policy(a: Policy, b: Policy) -> bool:
    """Equal as far as training is concerned (provenance and measurements ignored)."""
    strip = ("provenance", "measured")
    da, db = a.to_dict(), b.to_dict()
    return {k: v for k, v in da.items() if k not in strip} == {k: v for k, v in db.items() if k not in strip}


def _warn_if_other_model(policy: Policy, policy_path: str | os.PathLike, gm: Any, model_path: str) -> None:
    """Warn (stderr) when the policy was tuned on a graph other than this model's."""
    from autoprec.search.study import graph_fingerprint

    tuned = policy.provenance.get("graph_fingerprint") if policy.provenance else None
    if tuned and tuned != (here := graph_fingerprint(gm)):
        print(f"autoprec train: warning: {policy_path} was tuned on {policy.provenance.get('model', '?')} "
              f"(graph {tuned}), not on this model {model_path} (graph {here}); its node rules may not "
              "match and its measurements do not apply", file=sys.stderr, flush=True)


def train(model_path: str | os.PathLike, policy_path: str | os.PathLike, steps: int = 50, device: str = "auto",
          compile: bool = True, log_every: int = 1, quiet: bool = False,
          checkpoint: str | os.PathLike | None = None, resume: bool = False, checkpoint_every: int = 0,
          log_path: str | os.PathLike | None = None, max_grad_norm: float | None = None) -> TrainResult:
    """Train the model of ``model_path`` up to ``steps`` optimizer steps under a policy file.

    The optimizer is the model file's ``make_optimizer`` (default AdamW) over the fp32 parameters
    (master weights). Every step is recorded by a :class:`Monitor` (JSONL at ``log_path`` if given);
    if the policy needs loss scaling, the scaler's floor error names the first non-finite node.

    Args:
        model_path: Model file (DESIGN §2). policy_path: Policy JSON file.
        steps: Total optimizer steps of the run (a resumed run continues up to this number).
        device: ``auto``, ``cpu`` or ``cuda``. compile: ``torch.compile`` the lowered graph.
        log_every: Print every n-th step. quiet: Print nothing.
        checkpoint: Checkpoint file written at the end (and every ``checkpoint_every`` steps).
        resume: Continue from ``checkpoint`` if it exists (model, optimizer, scaler, step, RNG);
            start from step 0 if it does not.
        checkpoint_every: Also save every this many steps (0: only at the end).
        log_path: JSONL file for the monitor (appended to).
        max_grad_norm: Clip unscaled gradients to this L2 norm.

    Raises:
        ModelSpecError: invalid model file. PolicyError: invalid policy file.
        CaptureError / PassError: the policy cannot be applied to this model.
        AutoprecError: ``--resume`` with a checkpoint saved under a different policy or model, or
            one already at step ``steps`` or beyond.
        LossScaleError: non-finite gradients persist at the scale floor (names the node).
        ValueError: ``steps`` < 1, or ``resume`` without ``checkpoint``.
    """
    if steps < 1:
        raise ValueError(f"steps must be ≥ 1, got {steps}")
    if resume and checkpoint is None:
        raise ValueError("resume=True needs a checkpoint path")
    policy = Policy.load(policy_path)
    spec = load_model_spec(model_path)
    dev = resolve_device(device)
    model = spec.build_model().to(dev)
    model.train()
    first = spec.get_batch(0, dev)
    gm = capture(model, first)
    _warn_if_other_model(policy, policy_path, gm, spec.path)
    mp = apply(model, policy, first, compile=compile, graph_module=gm)
    params = [p for p in model.parameters() if p.requires_grad]
    monitor: Monitor | None = None  # opened after the resume check: a refused resume writes nothing

    def diagnose() -> str | None:
        return monitor.diagnoser()() if monitor is not None else None

    optimizer = spec.make_optimizer(params)
    step = TrainStep(mp, params, optimizer, spec.loss_fn, scaler=make_scaler(policy, diagnose),
                     device_type=dev.type, max_grad_norm=max_grad_norm)
    start = 0
    if resume and Path(checkpoint).exists():
        ck = load_checkpoint(checkpoint, model, optimizer, step.scaler)
        if ck.policy is not None and not _same_policy(ck.policy, policy):
            raise AutoprecError(f"{checkpoint}: saved under a different policy than {policy_path} "
                                f"({ck.policy.summary()} vs {policy.summary()})")
        start = ck.step
        if start >= steps:
            raise AutoprecError(f"checkpoint {checkpoint} is already at step {start} ≥ --steps {steps}; "
                                f"pass --steps larger than {start} to train further")
        if not quiet:
            print(f"resumed from {checkpoint} at step {start}", flush=True)
    elif resume and not quiet:
        print(f"no checkpoint at {checkpoint}; starting from step 0", flush=True)
    monitor = Monitor(log_path, graph_module=mp.graph_module)
    res = TrainResult(start_step=start)
    times = []

    def save(done: int) -> None:
        save_checkpoint(checkpoint, model, optimizer, step.scaler, policy, step=done)

    try:
        for i in range(start, steps):
            batch = first if i == 0 else spec.get_batch(i, dev)
            monitor.last_batch = batch
            st, seconds = step.timed(batch)
            times.append(seconds)
            monitor.record(i, st, tokens=spec.tokens_per_batch(batch), seconds=times[-1], batch=batch)
            res.losses.append(st.loss)
            res.skipped += int(st.skipped)
            if not quiet and (i % max(log_every, 1) == 0 or i == steps - 1):
                print(f"step {i:4d}  loss {st.loss:.4f}  grad_norm {st.grad_norm:.3g}  scale {st.loss_scale:g}"
                      f"{'  SKIPPED' if st.skipped else ''}  {times[-1]:.2f}s", flush=True)
            if checkpoint is not None and checkpoint_every > 0 and (i + 1) % checkpoint_every == 0:
                save(i + 1)
        if checkpoint is not None:
            save(max(steps, start))
    finally:
        monitor.close()
    res.loss_scale = step.scaler.get_scale() if step.scaler is not None else 1.0
    res.summary = monitor.summary()
    if res.losses:
        tail = res.losses[-min(5, len(res.losses)):]
        res.final_loss = sum(tail) / len(tail)
        timed = times[1:] or times
        res.tokens_per_s = spec.tokens_per_batch(first) / statistics.median(timed)
    return res
