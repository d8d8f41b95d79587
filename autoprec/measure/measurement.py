"""What one measurement holds (:class:`Measurement`, docs/architecture.md#measurements) and the line
its ``error`` gives for a failure (:func:`describe_failure`); :mod:`autoprec.measure.harness` fills
it, its memory by the rule of :mod:`autoprec.measure.memory`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["Accepted", "Measurement", "describe_failure"]


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
            non-finite (the last value, inf). :class:`autoprec.search.decide.DriftBudget` judges these.
        loss_rel: |L − L₃₂| / |L₃₂|, the mean over the K drift batches.
        grad_sqnr_db_min: Minimum per-parameter gradient SQNR in dB, the min over the K drift batches.
        peak_bytes: CUDA peak allocated bytes; on CPU (the rule of :mod:`autoprec.measure.memory`)
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
        error: Why the measurement failed (non-finite values, compile error, out of memory).
        note: Remarks that do not invalidate it (e.g. timing stopped by the slow-step rule of
            :func:`autoprec.training.steps.slow_step_guard`, timed on its last step only).
        cut: Why the drift passes stopped before the K-th batch (a search trial's screening cut,
            ``Harness.measure(..., cut=...)``); None when every batch ran. The other fields then
            hold what the batches run so far measured.
        accepted: Why the drift passes stopped before the K-th batch with the trial accepted, not
            cut: the batches run so far put its drift within the budget beyond noise (the
            screening's early acceptance, :mod:`autoprec.search.screen_cut`). It is judged on
            those batches and stands for the whole: such a trial can be a finalist, and a
            finalist is measured again on all K.
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
    error: str | None = None
    note: str | None = None
    cut: str | None = None
    accepted: str | None = None

    def add_note(self, remark: str | None, first: bool = False) -> None:
        """Join ``remark`` to :attr:`note` with ``"; "`` (before it when ``first``); None or "" adds
        nothing."""
        parts = (remark, self.note) if first else (self.note, remark)
        self.note = "; ".join(x for x in parts if x) or None


@dataclass(frozen=True)
class Accepted:
    """What a drift measurement's stop (``Harness.measure``'s ``cut``) returns to end the passes
    without a cut: ``why`` becomes :attr:`Measurement.accepted` (a plain string returned becomes
    :attr:`Measurement.cut`)."""

    why: str


def describe_failure(e: BaseException) -> str:
    """One line for a failed measurement: ``"<kind>: <first line of the message, ≤ 300 chars>"``,
    the kind ``out of memory`` when the message says so, else the exception's class name."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    kind = "out of memory" if "out of memory" in str(e).lower() else type(e).__name__
    return f"{kind}: {text[:300]}"
