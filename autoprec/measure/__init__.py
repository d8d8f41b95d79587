"""Measurements (docs/architecture.md#measurements): the :class:`Harness` (throughput, drift against
FP32 and memory of training steps on one set of weights and batches), drift over K batches
(:mod:`autoprec.measure.drift`), what one measurement holds (:mod:`autoprec.measure.measurement`),
the memory rule (:mod:`autoprec.measure.memory`), interleaved timing (:mod:`autoprec.measure.timing`)
with a noise band (:mod:`autoprec.measure.noise`), a configuration's own training run taken in turns
(:mod:`autoprec.measure.train_run`) and the busy-machine check (:mod:`autoprec.measure.load`).

The layer below the search (``autoprec tune``) and the bench commands: both measure through it, and
it imports neither (docs/architecture.md#layers).
"""

from autoprec.capture import batch_shapes
from autoprec.measure.drift import (
    DRIFT_BATCHES,
    MAX_BACKOFFS,
    BatchDrift,
    Drift,
    References,
    batch_drift,
    is_compiled,
    measure_drift,
)
from autoprec.measure.harness import MIN_TIMED_STEPS, TIMED_BUDGET_S, Harness
from autoprec.measure.load import BusyMachineError, LoadCheck, LoadMonitor
from autoprec.measure.measurement import Measurement, describe_failure
from autoprec.measure.memory import PeakBytes, SavedBytes, optimizer_state_bytes, training_state_bytes
from autoprec.measure.noise import BOOTSTRAP_RESAMPLES, Comparison, Timing, TimingEnd, compare, format_rate
from autoprec.measure.outcome import Outcome, Stage
from autoprec.measure.timing import Config, Narrow, Retire, Settled, time_interleaved
from autoprec.measure.train_run import TrainRun, shareable

__all__ = [
    "BOOTSTRAP_RESAMPLES", "DRIFT_BATCHES", "MAX_BACKOFFS", "MIN_TIMED_STEPS", "TIMED_BUDGET_S",
    "BatchDrift", "BusyMachineError", "Comparison", "Config", "Drift", "Harness", "LoadCheck",
    "LoadMonitor", "Measurement", "Narrow", "Outcome", "PeakBytes", "References", "Retire", "SavedBytes",
    "Settled", "Stage", "Timing", "TimingEnd",
    "TrainRun", "batch_drift", "batch_shapes", "compare", "describe_failure", "format_rate", "is_compiled",
    "measure_drift", "optimizer_state_bytes", "shareable", "time_interleaved", "training_state_bytes",
]
