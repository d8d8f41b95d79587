"""A timing's noise band, and whether one throughput beats another beyond the noise
(docs/architecture.md#measurements, "Throughput").

:class:`Timing` holds one configuration's step times with a bootstrap 95% percentile interval of
their median (Efron & Tibshirani 1993, *An Introduction to the Bootstrap*, ch. 13) and their
interquartile range; :func:`compare` gives the ratio of two throughputs with its 95% band (paired
by round: Student's t; else a bootstrap; a tie when it contains 1.0); :func:`format_rate` writes a
rate with its band for tables. The
interleaved rounds that produce the step times are :mod:`autoprec.measure.timing`'s.
"""

from __future__ import annotations

import enum
import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from autoprec.metrics import median, t975

__all__ = ["BOOTSTRAP_RESAMPLES", "CONFIDENCE", "PAIRED_MIN_ROUNDS", "Comparison", "Timing", "TimingEnd",
           "compare", "format_rate"]

#: Bootstrap resamples for every band (Efron & Tibshirani 1993 suggest >= 1000 for percentile intervals).
BOOTSTRAP_RESAMPLES = 1000
#: Coverage of every band: 95% (percentile intervals: the 2.5th and 97.5th percentiles).
CONFIDENCE = 0.95
#: Rounds two timings must share for :func:`compare` to pair them round by round: the head-to-head's
#: first look (``time_interleaved``'s ``min_rounds``). With 3 rounds the t interval's half-width is
#: 4.30 standard errors (:func:`autoprec.metrics.t975`): only a clear difference separates so early.
PAIRED_MIN_ROUNDS = 3


class TimingEnd(enum.Enum):
    """How a configuration's timing ended (its reason in :attr:`Timing.note`), as Optuna's
    ``TrialState`` ends a trial and :class:`autoprec.measure.outcome.Stage` a measurement."""

    #: Timed as long as the rounds ran (or not timed at all); a ``note`` is a remark (time cap reached,
    #: timed no further once the decision was settled).
    TIMED = "timed"
    #: A step raised; ``note`` is the exception (:func:`autoprec.measure.measurement.describe_failure`).
    FAILED = "failed"
    #: The slow-step rule stopped it (:func:`autoprec.training.steps.slow_step_guard`); ``note`` says when.
    TOO_SLOW = "too slow"
    #: The caller's ``retire`` rule stopped it (:func:`autoprec.measure.timing.time_interleaved`): its
    #: tokens/s is of the rounds before, which the others' later rounds need not match on a machine
    #: whose speed drifts; ``note`` says why.
    RETIRED = "retired"


@dataclass
class Timing:
    """Step times of one configuration and their noise band.

    Attributes:
        step_times: Every timed step's wall-clock seconds, in the order run.
        step_s: Their median (:func:`autoprec.metrics.median`), seconds; inf when none.
        band_s: ``(lo, hi)``: bootstrap 95% percentile interval of the median, seconds, widened to
            contain ``step_s`` if it does not.
        iqr_s: Interquartile range of the step times, seconds (quartiles interpolated linearly,
            ``statistics.quantiles(method="inclusive")``, as ``torch.quantile`` in
            torch.utils.benchmark's ``Measurement.iqr``).
        tokens_per_s: Tokens per timed step / ``step_s`` (0.0 when not timed).
        tokens_per_s_band: ``(tokens / hi, tokens / lo)``, tokens/s.
        rounds: Rounds it was timed in.
        round_steps: The step times of each of those rounds, in round order
            (:func:`autoprec.measure.timing.time_interleaved`; empty for a timing not run in rounds):
            :func:`compare` pairs two timings round by round.
        end: How its timing ended (:class:`TimingEnd`); :attr:`error`, :attr:`too_slow` and
            :attr:`retired` are read-only views of it.
        note: Why it ended so, or a remark that does not invalidate it (time cap reached).
        peak_bytes: On CUDA, estimated peak allocated bytes of its steps (memory resident before
            timing + its own optimizer state + the most any of its rounds allocated on top);
            None on CPU.
    """

    step_times: list[float] = field(default_factory=list)
    step_s: float = math.inf
    band_s: tuple[float, float] = (math.inf, math.inf)
    iqr_s: float = math.inf
    tokens_per_s: float = 0.0
    tokens_per_s_band: tuple[float, float] = (0.0, 0.0)
    rounds: int = 0
    round_steps: list[list[float]] = field(default_factory=list)
    end: TimingEnd = TimingEnd.TIMED
    note: str | None = None
    peak_bytes: int | None = None

    @property
    def error(self) -> str | None:
        """Why its timing failed (the exception a step raised), else None."""
        return self.note if self.end is TimingEnd.FAILED else None

    @property
    def too_slow(self) -> bool:
        """The slow-step rule stopped its timing (:attr:`TimingEnd.TOO_SLOW`)."""
        return self.end is TimingEnd.TOO_SLOW

    @property
    def retired(self) -> bool:
        """The caller's ``retire`` rule stopped its timing (:attr:`TimingEnd.RETIRED`)."""
        return self.end is TimingEnd.RETIRED

    @classmethod
    def from_steps(cls, step_times: Sequence[float], tokens_per_step: float, rounds: int = 0,
                   resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0,
                   round_steps: Sequence[Sequence[float]] = ()) -> Timing:
        """A timing of ``step_times`` (seconds) with ``tokens_per_step`` tokens each (grouped by
        round in ``round_steps`` when timed in rounds).

        The band resamples the step times ``resamples`` times with ``random.Random(seed)`` (so the
        same times give the same band) and takes the 2.5th and 97.5th percentiles of the resampled
        medians (Efron & Tibshirani 1993, ch. 13). An empty ``step_times`` gives an untimed Timing.
        """
        t = cls(step_times=list(step_times), rounds=rounds, round_steps=[list(r) for r in round_steps if r])
        if not t.step_times:
            return t
        t.step_s = median(t.step_times)
        t.band_s = _band(t.step_times, median, resamples, seed)
        t.band_s = (min(t.band_s[0], t.step_s), max(t.band_s[1], t.step_s))
        if len(t.step_times) > 1:
            q1, _q2, q3 = statistics.quantiles(t.step_times, n=4, method="inclusive")
            t.iqr_s = q3 - q1
        else:
            t.iqr_s = 0.0
        t.tokens_per_s = tokens_per_step / t.step_s if t.step_s > 0 else math.inf
        lo, hi = t.band_s
        t.tokens_per_s_band = (tokens_per_step / hi if hi > 0 else math.inf,
                               tokens_per_step / lo if lo > 0 else math.inf)
        return t

    def rel_half_width(self) -> float:
        """Half the band's width over the median (e.g. 0.021 for ±2.1%); inf when not timed."""
        if not self.step_times or not math.isfinite(self.step_s) or self.step_s <= 0:
            return math.inf
        return (self.band_s[1] - self.band_s[0]) / 2 / self.step_s


@dataclass
class Comparison:
    """Throughput of timing ``a`` against ``b`` (:func:`compare`).

    Attributes:
        ratio: a's tokens/s over b's (> 1: a is faster): the geometric mean of the per-round ratios
            when paired, else from the medians.
        band: 95% interval of the ratio: Student's t over the per-round log-ratios when paired,
            the percentile bootstrap of both timings' steps otherwise (:func:`compare`).
        tie: The band contains 1.0: the difference is within the noise.
        winner: ``"a"``, ``"b"``, or None on a tie.
        rounds: The rounds paired (0: unpaired). A paired ratio need not be the ratio of the two
            timings' median tokens/s, which tables and policy files give.
    """

    ratio: float
    band: tuple[float, float]
    tie: bool
    winner: str | None
    rounds: int = 0


def compare(a: Timing, b: Timing, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> Comparison:
    """Whether ``a``'s throughput differs from ``b``'s beyond the noise.

    **Paired** (both timed in the same interleaved rounds, at least :data:`PAIRED_MIN_ROUNDS` of
    them in common, :attr:`Timing.round_steps`): per round both ran, the ratio of a's throughput to
    b's from that round's median steps; the ratio is their geometric mean, its band Student's t
    interval of the mean log-ratio, ``mean ± t_{0.975, n-1} · s / √n`` over the n rounds (the
    paired t-test's interval; :func:`autoprec.metrics.t975`). Not the percentile bootstrap of that
    mean: over three rounds it is the range of the three ratios, which excludes 1.0 whenever all
    three fall on one side, one tie in four (coverage ~75%, not 95%); fresh-clone ``make tune``
    runs retired fp32 compiled regional against flat (the same kernels on that CPU) at 0.83x,
    0.93x and 1/0.86x after 3-4 rounds. A machine whose speed drifts between
    rounds slows both alike, so the drift cancels in each round's ratio instead of widening both
    timings' bands (the interleaving's purpose, :mod:`autoprec.measure.timing`): the fp32 eager
    steps of a 24-layer Qwen2 against its captured graph's, eight rounds on a 2-core CPU whose
    rounds drifted 0.57-0.68 s, gave per-round ratios within ±5% against medians each ±6%.

    **Unpaired** otherwise: both timings' step times are resampled with replacement and the ratio
    of the resampled medians' throughputs is taken, the ratio itself from the medians (the
    two-sample percentile bootstrap: its 2.5th and 97.5th percentiles bound it).

    Raises:
        ValueError: either timing has no step times (failed or not timed).
    """
    if not a.step_times or not b.step_times:
        raise ValueError("compare needs two timed configurations (one has no step times)")
    tok_a, tok_b = a.tokens_per_s * a.step_s, b.tokens_per_s * b.step_s  # tokens per step
    rng = random.Random(seed)
    paired = [math.log((tok_a / median(x)) / (tok_b / median(y)))  # the rounds both ran, from the first
              for x, y in zip(a.round_steps, b.round_steps)]
    if len(paired) >= PAIRED_MIN_ROUNDS:
        mean = statistics.fmean(paired)
        half = t975(len(paired) - 1) * statistics.stdev(paired) / math.sqrt(len(paired))
        ratio, lo, hi = math.exp(mean), math.exp(mean - half), math.exp(mean + half)
    else:
        ratio = (tok_a / a.step_s) / (tok_b / b.step_s)
        lo, hi = _percentiles(sorted((tok_a / median(rng.choices(a.step_times, k=len(a.step_times))))
                                     / (tok_b / median(rng.choices(b.step_times, k=len(b.step_times))))
                                     for _ in range(resamples)))
    lo, hi = min(lo, ratio), max(hi, ratio)
    tie = lo <= 1.0 <= hi
    return Comparison(ratio, (lo, hi), tie, None if tie else ("a" if lo > 1.0 else "b"),
                      len(paired) if len(paired) >= PAIRED_MIN_ROUNDS else 0)


def format_rate(t: Timing) -> str:
    """Tokens/s with its noise band for tables: ``"6947 ±2.1%"`` (:meth:`Timing.rel_half_width`);
    ``"6947 (1 step: no band)"`` when timed on one step (the slow-step rule); ``"—"`` when not timed."""
    if not t.step_times or t.tokens_per_s <= 0:
        return "—"
    if len(t.step_times) == 1:
        return f"{t.tokens_per_s:.0f} (1 step: no band)"
    return f"{t.tokens_per_s:.0f} ±{100 * t.rel_half_width():.1f}%"


def _percentiles(sorted_values: list[float]) -> tuple[float, float]:
    """The (1 − CONFIDENCE)/2 and (1 + CONFIDENCE)/2 order statistics of sorted values."""
    n = len(sorted_values)
    alpha = (1 - CONFIDENCE) / 2
    return sorted_values[min(int(alpha * n), n - 1)], sorted_values[max(math.ceil((1 - alpha) * n) - 1, 0)]


def _band(values: list[float], stat: Callable[[list[float]], float], resamples: int,
          seed: int) -> tuple[float, float]:
    rng = random.Random(seed)
    return _percentiles(sorted(stat(rng.choices(values, k=len(values))) for _ in range(resamples)))
