"""What one measurement holds (:class:`Measurement`, docs/architecture.md#measurements) and the line
its ``error`` gives for a failure (:func:`describe_failure`); :mod:`autoprec.measure.harness` fills
it, its memory by the rule of :mod:`autoprec.measure.memory`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from autoprec.measure.outcome import Outcome, Stage

__all__ = ["Measurement", "describe_failure"]


@dataclass
class Measurement:
    """One configuration measured on the harness's weights and batches.

    Attributes:
        step_s: Median wall-clock seconds of a full training step after warm-up (inf if not timed).
        tokens_per_s: Mean tokens per timed step / ``step_s`` (with batches of varying shapes the
            timed steps cycle through them: their mean rate).
        grad_rel_l2: ‖g − g₃₂‖/‖g₃₂‖, the mean over the K drift batches of
            :attr:`grad_rel_l2_batches` (inf if any is non-finite).
        grad_rel_l2_batches: ‖g − g₃₂‖/‖g₃₂‖ on each drift batch ``get_batch(0..K-1)``
            (K = :attr:`Harness.drift_batches`), in batch order; fewer than K when a batch was
            non-finite (the last value, inf). :class:`autoprec.search.drift_budget.DriftBudget` judges these.
        loss_rel: |L − L₃₂| / |L₃₂|, the mean over the K drift batches.
        grad_sqnr_db_min: Minimum per-parameter gradient SQNR in dB, the min over the K drift batches.
        peak_bytes: On CUDA the allocator's peak over the drift passes and timed steps less what
            was allocated before, plus the model's own bytes (:class:`~autoprec.measure.memory.CudaPeak`);
            on CPU (the rule of :mod:`autoprec.measure.memory`)
            bytes of the distinct tensors saved for backward in batch 0's drift pass
            (:class:`~autoprec.measure.memory.SavedBytes`; a saved parameter allocates nothing and
            is not counted again) + :attr:`Harness.state_bytes`: parameter and gradient bytes
            plus the bytes of the tensors the model file's ``make_optimizer`` optimizer holds in
            its state after one step (:func:`autoprec.measure.memory.training_state_bytes`; per
            fp32 parameter: 8 bytes with SGD, 12 with SGD momentum, 16 with AdamW, the default).
        step_times: All timed step durations (seconds). A screening measurement
            (``Harness.measure(..., screen=True)``) on the CPU takes them from the drift passes:
            every batch k's forward+backward (``pass_times[k]``) plus the optimizer update's median
            seconds, measured once per harness.
        pass_times: Wall-clock seconds of each drift batch's forward+backward (the last pass run on
            it, after any back-offs), in batch order; batch 0's pass also counts the tensors saved
            for backward (memory hooks: 0-2% of a 24-layer Qwen2's pass).
        outcome: How the measurement ended (:class:`~autoprec.measure.outcome.Outcome`): went on
            through every batch (``CONTINUE``); failed (``FAILED``: non-finite values, compile error,
            out of memory); or its drift passes stopped before the K-th batch, a search trial's
            screening cut (``CUT``: ``Harness.measure(..., cut=...)``) or early acceptance
            (``ACCEPTED``: the batches run so far put its drift within the budget beyond noise,
            :mod:`autoprec.search.screen_cut`; it stands for the whole, so such a trial can be a
            finalist, and a finalist is measured again on all K). When stopped, the other fields
            hold what the batches run so far measured.
        note: Remarks that do not invalidate it (e.g. timing stopped by the slow-step rule of
            :func:`autoprec.training.steps.slow_step_guard`, timed on its last step only).
    """

    step_s: float = math.inf
    tokens_per_s: float = 0.0
    grad_rel_l2: float = math.inf
    grad_rel_l2_batches: list[float] = field(default_factory=list)
    loss_rel: float = math.inf
    grad_sqnr_db_min: float = -math.inf
    peak_bytes: int = 0
    step_times: list[float] = field(default_factory=list)
    pass_times: list[float] = field(default_factory=list)
    outcome: Outcome = field(default_factory=Outcome.go_on)
    note: str | None = None

    @property
    def failed(self) -> bool:
        """Whether the measurement failed (:attr:`Stage.FAILED`)."""
        return self.outcome.stage is Stage.FAILED

    @property
    def error(self) -> str | None:
        """Why it failed (the log's and the report's words), None when it did not."""
        return self.outcome.reason_if(Stage.FAILED)

    @property
    def cut(self) -> str | None:
        """Why the screening cut stopped its drift passes, None when it did not."""
        return self.outcome.reason_if(Stage.CUT)

    @property
    def accepted(self) -> str | None:
        """Why the screening accepted it early, None when it did not."""
        return self.outcome.reason_if(Stage.ACCEPTED)

    def fail(self, reason: str) -> None:
        """Mark it failed with ``reason`` (it replaces a cut or an acceptance)."""
        self.outcome = Outcome.failed(reason)

    def add_note(self, remark: str | None, first: bool = False) -> None:
        """Join ``remark`` to :attr:`note` with ``"; "`` (before it when ``first``); None or "" adds
        nothing."""
        parts = (remark, self.note) if first else (self.note, remark)
        self.note = "; ".join(x for x in parts if x) or None


def describe_failure(e: BaseException) -> str:
    """One line for a failed measurement: ``"<kind>: <first line of the message, ≤ 300 chars>"``,
    the kind ``out of memory`` when the message says so, else the exception's class name."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    kind = "out of memory" if "out of memory" in str(e).lower() else type(e).__name__
    return f"{kind}: {text[:300]}"
