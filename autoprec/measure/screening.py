"""Screening step times (docs/architecture.md#measurements): a search trial's training-step time
taken from the forward+backward passes its drift measurement runs anyway, plus the optimizer
update, measured once per harness, so an eager trial runs each step once instead of drift passes
and then timed steps beside them.

A training step is forward+backward, then the update (``TrainStep.finish``: unscale, the model
file's optimizer step, the scaler's update, zero grad). The update runs on the fp32 master
weights, whatever the policy computes in (docs/architecture.md#runtime), so its cost does not
depend on the trial; the forward+backward does, and the drift passes time it on every batch
``0..K-1``. Batch 0's pass also counts saved tensors through hooks and is the first run of the
trial's graph: on a 24-layer Qwen2 (one core) it took 0-2% longer than the later passes, on 4
layers 0-7% (up to 15% for an fp16 trial whose batch 0 backed its loss scale off), which the
median of the K passes and the screening cut's margin absorb.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from autoprec.device import sync
from autoprec.measure.drift import is_compiled
from autoprec.measure.measurement import Measurement
from autoprec.metrics import median
from autoprec.training.train import TrainStep

__all__ = ["UPDATE_RUNS", "applies", "from_drift_passes", "time_update"]

#: Timed runs of the update (after one untimed run, whose optimizer step creates its state, e.g.
#: AdamW's moments); their median is what :func:`time_update` returns.
UPDATE_RUNS = 3


def applies(device: torch.device, fn: Callable[..., Any], batches: int) -> bool:
    """Whether a screening measurement of ``fn`` on ``batches`` drift batches (K) takes its step
    times from its drift passes: ``fn`` is eager (a compiled one's first pass compiles), the device
    is the CPU (CUDA's peak bytes are read after real steps, whose optimizer state a drift pass
    lacks), and K ≥ 2 (one pass alone would be a single-step speed)."""
    return device.type == "cpu" and not is_compiled(fn) and batches > 1


def from_drift_passes(m: Measurement, tokens_per_step: float, update_s: float) -> Measurement:
    """Fill ``m``'s ``step_times`` (seconds: drift batch k's forward+backward plus ``update_s``, for
    every batch run so far, in batch order), ``step_s`` (their median) and ``tokens_per_s``
    (``tokens_per_step / step_s``); returns ``m``.

    Args:
        m: A drift measurement with ``pass_times`` (``Harness.drift``).
        tokens_per_step: Mean tokens of the drift batches run (the harness's ``tokens_per_batch``
            rule).
        update_s: Seconds of the update (``Harness.update_seconds``).
    """
    m.step_times = [s + update_s for s in m.pass_times]
    m.step_s = median(m.step_times)
    m.tokens_per_s = tokens_per_step / m.step_s
    return m


def time_update(step: TrainStep, grads: list[torch.Tensor], device: torch.device) -> float:
    """Median wall-clock seconds (device synchronised) of ``step.finish()`` (unscale when ``step``
    has a scaler, the optimizer step, the scaler's update, zero grad) over :data:`UPDATE_RUNS` runs
    after an untimed one, each with ``step.params``' gradients set to copies of ``grads`` (fp32,
    one per parameter). The parameters are updated: the caller restores them."""
    times = []
    for _ in range(1 + UPDATE_RUNS):
        for p, g in zip(step.params, grads, strict=True):
            p.grad = g.clone()
        sync(device)
        t0 = time.perf_counter()
        step.finish()
        sync(device)
        times.append(time.perf_counter() - t0)
    return median(times[1:])
