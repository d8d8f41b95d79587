"""``autoprec train``: train a model file with a policy, printing loss per step."""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass, field

from autoprec.modelspec import load_model_spec
from autoprec.policy import Policy
from autoprec.runtime.apply import apply
from autoprec.runtime.train import TrainStep, make_scaler
from autoprec.search.measure import resolve_device, sync

__all__ = ["TrainResult", "train"]


@dataclass
class TrainResult:
    """Outcome of :func:`train`.

    Attributes:
        losses: Loss per step (fp32 floats; a skipped step's loss is still recorded).
        final_loss: Mean loss of the last ``min(5, steps)`` steps.
        tokens_per_s: Median tokens/s over the steps after the first (which compiles).
        skipped: Steps skipped for non-finite gradients.
        loss_scale: Final loss scale (1.0 without a scaler).
    """

    losses: list[float] = field(default_factory=list)
    final_loss: float = math.nan
    tokens_per_s: float = 0.0
    skipped: int = 0
    loss_scale: float = 1.0


def train(model_path: str | os.PathLike, policy_path: str | os.PathLike, steps: int = 50, device: str = "auto",
          compile: bool = True, log_every: int = 1, quiet: bool = False) -> TrainResult:
    """Train the model of ``model_path`` for ``steps`` optimizer steps under a policy file.

    Batches are ``get_batch(step, device)`` for step = 0..steps-1; the optimizer is the model
    file's ``make_optimizer`` (default AdamW) over the fp32 parameters (master weights).

    Raises:
        ModelSpecError: invalid model file. PolicyError: invalid policy file.
        CaptureError / PassError: the policy cannot be applied to this model.
        ValueError: ``steps`` < 1.
    """
    if steps < 1:
        raise ValueError(f"steps must be ≥ 1, got {steps}")
    policy = Policy.load(policy_path)
    spec = load_model_spec(model_path)
    dev = resolve_device(device)
    model = spec.build_model().to(dev)
    model.train()
    first = spec.get_batch(0, dev)
    mp = apply(model, policy, first, compile=compile)
    params = [p for p in model.parameters() if p.requires_grad]
    step = TrainStep(mp, params, spec.make_optimizer(params), spec.loss_fn, scaler=make_scaler(policy),
                     device_type=dev.type)
    res = TrainResult()
    times = []
    for i in range(steps):
        batch = first if i == 0 else spec.get_batch(i, dev)
        sync(dev)
        t0 = time.perf_counter()
        st = step(batch)
        sync(dev)
        times.append(time.perf_counter() - t0)
        res.losses.append(st.loss)
        res.skipped += int(st.skipped)
        res.loss_scale = step.scaler.get_scale() if step.scaler is not None else 1.0
        if not quiet and (i % max(log_every, 1) == 0 or i == steps - 1):
            print(f"step {i:4d}  loss {st.loss:.4f}  grad_norm {st.grad_norm:.3g}  scale {st.loss_scale:g}"
                  f"{'  SKIPPED' if st.skipped else ''}  {times[-1]:.2f}s", flush=True)
    tail = res.losses[-min(5, steps):]
    res.final_loss = sum(tail) / len(tail)
    timed = times[1:] or times
    res.tokens_per_s = spec.tokens_per_batch(first) / statistics.median(timed)
    return res
