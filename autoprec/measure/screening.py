"""Screening step times (docs/architecture.md#measurements): a search trial's training-step time
taken from the forward+backward passes its drift measurement runs anyway, plus the optimizer
update, measured once per harness, so an eager trial runs each step once instead of drift passes
and then timed steps beside them.

A training step is forward+backward, then the update (``TrainStep.finish``: unscale, the model
file's optimizer step, the scaler's update, zero grad). The update runs on the fp32 master
weights, whatever the policy computes in (docs/architecture.md#runtime), so its cost does not
depend on the trial; the forward+backward does, and the drift passes time it on batches
``1..K-1`` (batch 0's pass warms up and counts saved tensors through hooks).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from autoprec.device import sync
from autoprec.measure.drift import is_compiled
from autoprec.measure.measurement import Measurement
from autoprec.metrics import median
from autoprec.training.scaler import DynamicLossScaler

if TYPE_CHECKING:
    from autoprec.measure.harness import Harness

__all__ = ["UPDATE_RUNS", "applies", "from_drift_passes", "update_seconds"]

#: Timed runs of the update (after one untimed run, whose optimizer step creates its state, e.g.
#: AdamW's moments); their median is :func:`update_seconds`.
UPDATE_RUNS = 3


def applies(h: Harness, fn: Callable[..., Any], m: Measurement) -> bool:
    """Whether a screening measurement ``m`` of ``fn`` takes its step times from its drift passes:
    ``fn`` is eager (a compiled one's first pass compiles), the device is the CPU (CUDA's peak
    bytes are read after real steps, whose optimizer state a drift pass lacks), and a pass beside
    batch 0's was timed (two or more drift batches, all finite)."""
    return h.device.type == "cpu" and not is_compiled(fn) and len(m.pass_times) > 1


def from_drift_passes(h: Harness, m: Measurement, scaled: bool) -> Measurement:
    """Fill ``m``'s ``step_times`` (seconds: batch k's forward+backward, k ≥ 1, plus
    :func:`update_seconds`), ``step_s`` (their median) and ``tokens_per_s`` (the mean tokens of
    batches ``1..K-1`` per ``step_s``); returns ``m``.

    Args:
        h: The harness ``m`` was measured on.
        m: A drift measurement with ``pass_times`` (:meth:`Harness.drift`).
        scaled: The trial trains with a loss scaler (its update unscales first).
    """
    update = update_seconds(h, scaled)
    m.step_times = [s + update for s in m.pass_times[1:]]
    m.step_s = median(m.step_times)
    timed = h.batches[1:len(m.pass_times)]
    m.tokens_per_s = sum(h.spec.tokens_per_batch(b) for b in timed) / len(timed) / m.step_s
    return m


def update_seconds(h: Harness, scaled: bool) -> float:
    """Median wall-clock seconds (device synchronised) of a training step's update on ``h``'s
    parameters: ``TrainStep.finish`` with the model file's optimizer, a default
    :class:`DynamicLossScaler` when ``scaled``, on batch 0's FP32 reference gradients, over
    :data:`UPDATE_RUNS` runs after an untimed one. Measured on first use per ``scaled`` and cached
    in ``h.update_s``; the weights are restored afterwards."""
    if scaled not in h.update_s:
        step = h.train_step(h.graph_module, DynamicLossScaler() if scaled else None, None)
        times = []
        try:
            for _ in range(1 + UPDATE_RUNS):
                for p, g in zip(h.params, h.ref_grads, strict=True):
                    p.grad = g.clone()
                sync(h.device)
                t0 = time.perf_counter()
                step.finish()
                sync(h.device)
                times.append(time.perf_counter() - t0)
        finally:
            h.restore()
        h.update_s[scaled] = median(times[1:])
    return h.update_s[scaled]
