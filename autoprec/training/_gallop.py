"""Exponential ("galloping") search for the first index where a monotone predicate holds
(Bentley & Yao 1976, "An almost optimal algorithm for unbounded searching"), started from a guess,
and the first finite run over a range of loss scales built on it: the loss scaler's back-off search
(:meth:`autoprec.training.scaler.DynamicLossScaler.search_back_off`) runs a forward/backward per
probe, so the probes are what it counts."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

__all__ = ["first_finite_run", "first_true"]

R = TypeVar("R")


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
