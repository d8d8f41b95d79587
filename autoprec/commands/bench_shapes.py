"""``autoprec bench`` on batches that vary in shape (docs/architecture.md#measurements).

A model file whose ``get_batch`` pads to the longest sequence gives a new shape at almost every
step. Every bench row must run all of the harness's batches, and no compile may be timed:

- the captured graphs (``fp32_*``, ``policy_*``) follow the rule of ``tune`` and ``train``
  (:func:`autoprec.capture.capture_for`): dynamic
  batch/sequence dimensions when the shapes vary, ranges covering every batch the bench runs
  (:func:`cover_batches` captures the harness's graph again when ``--steps`` brings batches
  past the first ones'), so one compile serves every shape;
- ``autocast_compiled`` and ``pure_low_compiled`` (``torch.compile`` of the ``nn.Module``) compile
  with ``dynamic=True`` when the shapes vary (:func:`autoprec.capture.autocast_dynamic`, as
  ``tune``), instead of once per shape;
- the timing's warm-up runs every batch up to the last first appearance of a shape
  (:func:`autoprec.capture.warmup_steps`, as ``tune``), so each configuration meets each shape
  (and compiles, if it must) before a step is timed;
- :class:`CompileWatch` counts compiles during the timed steps anyway; a timed step whose
  forward compiled is left out of the row's timing (:func:`drop_compiled_steps`), and the row
  says how many (``compiles_timed``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autoprec.applied.shape_cache import is_dynamic
from autoprec.capture import InputShapes, capture_for
from autoprec.device import compile_count
from autoprec.measure import Timing
from autoprec.modelspec import split_batch

__all__ = ["CompileWatch", "cover_batches", "drop_compiled_steps"]


def cover_batches(h: Any) -> bool:
    """Capture the harness's graph again, over all its batches, when one of them falls outside
    its dynamic ranges (the harness captured on its first batches only); returns whether it did.

    Args:
        h: The :class:`~autoprec.measure.harness.Harness`; ``h.graph_module`` is replaced (its
            FP32 references, already computed on the first batches, are unchanged by the wider ranges).
    """
    gm = h.graph_module
    if not is_dynamic(gm):
        return False
    check = InputShapes(gm, what="the captured graph")
    for b in h.batches:
        try:
            check.check(*split_batch(b))
        except ValueError:
            h.graph_module = capture_for(h.model, h.batches)
            return True
    return False


class CompileWatch:
    """A configuration's function during timing: counts its calls and the calls that compiled.

    A compile is a rise of Dynamo's graph count (:func:`autoprec.device.compile_count`)
    across the call; the backward of a newly compiled forward compiles in the same step.

    Args:
        fn: The function the drift pass ran (compiled or not).

    Attributes:
        calls: Calls so far (one per training step).
        compiled: 0-based indices of the calls that compiled.
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.calls = 0
        self.compiled: list[int] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call ``fn`` and note whether the call compiled."""
        before = compile_count()
        try:
            return self.fn(*args, **kwargs)
        finally:
            if compile_count() != before:
                self.compiled.append(self.calls)
            self.calls += 1


def drop_compiled_steps(t: Timing, watch: CompileWatch, warm: int, tokens: float) -> tuple[Timing, int]:
    """``t`` without the timed steps whose forward compiled, and how many there were.

    Args:
        t: The configuration's interleaved timing (its steps after ``warm`` untimed ones).
        watch: Its :class:`CompileWatch` (calls counted from the warm-up's first step).
        warm: Untimed warm-up steps before the first timed one.
        tokens: Tokens per step (the harness's).

    Returns:
        ``(timing, n)``: the timing re-made from the other steps (error, note, cap and peak memory
        kept), or ``t`` itself when ``n`` is 0 or no step would be left.
    """
    late = {i - warm for i in watch.compiled if i >= warm}
    late = {i for i in late if i < len(t.step_times)}
    if not late or t.error is not None or len(late) >= len(t.step_times):
        return t, len(late)
    kept = [s for i, s in enumerate(t.step_times) if i not in late]
    out = Timing.from_steps(kept, tokens, rounds=t.rounds)
    out.end, out.note, out.peak_bytes = t.end, t.note, t.peak_bytes
    return out, len(late)

