"""Interleaved timing with a noise band (docs/architecture.md#measurements, "Throughput").

Timing each configuration back to back lets a busy moment of a shared machine flatter or punish
whichever configuration runs then. :func:`time_interleaved` times several configurations in rounds
A B C A B C ... on one :class:`~autoprec.measure.harness.Harness` (same initial weights, same
batches), so load that comes and goes spreads over all of them, and it gives each a noise band: a
bootstrap 95% percentile interval of the median step time (Efron & Tibshirani 1993, *An
Introduction to the Bootstrap*, ch. 13) and the interquartile range. It stops once every band is
narrow enough, the stop rule of torch.utils.benchmark's ``Timer.adaptive_autorange``
(torch/utils/benchmark/utils/timer.py, ``_threaded_measurement_loop``: keep measuring until
``stop_hook(times)`` says the spread is small, ``Measurement.iqr / median < threshold``, or a
time limit is reached), with the bootstrap band instead of the IQR as the spread, or once the
caller says its decision is settled. :func:`compare` says whether one configuration's throughput
beats another's beyond the noise.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from autoprec.measure.harness import Harness
from autoprec.measure.measurement import describe_failure
from autoprec.measure.memory import optimizer_state_bytes
from autoprec.measure.train_run import TrainRun
from autoprec.metrics import median
from autoprec.training.scaler import DynamicLossScaler
from autoprec.training.steps import StepsTooSlow, run_steps, slow_step_guard
from autoprec.training.train import TrainStep

__all__ = ["BOOTSTRAP_RESAMPLES", "Comparison", "Config", "Retire", "Settled", "Timing", "compare",
           "format_rate", "time_interleaved"]

#: Bootstrap resamples for every band (Efron & Tibshirani 1993 suggest >= 1000 for percentile intervals).
BOOTSTRAP_RESAMPLES = 1000
#: Coverage of every band: a 95% percentile interval (the 2.5th and 97.5th percentiles).
CONFIDENCE = 0.95


@dataclass
class Config:
    """One configuration to time.

    Attributes:
        name: Its key in :func:`time_interleaved`'s result.
        fn: The module a :class:`~autoprec.training.train.TrainStep` calls (model, lowered or
            compiled graph); pass the object the drift pass already ran, so compilation is done.
        scaler_factory: Makes its loss scaler (``None`` for bf16/fp32), called once.
        autocast_dtype: Run its forward under ``torch.autocast`` (the AMP baseline).
        harness: The harness whose parameters, batches and initial weights it trains, when not the
            call's (e.g. ``autoprec bench``'s pure low-precision copy); None: the call's harness.
        run: Its steps continue this :class:`~autoprec.measure.train_run.TrainRun` (made with the
            same ``fn``, scaler and ``autocast_dtype``, on the call's harness) instead of starting
            from the initial weights each turn: its warm-up and timed steps are then steps 0, 1, 2,
            ... of one training run, whose losses the trajectory check reads. None: a fresh
            :class:`~autoprec.training.train.TrainStep`, the initial weights restored each turn.
    """

    name: str
    fn: Callable[..., Any]
    scaler_factory: Callable[[], DynamicLossScaler | None] = lambda: None
    autocast_dtype: torch.dtype | None = None
    harness: Harness | None = None
    run: TrainRun | None = None


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
        error: Why its timing failed (the exception a step raised), else None.
        note: Remarks that do not invalidate it (dropped by the slow-step rule, time cap reached).
        too_slow: Its timing was stopped by the slow-step rule
            (:func:`autoprec.training.steps.slow_step_guard`); ``note`` says when.
        retired: The caller's ``retire`` rule stopped its timing (:func:`time_interleaved`):
            its tokens/s is of the rounds before, which the others' later rounds need not match
            on a machine whose speed drifts; ``note`` says why.
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
    error: str | None = None
    note: str | None = None
    too_slow: bool = False
    retired: bool = False
    peak_bytes: int | None = None

    @classmethod
    def from_steps(cls, step_times: Sequence[float], tokens_per_step: float, rounds: int = 0,
                   resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> Timing:
        """A timing of ``step_times`` (seconds) with ``tokens_per_step`` tokens each.

        The band resamples the step times ``resamples`` times with ``random.Random(seed)`` (so the
        same times give the same band) and takes the 2.5th and 97.5th percentiles of the resampled
        medians (Efron & Tibshirani 1993, ch. 13). An empty ``step_times`` gives an untimed Timing.
        """
        t = cls(step_times=list(step_times), rounds=rounds)
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
        ratio: a's tokens/s over b's, from the medians (> 1: a is faster).
        band: Bootstrap 95% percentile interval of the ratio (both timings resampled).
        tie: The band contains 1.0: the difference is within the noise.
        winner: ``"a"``, ``"b"``, or None on a tie.
    """

    ratio: float
    band: tuple[float, float]
    tie: bool
    winner: str | None


def compare(a: Timing, b: Timing, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> Comparison:
    """Whether ``a``'s throughput differs from ``b``'s beyond the noise.

    The ratio's band: ``resamples`` times, both timings' step times are resampled with
    replacement (``random.Random(seed)``) and the ratio of the resampled medians' throughputs is
    taken; the 2.5th and 97.5th percentiles of those ratios bound it (the percentile bootstrap of
    Efron & Tibshirani 1993, ch. 13, for a two-sample statistic).

    Raises:
        ValueError: either timing has no step times (failed or not timed).
    """
    if not a.step_times or not b.step_times:
        raise ValueError("compare needs two timed configurations (one has no step times)")
    tok_a, tok_b = a.tokens_per_s * a.step_s, b.tokens_per_s * b.step_s  # tokens per step
    ratio = (tok_a / a.step_s) / (tok_b / b.step_s)
    rng = random.Random(seed)
    ratios = sorted((tok_a / median(rng.choices(a.step_times, k=len(a.step_times))))
                    / (tok_b / median(rng.choices(b.step_times, k=len(b.step_times))))
                    for _ in range(resamples))
    lo, hi = _percentiles(ratios)
    lo, hi = min(lo, ratio), max(hi, ratio)
    tie = lo <= 1.0 <= hi
    return Comparison(ratio, (lo, hi), tie, None if tie else ("a" if lo > 1.0 else "b"))


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


class _Run:
    """One configuration's state during :func:`time_interleaved`: its step, batches, times."""

    def __init__(self, cfg: Config, harness: Harness, max_step_s: float | None) -> None:
        self.cfg, self.h = cfg, cfg.harness if cfg.harness is not None else harness
        self.step: TrainStep | None = None
        self.k = 0  # next batch index (cycling through the harness's batches)
        self.times: list[float] = []
        self.rounds = 0
        self.error: str | None = None
        self.note: str | None = None
        self.too_slow = False
        self.retired = False
        self.recording = False
        self.peak_extra = 0
        self.hooks = [self._record] + ([slow_step_guard(max_step_s)] if max_step_s is not None else [])

    @property
    def active(self) -> bool:
        return self.error is None and self.note is None

    def _record(self, _k: int, _batch: Any, _stats: Any, seconds: float) -> None:
        if self.recording:
            self.times.append(seconds)

    def run(self, n: int, record: bool) -> None:
        """``n`` steps from the initial weights (restored first), or the next ``n`` steps of the
        configuration's ``run``; failures end this run's timing."""
        h = self.h
        self.recording = record
        cuda = h.device.type == "cuda"
        try:
            c = self.cfg
            if c.run is None:  # a run loads its own weights
                h.restore()
            if self.step is None:  # a run's copy of the weights is made here, outside the steps' peak
                self.step = c.run.prepare() if c.run is not None else TrainStep(
                    c.fn, h.params, h.spec.make_optimizer(h.params), h.spec.loss_fn,
                    scaler=c.scaler_factory(), autocast_dtype=c.autocast_dtype,
                    device_type=h.device.type, stats=False)
            if cuda:
                torch.cuda.reset_peak_memory_stats(h.device)
                start = torch.cuda.memory_allocated(h.device)
            if c.run is not None:
                c.run.steps(n, after=self.hooks)
            else:
                run_steps(self.step, lambda k: h.batches[k % len(h.batches)], self.k, self.k + n,
                          device=h.device, after=self.hooks)
            if cuda:
                self.peak_extra = max(self.peak_extra, torch.cuda.max_memory_allocated(h.device) - start)
            self.rounds += record
        except StepsTooSlow as e:
            self.rounds += record and bool(self.times)
            self.too_slow = True
            self.note = f"{e}; dropped from later rounds" if record else str(e)
            if not record or not self.times:
                self.times = [e.seconds]  # stopped in its warm-up: timed on that step only
        except Exception as e:  # noqa: BLE001 - one configuration failing does not stop the others
            self.error = describe_failure(e)
        finally:
            self.k += n
            self.recording = False

    def state_bytes(self) -> int:
        """Bytes of this configuration's own optimizer state tensors
        (:func:`autoprec.measure.memory.optimizer_state_bytes`: 0-dim counters left out)."""
        return optimizer_state_bytes(self.step.optimizer) if self.step is not None else 0


#: ``time_interleaved``'s ``retire``: the Timings so far of the configurations still timed ->
#: ``{name: reason}`` of those to time no further.
Retire = Callable[[dict[str, Timing]], dict[str, str]]
#: ``{name: Timing}`` of the configurations still timed -> whether more rounds can change nothing
#: the caller decides (:func:`time_interleaved`'s ``settled``).
Settled = Callable[[dict[str, Timing]], bool]


def time_interleaved(harness: Harness, configs: Sequence[Config], *, min_rounds: int = 3,
                     max_rounds: int = 12, steps_per_round: int = 2, warmup: int | None = None,
                     rel_band: float = 0.03, time_cap_s: float = 120.0, max_step_s: float | None = None,
                     retire: Retire | None = None, settled: Settled | None = None) -> dict[str, Timing]:
    """Time ``configs`` in interleaved rounds on ``harness``'s weights and batches.

    Each configuration gets one ``TrainStep`` with its own optimizer (the model file's) and scaler,
    kept across rounds; before each of its turns the initial weights are restored (with a
    :attr:`Config.run`, its own weights are loaded: one training run from the initial weights).
    First each is warmed up in turn (``warmup`` untimed steps, one per batch shape at least; by
    default ``Harness.measure``'s rule, ``Harness.warmup_steps``), then rounds run: each round,
    ``steps_per_round`` steps of every configuration in order (A A B B C C, then again), batches
    cycling through ``harness.batches``, each timed by ``TrainStep.timed`` through ``run_steps``.

    Stop rule (torch.utils.benchmark ``adaptive_autorange``'s, module docstring): after at least
    ``min_rounds`` rounds, once every configuration still timed has a band of relative half-width
    ≤ ``rel_band``; or after ``max_rounds`` rounds; or once ``time_cap_s`` seconds have passed since
    the call began (the warm-up counts). From ``min_rounds`` rounds on, ``retire`` (when given)
    sees every configuration still timed, as a :class:`Timing` so far, after each round and names
    those that can no longer change the caller's decision, with the reason: they are timed no
    further, keep their step times, and the reason becomes their ``note`` (the final choice
    retires contenders slower than the fastest beyond the noise,
    :func:`autoprec.search.final.out_of_the_running`), and ``settled`` (when given) may stop the
    rounds before the bands are narrow: once the caller's decision can no longer change
    (:func:`autoprec.search.final.settled`). A configuration whose steps trip
    :func:`~autoprec.training.steps.slow_step_guard` (two in a row over ``max_step_s``, or one over
    4x; warm-up steps count) is dropped from later rounds with a ``note``; one whose step raises
    gets ``error`` and the others go on. The harness's weights are restored at the end.

    Args:
        harness: Weights, batches, model file and device (a config's own ``harness`` overrides it).
        configs: What to time, in round order; names must be distinct.
        min_rounds: Rounds before the band may stop the timing (≥ 1).
        max_rounds: Rounds at most (raised to ``min_rounds`` if lower).
        steps_per_round: Timed steps of each configuration per round (≥ 1).
        warmup: Untimed steps per configuration before the rounds (None: ``Harness.warmup_steps``).
        rel_band: Relative half-width of the 95% band that is narrow enough (0.03: ±3%).
        time_cap_s: Seconds after which no further round starts.
        max_step_s: The slow-step limit in seconds (None: no limit).
        retire: ``{name: Timing}`` of the configurations still timed -> ``{name: reason}`` of
            those to stop timing (None: every configuration is timed to the end).
        settled: ``{name: Timing}`` of the configurations still timed (after ``retire``) -> True
            to stop the rounds now (None: only the band, ``max_rounds`` and ``time_cap_s`` stop).

    Returns:
        ``{name: Timing}`` in ``configs`` order; tokens per step are the harness's ``tokens``.

    Raises:
        ValueError: two configurations share a name, or ``min_rounds``/``steps_per_round`` < 1.
    """
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"configuration names must be distinct: {names}")
    if min_rounds < 1 or steps_per_round < 1:
        raise ValueError("min_rounds and steps_per_round must be at least 1")
    t0 = time.perf_counter()
    runs = [_Run(c, harness, max_step_s) for c in configs]
    cuda = harness.device.type == "cuda"
    base = torch.cuda.memory_allocated(harness.device) if cuda else 0
    capped = False
    try:
        for r in runs:
            r.run(max(warmup, len(r.h.shapes)) if warmup is not None else r.h.warmup_steps(r.cfg.fn),
                  record=False)
        done = 0
        while done < max(max_rounds, min_rounds) and any(r.active for r in runs):
            if time.perf_counter() - t0 >= time_cap_s:
                capped = True
                break
            for r in runs:
                if r.active:
                    r.run(steps_per_round, record=True)
            done += 1
            if done >= min_rounds and _stop(runs, rel_band, retire, settled):
                break
    finally:
        for h in {id(r.h): r.h for r in runs}.values():
            h.restore()
        harness.restore()
    return {r.cfg.name: _timing(r, rel_band, capped, time_cap_s, base if cuda else None) for r in runs}


def _stop(runs: list[_Run], rel_band: float, retire: Retire | None, settled: Settled | None) -> bool:
    """After a round from ``min_rounds`` on: retire what ``retire`` names, then whether to stop
    (``settled`` says the decision is fixed, or every band of those still timed is narrow)."""
    if retire is not None:
        _retire(runs, retire, rel_band)
    if settled is not None and settled(_live(runs, rel_band)):
        return True
    return all(_narrow(r, rel_band) for r in runs if r.active)


def _retire(runs: list[_Run], retire: Retire, rel_band: float) -> None:
    """Stop timing the runs ``retire`` names (shown the Timings so far of those still timed)."""
    live = {r.cfg.name: r for r in runs if r.active}
    for name, why in retire(_live(runs, rel_band)).items():
        live[name].note, live[name].retired = why, True


def _live(runs: list[_Run], rel_band: float) -> dict[str, Timing]:
    """The Timings so far of the runs still timed."""
    return {r.cfg.name: _timing(r, rel_band, False, 0.0, None) for r in runs if r.active}


def _narrow(r: _Run, rel_band: float) -> bool:
    return Timing.from_steps(r.times, 1.0).rel_half_width() <= rel_band


def _timing(r: _Run, rel_band: float, capped: bool, cap_s: float, base: int | None) -> Timing:
    t = Timing.from_steps(r.times if r.error is None else [], r.h.tokens, rounds=r.rounds)
    t.error, t.note, t.too_slow, t.retired = r.error, r.note, r.too_slow, r.retired
    if capped and r.active and t.rel_half_width() > rel_band:
        t.note = (f"time cap {cap_s:g} s reached after {r.rounds} rounds "
                  f"(band ±{100 * t.rel_half_width():.1f}%)")
    if base is not None and r.error is None:
        t.peak_bytes = int(base + r.state_bytes() + r.peak_extra)
    return t
