"""Exponential ("galloping") search for the first index where a monotone predicate holds
(Bentley & Yao 1976, "An almost optimal algorithm for unbounded searching"), started from a guess:
the loss scaler's back-off search (:meth:`autoprec.training.scaler.DynamicLossScaler.search_back_off`)
runs a forward/backward per probe, so the probes are what it counts."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["first_true"]


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
