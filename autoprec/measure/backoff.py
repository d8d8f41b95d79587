"""The loss-scale back-off of training's first steps, found by exponential search: the scale a drift
measurement runs at (docs/architecture.md#measurements, "Drift";
:func:`autoprec.measure.drift.measure_drift`).

Training halves the scale after each overflowing step (``torch.amp.GradScaler``'s rule,
:meth:`autoprec.training.scaler.DynamicLossScaler.back_off_scales`) and keeps the first scale whose
gradients are finite. Each probe of that scale is a forward/backward, so the search counts probes:
an exponential ("galloping") search for the first index where a monotone predicate holds
(Bentley & Yao 1976, "An almost optimal algorithm for unbounded searching"), started from a guess
(:func:`first_true`), the first finite run over a range of loss scales built on it
(:func:`first_finite_run`), and the search over a scaler's back-offs (:func:`search_back_off`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from autoprec.training.scaler import DynamicLossScaler

__all__ = ["first_finite_run", "first_true", "search_back_off"]

R = TypeVar("R")  # what a run returns (a back-off search's: a forward/backward's result)


def first_true(holds: Callable[[int], bool], lo: int, hi: int, start: int) -> int:
    """The least ``j`` in ``(lo, hi]`` with ``holds(j)``, given ``holds(lo)`` false, ``holds(hi)``
    true and ``holds`` monotone (false, then true).

    Probes ``start`` (clamped into ``(lo, hi)``) first, then steps of 1, 2, 4, ... away from it
    (down while it holds, up while not) until the answer is bracketed, then bisects: about
    ``2·log2(|answer - start| + 1)`` probes, 1-2 when ``start`` is the answer, against
    ``log2(hi - lo)`` for bisection alone. ``holds`` is called once per probe, never on ``lo`` or
    ``hi``, and never twice on one ``j``.
    """
    j, step, direction = start, 1, 0
    while hi - lo > 1:
        if direction == 0:
            j = min(max(j, lo + 1), hi - 1)
        elif not lo < j < hi:  # bracketed: bisect
            j = (lo + hi) // 2
        turn = -1 if holds(j) else 1
        if turn < 0:
            hi = j
        else:
            lo = j
        if direction not in (0, turn):  # the answer lies between two probes: bisect from now on
            step = hi - lo
        direction = turn
        j, step = j + turn * step, step * 2
    return hi


def first_finite_run(run_at: Callable[[int], R], finite: Callable[[R], bool], last: int,
                     start: int, lo: int = 0) -> tuple[R, int]:
    """``(run_at(j), j)`` for the least ``j`` in ``lo+1..last`` whose run is finite, ``run_at(lo)``
    being known non-finite and finiteness monotone in ``j``; ``(run_at(last), last)`` when even
    ``run_at(last)`` is not finite.

    ``run_at(start)`` first (``start`` clamped to ``lo+1..last``); when it is not finite,
    ``run_at(last)`` next, so a range that never turns finite costs two runs; then
    :func:`first_true` from ``start``. Only the finite run at the smallest ``j`` so far is kept
    (one result alive besides the one being made: a run may hold a whole set of gradients).
    """
    kept: dict[int, R] = {}

    def holds(j: int) -> bool:
        r = run_at(j)
        if not finite(r):
            kept[-1] = r  # the last one's, should it overflow too
            return False
        kept.clear()
        kept[j] = r  # runs that hold come at ever smaller j
        return True

    start = min(max(start, lo + 1), last)
    if holds(start):
        hi = start
    elif start == last or not holds(last):
        return kept[-1], last
    else:
        lo, hi = start, last
    j = first_true(holds, lo, hi, start)
    return kept[j], j


def search_back_off(scaler: DynamicLossScaler, run: Callable[[], R], finite: Callable[[R], bool], first: R,
                    max_backoffs: int, hint: int = 1, overflowed: int = 0) -> tuple[R, int]:
    """The run at the scale where training's back-off stops, found by exponential search.

    Training halves the scale after each overflowing step (``torch.amp.GradScaler``'s rule) and
    keeps the first scale whose gradients are finite: ``s_j`` of ``scaler.back_off_scales``, ``j``
    at most ``max_backoffs``. Overflow grows with the scale (finite at ``s_j``, finite below),
    so instead of one forward/backward per back-off: ``j = hint`` first (non-finite there, the
    floor next, and non-finite at the floor is a failure at once), then an exponential search
    from it (:func:`first_finite_run`): about ``2·log2(|j - hint| + 1)`` runs, 2 when the hint
    is right (a search passes its previous policy's back-offs), 1 when ``first`` ran one back-off
    short of it. Only the scale changes: the rest of the scaler's state
    (growth tracker, skip counters) is as it was.

    Args:
        scaler: The loss scaler whose back-offs are searched (its scale is set for each run).
        run: One forward/backward at ``scaler``'s current scale.
        finite: Whether a run's loss and gradients are finite.
        first: The run at ``s_overflowed`` (``s_0``: the current scale), whose gradients were
            not finite (so neither are those of any larger scale: the answer is past it).
        max_backoffs: The most back-offs training would make (≥ 0).
        hint: The ``j`` tried first (clamped to the scales there are; the result does not
            depend on it, only the number of runs).
        overflowed: The back-offs of ``first``'s scale (< the scales there are).

    Returns:
        ``(run, j)``: the run at the first finite scale (or at the last scale tried, non-finite,
        when even the floor overflows) and the number of back-offs ``j`` training would make.
        The scaler is left at that scale; disabled, or already at the floor: ``(first, 0)``.

    Raises:
        Exception: whatever ``run`` raises (the scaler is then left at the scale of that run).
    """
    scales = scaler.back_off_scales(max_backoffs)
    if len(scales) < 2:
        return first, 0
    state = scaler.state_dict()

    def at(j: int) -> R:
        scaler.load_state_dict({**state, "scale": scales[j]})
        return run()

    r, j = first_finite_run(at, finite, len(scales) - 1, hint, lo=overflowed)
    scaler.load_state_dict({**state, "scale": scales[j]})
    return r, j
