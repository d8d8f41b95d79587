"""Tokens/s with its noise band in the report's tables, and ties (docs/architecture.md#measurements,
"Throughput"; issue 19).

Every tokens/s a table prints carries the bootstrap 95% band of its median step
(:meth:`autoprec.measure.noise.Timing.from_steps`) as ``±`` the band's relative half-width, and
a row whose throughput is within the noise of the table's fastest (the band of the ratio contains
1: :func:`autoprec.measure.noise.compare`) says ``tie``. Timings come from the step times a
measurement recorded; a row without them says why it has no band.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autoprec.measure import Timing, compare, format_rate
from autoprec.metrics import median

__all__ = ["rate_text", "timing_of", "ties_with_fastest"]


def timing_of(step_times: Sequence[float] | None, tokens_per_s: float | None) -> Timing:
    """A :class:`Timing` of recorded ``step_times`` (seconds) at ``tokens_per_s`` (the tokens per
    step are ``tokens_per_s x median step``); an untimed Timing when either is missing."""
    times = [float(t) for t in (step_times or []) if t is not None and math.isfinite(t) and t > 0]
    if not times or not tokens_per_s or not math.isfinite(tokens_per_s):
        return Timing()
    return Timing.from_steps(times, tokens_per_s * median(times))


def rate_text(tokens_per_s: float | None, timing: Timing | None = None) -> str:
    """Tokens/s for a table: :func:`autoprec.measure.noise.format_rate` when ``timing`` has step
    times (``"6947 ±2.1%"``, or ``"6947 (1 step: no band)"`` when the slow-step rule stopped it
    after one); ``"6947 (no band)"`` without step times (a study written before
    bands were recorded); ``""`` when not measured."""
    if not tokens_per_s or tokens_per_s <= 0:
        return ""
    if timing is None or not timing.step_times:
        return f"{tokens_per_s:.0f} (no band)"
    return format_rate(timing)


def ties_with_fastest(timings: Sequence[Timing | None], names: Sequence[str]) -> list[str | None]:
    """Per timing, the name of the fastest timing (by median tokens/s, two or more steps) when the
    two tie within the noise (:func:`autoprec.measure.noise.compare`: the ratio's band contains
    1), else None; None for the fastest itself and for timings without two steps.

    Raises:
        ValueError: ``timings`` and ``names`` differ in length.
    """
    if len(timings) != len(names):
        raise ValueError(f"{len(timings)} timings for {len(names)} names")
    timed = [i for i, t in enumerate(timings)
             if t is not None and len(t.step_times) > 1 and t.tokens_per_s > 0]
    out: list[str | None] = [None] * len(timings)
    if not timed:
        return out
    best = max(timed, key=lambda i: timings[i].tokens_per_s)
    for i in timed:
        if i != best and compare(timings[i], timings[best]).tie:
            out[i] = names[best]
    return out
