"""One training step under a policy: forward, loss, (scaled) backward, unscale, step, update.

The same :class:`TrainStep` runs in ``autoprec train``, in every search trial and in
``autoprec bench``, so what the tuner measures is what training runs.

Master weights (docs/architecture.md#runtime): parameters, their ``.grad`` and the optimizer state are fp32
whatever the policy computes in; the lowered graph casts each weight to its compute dtype inside the graph
(``aten._to_copy``), and the cast's backward returns an fp32 gradient, so accumulation across
micro-batches happens in fp32 (case C06; ``tests/cases/test_c06_*``,
``tests/training/test_master_weights.py``). Caching the low-precision copies once per optimizer step
instead was measured and is not faster
(tiny_mlp, bf16 policy, eager, 2-core AMD EPYC, 2026-11-30: 1 micro-batch 375 ms/step in-graph vs
383 ms cached; 4 micro-batches 1112 vs 1279 ms, the cache still needing one fp32 gradient
accumulation per micro-batch; casting all 12.6M weights of qwen2_tiny costs ~0.4 s against a
~15 s fp32 step under load there, bf16 steps being slower still), so the casts stay in the graph,
where Inductor fuses them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoprec.errors import LossScaleError
from autoprec.modelspec import call_model
from autoprec.modelspec.micro_batches import Accumulated
from autoprec.policy import Policy
from autoprec.training.scaler import DynamicLossScaler, nonfinite_steps_message, unscaled_grad_norm

__all__ = ["GradientsOnly", "StepStats", "TrainStep", "autocast_scaler", "make_scaler"]


def make_scaler(policy: Policy, diagnose: Callable[[], str | None] | None = None) -> DynamicLossScaler | None:
    """A :class:`DynamicLossScaler` configured from ``policy.loss_scaling`` if the policy uses
    fp16 (fp16 gradients underflow without one: case C07), else ``None`` (bf16 has fp32's range).

    Args:
        policy: The policy trained with.
        diagnose: Zero-argument callable naming the first non-finite forward node, called when the
            scaler gives up at its floor (e.g. :meth:`autoprec.Monitor.diagnoser`).
    """
    if not policy.needs_loss_scaling:
        return None
    cfg = policy.loss_scaling
    return DynamicLossScaler(
        init_scale=cfg.init_scale, growth_factor=cfg.growth_factor, backoff_factor=cfg.backoff_factor,
        growth_interval=cfg.growth_interval, min_scale=cfg.min_scale, max_scale=cfg.max_scale,
        diagnose=diagnose,
    )


def autocast_scaler(dtype: torch.dtype | None) -> Callable[[], DynamicLossScaler | None]:
    """Scaler factory for a ``torch.autocast`` baseline: fp16 autocast trains with a dynamic
    loss scaler (the PyTorch AMP recipe: autocast + GradScaler), bf16 and fp32 without."""
    return (lambda: DynamicLossScaler()) if dtype == torch.float16 else (lambda: None)


class GradientsOnly:
    """Stands in for the optimizer of a :class:`TrainStep` whose gradients alone are wanted (drift
    passes): it has no parameter groups, and ``step``/``zero_grad`` are never called there."""

    param_groups: list[dict[str, Any]] = []

    def step(self) -> None:  # pragma: no cover - never called
        """Nothing: only gradients are wanted."""

    def zero_grad(self, set_to_none: bool = True) -> None:  # pragma: no cover
        """Nothing: only gradients are wanted."""


@dataclass
class StepStats:
    """What one training step did.

    Attributes:
        loss: Loss value (fp32 Python float; may be inf/NaN on an overflow step).
        skipped: True if the optimizer step was skipped (non-finite gradients).
        loss_scale: Loss scale used for this step (1.0 without a scaler).
        grad_norm: L2 norm of the unscaled gradients (inf if any is non-finite).
        nonfinite_grads: Number of non-finite gradient elements.
    """

    loss: float
    skipped: bool
    loss_scale: float
    grad_norm: float
    nonfinite_grads: int


class TrainStep:
    """A callable doing one full training step on a batch.

    Args:
        module: What to call on the batch (model, lowered module, or compiled module).
        params: The fp32 parameters (master weights) the optimizer updates.
        optimizer: Optimizer over ``params``; its state stays fp32.
        loss_fn: ``(output, batch) -> scalar Tensor``.
        scaler: Dynamic loss scaler, required when any compute is fp16.
        autocast_dtype: Run forward under ``torch.autocast(device, dtype)`` (the AMP baseline).
        device_type: ``"cpu"`` or ``"cuda"`` (for autocast).
        max_grad_norm: Clip the unscaled gradients to this L2 norm (None: no clipping).
        stats: Compute grad norm and non-finite count each step (costs one pass over grads).
        max_skips: Without a scaler, give up after this many consecutive skipped steps (None:
            never, as measurements need; ``autoprec train`` passes
            :data:`~autoprec.training.scaler.MAX_SKIPS_AT_FLOOR`, the scaler's own rule).
        diagnose: Names the first non-finite forward node for that error (e.g.
            :meth:`autoprec.Monitor.diagnoser`).

    Raises (from a step):
        LossScaleError: without a scaler, ``max_skips`` consecutive steps had inf/NaN gradients
            (case C09: bf16 and fp32 have no scale to lower, so the forward pass makes them); with
            one, as :meth:`DynamicLossScaler.update`.
    """

    def __init__(self, module: Callable[..., Any], params: list[nn.Parameter],
                 optimizer: torch.optim.Optimizer, loss_fn: Callable[[Any, Any], torch.Tensor],
                 scaler: DynamicLossScaler | None = None, autocast_dtype: torch.dtype | None = None,
                 device_type: str = "cpu", max_grad_norm: float | None = None, stats: bool = True,
                 max_skips: int | None = None, diagnose: Callable[[], str | None] | None = None) -> None:
        self.module, self.params, self.optimizer, self.loss_fn = module, params, optimizer, loss_fn
        self.scaler, self.autocast_dtype, self.device_type = scaler, autocast_dtype, device_type
        self.max_grad_norm, self.stats = max_grad_norm, stats
        self.max_skips, self.diagnose = max_skips, diagnose
        self._skips = 0  # consecutive skipped steps without a scaler

    def _context(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def forward_backward(self, batch: Any, weight: float = 1.0) -> torch.Tensor:
        """Forward, loss and (scaled) backward of ``loss * weight``; gradients accumulate into
        ``param.grad`` (fp32).

        Returns the unscaled, unweighted loss (detached). Call it several times before :meth:`finish`
        for gradient accumulation across micro-batches (``weight = 1 / micro-batches``, the mean):
        accumulation happens in the fp32 ``.grad`` of the master weights whatever the compute dtype
        (case C06), and the loss scaler unscales and checks once, in :meth:`finish`, as
        ``torch.amp.GradScaler`` does with accumulation.
        """
        with self._context():
            out = call_model(self.module, batch)
            loss = self.loss_fn(out, batch)
        loss = loss.float()
        weighted = loss * weight if weight != 1.0 else loss
        (self.scaler.scale(weighted) if self.scaler is not None else weighted).backward()
        return loss.detach()

    def finish(self) -> tuple[bool, float, float, int]:
        """Unscale, check, clip, optimizer step (or skip), scaler update, zero grads.

        Returns:
            ``(skipped, loss_scale_used, grad_norm, nonfinite_count)``.
        """
        scale = self.scaler.get_scale() if self.scaler is not None else 1.0
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        norm, bad = ((unscaled_grad_norm(self.params), _count_nonfinite(self.params)) if self.stats
                     else (0.0, 0))
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            skipped = bool(self.scaler.found_inf)
            self.scaler.update()
        else:
            skipped = bool(bad) if self.stats else False
            if not skipped:
                self.optimizer.step()
            self._skips = self._skips + 1 if skipped else 0
        self.optimizer.zero_grad(set_to_none=True)
        if self.max_skips is not None and self._skips >= self.max_skips:
            raise LossScaleError(nonfinite_steps_message(
                f"{self._skips} consecutive optimizer steps were skipped with inf/NaN gradients and no loss "
                "scaler (a bf16/fp32 policy: nothing to scale back, bf16 has fp32's range).", self.diagnose))
        return skipped, scale, norm, bad

    def __call__(self, batch: Any) -> StepStats:
        """One optimizer step on ``batch``; on an :class:`~autoprec.modelspec.micro_batches.Accumulated`
        one, a forward/backward per micro-batch (each loss weighted by 1/A, the reported loss their
        mean) and one optimizer step. Without a scaler a step with non-finite gradients is skipped
        too (no NaN is ever written into the weights)."""
        if isinstance(batch, Accumulated):
            w = 1.0 / len(batch.parts)
            loss = torch.stack([self.forward_backward(p, w) for p in batch.parts]).mean()
        else:
            loss = self.forward_backward(batch)
        skipped, scale, norm, bad = self.finish()
        return StepStats(float(loss), skipped, scale, norm, bad)

    def timed(self, batch: Any) -> tuple[StepStats, float]:
        """One step and its wall-clock seconds, with the device synchronised before and after
        (queued CUDA work is counted) — the one timing loop body of tune, bench, train."""
        self._sync()
        t0 = time.perf_counter()
        stats = self(batch)
        self._sync()
        return stats, time.perf_counter() - t0

    def _sync(self) -> None:
        if self.device_type == "cuda":
            torch.cuda.synchronize()


def _count_nonfinite(params: list[nn.Parameter]) -> int:
    total = 0
    for p in params:
        if p.grad is not None:
            total += int((~torch.isfinite(p.grad)).sum())
    return total
