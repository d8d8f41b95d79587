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
caller says its decision is settled (then, where the caller names the configurations its verdict
compares, only those go on until their bands are narrow). The bands, and whether one
configuration's throughput beats another's beyond the noise (paired round by round: each timing
keeps its rounds' step times, ``Timing.round_steps``, so a drift of the machine's speed between
rounds cancels), are :mod:`autoprec.measure.noise`'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autoprec.measure.harness import Harness
from autoprec.measure.measurement import describe_failure
from autoprec.measure.memory import optimizer_state_bytes
from autoprec.measure.noise import Timing, TimingEnd
from autoprec.measure.train_run import TrainRun
from autoprec.training.scaler import DynamicLossScaler
from autoprec.training.steps import StepsTooSlow, run_steps, slow_step_guard
from autoprec.training.train import TrainStep

__all__ = ["Config", "Narrow", "Retire", "Settled", "time_interleaved"]


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
        guarded: Whether the slow-step limit (``max_step_s``) may stop its timing. False for the
            reference the limit is derived from (fp32 eager): on a loaded machine the guard had
            dropped it after a step or two, and every ratio against it rested on those.
    """

    name: str
    fn: Callable[..., Any]
    scaler_factory: Callable[[], DynamicLossScaler | None] = lambda: None
    autocast_dtype: torch.dtype | None = None
    harness: Harness | None = None
    run: TrainRun | None = None
    guarded: bool = True


class _TimedConfig:
    """One configuration's state during :func:`time_interleaved`: its step, batches, times."""

    def __init__(self, cfg: Config, harness: Harness, max_step_s: float | None) -> None:
        self.cfg, self.h = cfg, cfg.harness if cfg.harness is not None else harness
        self.step: TrainStep | None = None
        self.k = 0  # next batch index (cycling through the harness's batches)
        self.times: list[float] = []
        self.round_steps: list[list[float]] = []  # the times of each recorded round
        self.rounds = 0
        self.end = TimingEnd.TIMED
        self.note: str | None = None  # why it ended (TimingEnd), or why it is timed no further
        self.recording = False
        self.peak_extra = 0
        guard = max_step_s is not None and cfg.guarded
        self.hooks = [self._record] + ([slow_step_guard(max_step_s)] if guard else [])

    @property
    def active(self) -> bool:
        return self.end is TimingEnd.TIMED and self.note is None

    @property
    def failed(self) -> bool:
        return self.end is TimingEnd.FAILED

    def _record(self, _k: int, _batch: Any, _stats: Any, seconds: float) -> None:
        if self.recording:
            self.times.append(seconds)

    def run(self, n: int, record: bool) -> None:
        """``n`` steps from the initial weights (restored first), or the next ``n`` steps of the
        configuration's ``run``; failures end this run's timing."""
        h = self.h
        self.recording = record
        before = len(self.times)
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
            self.end = TimingEnd.TOO_SLOW
            kept = ("its earlier rounds' steps kept" if record and self.times
                    else "timed on that last step only")  # stopped in its warm-up or first round
            self.note = f"{e}; {kept}" + ("; dropped from later rounds" if record else "")
            if not record or not self.times:
                self.times = [e.seconds]
        except Exception as e:  # noqa: BLE001 - one configuration failing does not stop the others
            self.end, self.note = TimingEnd.FAILED, describe_failure(e)
        finally:
            self.k += n
            self.recording = False
            if record and len(self.times) > before:
                self.round_steps.append(self.times[before:])

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
#: ``{name: Timing}`` of the configurations still timed, once the decision is settled -> the names
#: whose bands the caller reports and wants narrow (:func:`time_interleaved`'s ``narrow``).
Narrow = Callable[[dict[str, Timing]], set[str]]

#: The note of a configuration :func:`time_interleaved` stopped timing once the caller's decision
#: was settled and its ``narrow`` did not name it (its band is that of the rounds before).
SETTLED_NOTE = "timed no further once the decision was settled"


def time_interleaved(harness: Harness, configs: Sequence[Config], *, min_rounds: int = 3,
                     max_rounds: int = 12, steps_per_round: int = 2, warmup: int | None = None,
                     rel_band: float = 0.03, time_cap_s: float = 120.0, max_step_s: float | None = None,
                     retire: Retire | None = None, settled: Settled | None = None,
                     narrow: Narrow | None = None) -> dict[str, Timing]:
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
    the call began (the warm-up counts). From ``min_rounds`` rounds on, after each round, ``retire``
    names those that can no longer change the caller's decision (timed no further, keeping their
    step times, marked ``retired``, the reason their ``note``:
    :func:`autoprec.search.race.out_of_the_running`), and ``settled`` may stop the rounds before
    the bands are narrow (:func:`autoprec.search.race.settled`), or, with ``narrow``, stop all but
    those ``narrow`` names (:class:`_StopRule`). A configuration whose steps trip
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
        settled: ``{name: Timing}`` still timed (after ``retire``) -> True to stop the rounds now.
        narrow: ``{name: Timing}`` still timed -> the names to go on timing once settled.

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
    runs = [_TimedConfig(c, harness, max_step_s) for c in configs]
    cuda = harness.device.type == "cuda"
    base = torch.cuda.memory_allocated(harness.device) if cuda else 0
    capped = False
    stop = _StopRule(rel_band, retire, settled, narrow)
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
            if done >= min_rounds and stop(runs):
                break
    finally:
        for h in {id(r.h): r.h for r in runs}.values():
            h.restore()
        harness.restore()
    return {r.cfg.name: _timing(r, rel_band, capped, time_cap_s, base if cuda else None) for r in runs}


class _StopRule:
    """:func:`time_interleaved`'s look after each round from ``min_rounds`` on: retire what
    ``retire`` names, then whether to stop (``settled`` says the decision is fixed and there is no
    ``narrow``, or every band of those still timed is narrow). Once settled with ``narrow``, the
    runs it does not name stop (keeping their step times, with :data:`SETTLED_NOTE`) and those it
    names (the head-to-head's policy written and its baselines) go on until
    their bands are narrow (or ``max_rounds``, or ``time_cap_s``): the head-to-head's first three
    rounds gave bands of ±4-15% where ``autoprec bench``'s twelve gave ±2-7% (the committed
    bench.json step times, their first six steps against all 24)."""

    def __init__(self, rel_band: float, retire: Retire | None, settled: Settled | None,
                 narrow: Narrow | None) -> None:
        self.rel_band, self.retire, self.settled, self.narrow = rel_band, retire, settled, narrow
        self.narrowing = False

    def __call__(self, runs: list[_TimedConfig]) -> bool:
        if self.retire is not None:
            _retire(runs, self.retire, self.rel_band)
        if not self.narrowing and self.settled is not None and self.settled(_live(runs, self.rel_band)):
            if self.narrow is None:
                return True
            keep = self.narrow(_live(runs, self.rel_band))
            for r in runs:
                if r.active and r.cfg.name not in keep:
                    r.note = SETTLED_NOTE
            self.narrowing = True
        return all(_narrow(r, self.rel_band) for r in runs if r.active)


def _retire(runs: list[_TimedConfig], retire: Retire, rel_band: float) -> None:
    """Stop timing the runs ``retire`` names (shown the Timings so far of those still timed)."""
    live = {r.cfg.name: r for r in runs if r.active}
    for name, why in retire(_live(runs, rel_band)).items():
        live[name].end, live[name].note = TimingEnd.RETIRED, why


def _live(runs: list[_TimedConfig], rel_band: float) -> dict[str, Timing]:
    """The Timings so far of the runs still timed."""
    return {r.cfg.name: _timing(r, rel_band, False, 0.0, None) for r in runs if r.active}


def _narrow(r: _TimedConfig, rel_band: float) -> bool:
    return Timing.from_steps(r.times, 1.0).rel_half_width() <= rel_band


def _timing(r: _TimedConfig, rel_band: float, capped: bool, cap_s: float, base: int | None) -> Timing:
    t = Timing.from_steps(r.times if not r.failed else [], r.h.tokens, rounds=r.rounds,
                          round_steps=r.round_steps if not r.failed else ())
    t.end, t.note = r.end, r.note
    if capped and r.active and t.rel_half_width() > rel_band:
        t.note = (f"time cap {cap_s:g} s reached after {r.rounds} rounds "
                  f"(band ±{100 * t.rel_half_width():.1f}%)")
    if base is not None and not r.failed:
        t.peak_bytes = int(base + r.state_bytes() + r.peak_extra)
    return t
