"""Finalist selection: the fastest feasible trials, the autocast twin and all-fp32 re-measured as
training runs them (compiled with Inductor unless ``--no-compile``), fitted to the memory budget
(:mod:`autoprec.search.memory_fit`, compiled only), timed head to head with the baselines and
chosen by :func:`autoprec.search.final.decide`; the choice is checked on ``traj_rel`` and, when it
fails, the next choice is (docs/architecture.md#search). Without compile the bar is what a user
gets eagerly: torch.autocast eager and fp32 eager."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import optuna

from autoprec._interrupt import check as check_interrupt
from autoprec.applied.compile import compile_graph
from autoprec.applied.saved import saved_eager
from autoprec.capture import autocast_dynamic
from autoprec.errors import SearchError
from autoprec.measure import Config, Measurement, Timing, format_rate, time_interleaved
from autoprec.passes import run_pipeline
from autoprec.policy import Policy
from autoprec.search import attrs
from autoprec.search.bar import measure_bar, no_bar
from autoprec.search.budgets import format_bytes, over_memory, why_no_finalist
from autoprec.search.final import (
    Contender,
    Decision,
    all_fp32,
    decide,
    out_of_the_running,
    settled,
    tie_order,
)
from autoprec.search.memory_fit import eager_fitting, fit_memory, lever
from autoprec.search.phases import PhaseBar, phase_bar
from autoprec.search.progress import log
from autoprec.search.trajectory import TrajectoryCheck
from autoprec.training.train import autocast_scaler, make_scaler

#: Names of the baselines in the final head-to-head (and its log lines); without compile
#: torch.autocast's is ``AUTOCAST_EAGER`` and the all-fp32 policy's ``FP32_GRAPH``.
AUTOCAST_COMPILED = "torch.autocast + torch.compile"
AUTOCAST_EAGER = "torch.autocast eager"
FP32_COMPILED = "fp32 + torch.compile"
FP32_GRAPH = "all-fp32"
FP32_EAGER = "fp32 eager"

__all__ = ["AUTOCAST_COMPILED", "AUTOCAST_EAGER", "FP32_COMPILED", "FP32_EAGER", "FP32_GRAPH", "Selector",
           "fitted_label"]


def fitted_label(label: str, pol: Policy) -> str:
    """A finalist's label once the memory fit has given its policy a lever
    (:func:`autoprec.search.memory_fit.lever`): the lever named, and no longer called fp32 +
    torch.compile (a baseline, :func:`autoprec.search.final.all_fp32`) when the lever makes it
    another computation, e.g. ``"fp32 + torch.compile, trial 0 (eager 867 tok/s)"`` ->
    ``"trial 0 (eager 867 tok/s) with saved bf16"``. Unchanged when ``pol`` has no lever."""
    if lever(pol) == "none":
        return label
    for base in (FP32_COMPILED, FP32_GRAPH):
        if label.startswith(base + ", ") and not all_fp32(pol):
            label = label[len(base) + 2:]
    return f"{label} with {lever(pol)}"


class Selector:
    """Re-measures the fastest feasible trials as training will run them and picks one.

    Everything it learns about a policy (``traj_rel``, the trial's eager tokens/s) is keyed by
    the policy's content (:meth:`Policy.training_key`), never by object identity: a rejected policy
    can be freed and its ``id`` reused by another.

    Args:
        harness: The run's :class:`Harness`.
        budget: The drift budget (:class:`autoprec.search.decide.DriftBudget`).
        compile: Compile finalists with Inductor (else they run eagerly, and the bar is torch.autocast
            eager).
        ac_dtype: torch.autocast's low dtype (the trajectory budget's baseline).
        slow: ``max_step_s`` for every timed measurement (seconds).
        traj_steps: K of the ``traj_rel`` check (0: off).
        clock: The run's :class:`Clock` (compile seconds are added to ``compile_s``).
        quiet: No log lines.
        twin: The autocast twin (``Policy.autocast`` at the search's fastest low kernel), always a
            finalist; None when no low kernel is searched.
        also: More always-compiled finalists, ``(policy, label)``: variants of the twin whose gain
            only compiling shows, so eager screening cannot rank them (the twin with math
            attention: slower than the fused kernel eagerly, faster compiled where low-precision
            GEMMs are; ``benchmarks/results/attention_math_2026-12-02``).
        progress: Show a bar over the finalists (and the head-to-head) and one over each memory
            fit (:func:`autoprec.search.phases.phase_bar`).
        slow_gemms: Why torch.autocast's native GEMMs are too slow for its drift passes
            (:func:`autoprec.search.kernel_choice.autocast_gemms_in_fp32`), or None. Then torch.autocast
            + torch.compile's drift runs natively on batch 0 only (it compiles there; its peak and
            that batch's drift), unless the graph draws random numbers (its drift over every batch
            is the compiled budget, :mod:`autoprec.search.bar`); its trajectory runs
            eagerly with them in fp32 (:class:`TrajectoryCheck`).
        cannot_win: Why torch.autocast cannot win (:func:`~autoprec.search.kernel_choice.autocast_cannot_win`)
            or None: the bar is then not run, nor the twin forced (unless the graph draws random numbers).

    Attributes:
        timings: The final head-to-head's :class:`~autoprec.measure.noise.Timing` per contender.
        decision: The :class:`~autoprec.search.final.Decision` (None before :meth:`choose`).
        ac_label: torch.autocast's name in the head-to-head (:data:`AUTOCAST_COMPILED`, or
            :data:`AUTOCAST_EAGER` without compile).
        autocast_compiled, autocast_eager: torch.autocast's measurement as the bar (compiled, or
            eager without compile; the other is None), with the head-to-head's speed.
        trajectory: The :class:`~autoprec.search.trajectory.TrajectoryCheck` (``traj_rel`` per
            policy checked).
    """

    def __init__(self, harness, budget, compile, ac_dtype, slow, traj_steps, clock, quiet, twin=None,
                 progress=False, also=(), slow_gemms=None, cannot_win=None) -> None:
        self.h, self.budget, self.compile, self.ac_dtype = harness, budget, compile, ac_dtype
        self.slow_gemms: str | None = slow_gemms
        self.cannot_win: str | None = cannot_win
        self.slow, self.clock, self.quiet = slow, clock, quiet
        self.twin: Policy | None = twin
        self.also: list[tuple[Policy, str]] = list(also)
        self.progress = progress
        self._fit_bar: PhaseBar | None = None  # the memory fit's bar while it runs: each compile is a try
        self.timings: dict[str, Timing] = {}
        self.decision: Decision | None = None
        self.ac_label = AUTOCAST_COMPILED if compile else AUTOCAST_EAGER
        self.autocast_compiled: Measurement | None = None
        self.autocast_eager: Measurement | None = None
        self.memory_budget: float | None = None
        self.eager_tokens_per_s: dict[str, float] = {}  # Policy.training_key() -> the trial's eager tokens/s
        self._autocast_fn = None  # torch.autocast's module as compiled for its baseline
        self._fp32_fn = None  # the all-fp32 finalist as compiled (fp32 + torch.compile), once measured
        self.fp32_compiled: Measurement | None = None  # its measurement (the head-to-head's speed)
        self.trajectory = TrajectoryCheck(harness, ac_dtype, traj_steps, lambda: (
            self._autocast_fn if self._autocast_fn is not None else self._fn(self.h.model)),
            lambda: self._fp32_fn, fp32_gemms=bool(slow_gemms))
        self._notes: dict[str, str | None] = {}  # a contender's note before any head-to-head
        #: Every finalist measurement (compiled unless --no-compile), memory-lever tries included (the
        #: report's lever table; ``rejected``: why a finalist was not kept, when not its ``error``).
        self.points: list[dict[str, Any]] = []
        self._point_index: dict[str, int] = {}  # Policy.training_key() -> its last entry in points

    @property
    def autocast_bar(self) -> Measurement | None:
        """torch.autocast's measurement as the head-to-head's bar: :attr:`autocast_compiled`, or
        :attr:`autocast_eager` without compile (None before :meth:`choose`)."""
        return self.autocast_compiled if self.compile else self.autocast_eager

    def _fn(self, gm, activation_memory_budget: float = 1.0):
        if self._fit_bar is not None:
            self._fit_bar.step(f"activation memory budget {activation_memory_budget:g}")
        if not self.compile:
            return saved_eager(gm)
        with self.clock("compile_s"):  # the module (torch.autocast's baseline): dynamic if shapes vary
            dynamic = autocast_dynamic(self.h.batches) if gm is self.h.model else None
            return compile_graph(gm, activation_memory_budget, dynamic=dynamic)

    def choose(self, feasible: list[optuna.trial.FrozenTrial], k: int,
               memory_budget: Callable[[], float | None] = lambda: None) -> tuple[Policy, Measurement]:
        """The policy to write, with its measurement: the finalists within the drift (and memory)
        budgets, compiled (eager without compile), timed head to head with torch.autocast +
        torch.compile (eager) and fp32 eager, the choice checked on ``traj_rel`` (:meth:`_head_to_head`).
        ``memory_budget`` is called once the torch.autocast baselines are measured (``--max-memory
        auto`` refers to them) and gives the byte budget or None."""
        if not feasible:
            raise SearchError("no trial met the drift budget, not even all-fp32 (see the study's "
                              "autoprec:error attributes)")
        with phase_bar("finalists", None, self.progress) as bar:
            return self._choose(feasible, k, memory_budget, bar)

    def _choose(self, feasible, k, memory_budget, bar: PhaseBar) -> tuple[Policy, Measurement]:
        """:meth:`choose`, with its progress bar (a step per finalist, and the head-to-head)."""
        bar.step(self.ac_label)
        measure_bar(self)
        self.memory_budget = memory_budget()
        if self.memory_budget is not None:
            log(f"memory budget {format_bytes(self.memory_budget)}", self.quiet)
            feasible = feasible if self.compile else eager_fitting(feasible, self.memory_budget)
        survivors: list[tuple[str, Policy, Any, Measurement]] = []
        measured: list[Measurement] = []
        candidates = self._candidates(feasible, k)
        timed = self.h.device.type == "cuda"  # else timed in the head-to-head's rounds (as the bar)
        bar.set_total(len(candidates) + 2)  # torch.autocast's compile, the finalists, the head-to-head
        for pol, label in candidates:
            check_interrupt()
            log(f"finalist {label}: {pol.summary()}", self.quiet)
            bar.step(label)
            fn = self._fn(run_pipeline(self.h.graph_module, pol).graph_module)
            m = self.h.measure(fn, lambda pol=pol: make_scaler(pol), timing=timed, max_step_s=self.slow)
            self._point(pol, m, timed=bool(m.step_times))
            if (self.compile and self.memory_budget is not None and m.error is None
                    and self.budget.feasible(m) and m.peak_bytes > self.memory_budget):
                with phase_bar("memory fit", None, self.progress) as self._fit_bar:
                    try:
                        pol, fn, m = fit_memory(self, pol, m)
                    finally:
                        self._fit_bar = None
                label = fitted_label(label, pol)
            measured.append(m)
            if self.compile and all_fp32(pol) and m.error is None:  # the trajectory check's reference
                self._fp32_fn, self.fp32_compiled = fn, m
            why = self._reject_reason(m)
            how = "compiled" if self.compile else "eager"
            log(f"  {how}: grad_rel_l2 {m.grad_rel_l2:.3g}" + (f" -> rejected: {why}" if why else ""),
                self.quiet)
            if why is None:
                survivors.append((label, pol, fn, m))
            elif why != m.error:
                self._rejected(pol, why)
        if not survivors:
            raise SearchError(why_no_finalist(measured, self.budget, self.memory_budget, self.compile,
                                              self.h.random))
        bar.step("head-to-head")
        try:
            return self._head_to_head(survivors)
        finally:
            self.trajectory.release()  # the head-to-head's training runs (TrajectoryCheck.share)

    def _head_to_head(self, survivors: list[tuple[str, Policy, Any, Measurement]]
                      ) -> tuple[Policy, Measurement]:
        """Time the surviving finalists with the baselines (:meth:`_time_contenders`) and
        pick by :func:`autoprec.search.final.decide`; the choice must pass the trajectory check
        (:meth:`TrajectoryCheck.ok`). One that fails is rejected (the report's note) and the rest
        are timed again without it, so the next decision rests on rounds whose retire and stop
        rules never saw the rejected policy; only a rejection pays a second head-to-head.

        Raises:
            SearchError: no policy was timed, or every one timed failed the trajectory check."""
        rejected: list[str] = []
        while True:
            contenders = self._time_contenders(survivors)
            try:
                decision = decide(contenders)
            except ValueError:
                self.decision = None
                raise SearchError("no finalist was timed in the final head-to-head" + (
                    f" after {', '.join(rejected)} failed the trajectory check" if rejected else "")
                    + " (see the log)") from None
            label, pol, fn, m = next(s for s in survivors if s[0] == decision.chosen.name)
            if self.trajectory.ok(pol, fn):
                break
            why = self.trajectory.reason(pol)
            log(f"  {label} -> rejected: {why}; the others timed again without it", self.quiet)
            self._rejected(pol, why)
            rejected.append(label)
            survivors = [s for s in survivors if s[0] != label]
        if pol.training_key() in self.trajectory.traj:  # measured: it lowers something, K > 0
            t = self.trajectory
            log(f"  {label}: traj_rel {t.of(pol):.3g} over {t.steps} steps (torch.autocast's {t.budget:.3g}"
                + ("" if t.budget_steps >= t.steps else f" or more: {t.budget_steps} of its steps decided")
                + ")", self.quiet)
        decision.rejected = rejected
        self.decision = decision
        log(decision.describe(), self.quiet)
        return pol, m

    def _time_contenders(self, survivors: list[tuple[str, Policy, Any, Measurement]]) -> list[Contender]:
        """Time ``survivors`` beside torch.autocast + torch.compile (when within the drift budget)
        and fp32 eager in one interleaved run (:func:`time_interleaved`, with
        :func:`autoprec.search.final.out_of_the_running` and
        :func:`autoprec.search.final.settled`); every measurement (the baselines' included) takes
        its speed from those rounds, so the ratios the report and the policy file give are side by
        side in one process. Returns the contenders :func:`autoprec.search.final.decide` chooses
        among."""
        configs = [self._config(label, fn, lambda p=pol: make_scaler(p)) for label, pol, fn, _m in survivors]
        ac = self.autocast_bar
        for label, m in [(label, m) for label, _p, _f, m in survivors] + [(self.ac_label, ac)]:
            if m is not None:  # a timing again (after a rejection) drops the last one's note
                m.note = self._notes.setdefault(label, m.note)
        ac_timed = self._autocast_fn is not None and ac is not None and ac.error is None
        # a bar only within the drift and memory budgets, as the finalists (all-fp32 among them) are
        judge = self.budget.on_batches(len(ac.grad_rel_l2_batches)) if ac_timed and ac.cut else self.budget
        ac_ok = ac_timed and judge.feasible(ac) and (  # batch for batch, when on batch 0 only
            self.memory_budget is None or ac.peak_bytes <= self.memory_budget)
        if ac_timed:  # timed either way: the side-by-side table reports it
            configs.append(self._config(self.ac_label, self._autocast_fn, autocast_scaler(self.ac_dtype),
                                        self.ac_dtype))
        configs.append(Config(FP32_EAGER, self.h.model))
        log(f"final head-to-head, interleaved: {', '.join(c.name for c in configs)}", self.quiet)
        # the contenders decide() chooses among: the baselines, and the policies it may write
        baselines = {label for label, pol, _fn, _m in survivors if all_fp32(pol)}
        baselines |= ({self.ac_label} if ac_ok else set()) | {FP32_EAGER}
        policies = {label for label, _pol, _fn, _m in survivors}
        start = time.perf_counter()
        self.timings = time_interleaved(self.h, configs, max_step_s=self.slow,
                                        retire=out_of_the_running(baselines, policies),
                                        settled=settled(baselines, policies, tie_order(
                                            (label, pol, m.grad_rel_l2) for label, pol, _fn, m in survivors)))
        rounds = max((t.rounds for t in self.timings.values()), default=0)
        log(f"  {rounds} rounds in {time.perf_counter() - start:.0f} s, warm-up included", self.quiet)
        contenders = []
        for label, pol, _fn, m in survivors:
            _take_timing(m, self.timings[label])
            i = self._point_index.get(pol.training_key())
            point = self._point_of(pol, m, retired=self.timings[label].retired)
            if i is None:
                self.points.append(point)
            else:
                self.points[i] = point
            contenders.append(Contender(label, pol, self.timings[label], m.grad_rel_l2,
                                        baseline=label in baselines))
        if ac_timed:
            _take_timing(ac, self.timings[self.ac_label])
        if ac_ok:
            contenders.append(Contender(self.ac_label, None, self.timings[self.ac_label],
                                        ac.grad_rel_l2, baseline=True))
        # a bar, not a choice: with compile the policy file is trained compiled (when fp32 eager is the
        # fastest, the decision says "slower" and the log suggests --no-compile); without, the all-fp32
        # policy computes what it computes and ties with it
        contenders.append(Contender(FP32_EAGER, None, self.timings[FP32_EAGER], 0.0, baseline=True))
        shown = [(c.name, c.timing, "") for c in contenders]
        if ac_timed and not ac_ok:  # timed beside them for the table: a row of the log too
            shown.insert(-1, (self.ac_label, self.timings[self.ac_label],
                              "over the drift or memory budget: not a bar"))
        for name, t, extra in shown:
            why = "; ".join(x for x in (t.error or t.note, extra) if x)
            log(f"  {name}: {format_rate(t)} tok/s" + (f" ({why})" if why else ""), self.quiet)
        return contenders

    def _config(self, label: str, fn: Any, scaler_factory: Any, autocast_dtype: Any = None) -> Config:
        """A head-to-head configuration whose timed steps are one training run from the initial
        weights, whose losses the trajectory check reads if it needs them (TrajectoryCheck.share)."""
        run = self.trajectory.share(fn, scaler_factory, autocast_dtype)
        return Config(label, fn, scaler_factory, autocast_dtype, run=run)

    def _candidates(self, feasible: list[optuna.trial.FrozenTrial], k: int) -> list[tuple[Policy, str]]:
        """The k fastest feasible trials, plus the autocast twin (the fallback when nothing beats
        torch.autocast + torch.compile), the ``also`` policies (compiled only) and all-fp32 (fp32 +
        torch.compile, a baseline; :data:`FP32_GRAPH` without compile), each once: a lowered policy
        must beat both measured the same way to be chosen. Where the bar is not run
        (:func:`~autoprec.search.bar.no_bar`) the twin and ``also`` have nothing to match (their
        gain was fast low-precision GEMMs): they are finalists only as trials, by their eager speed."""
        out = []
        for t in feasible[:k]:
            pol = Policy.from_dict(t.user_attrs[attrs.POLICY])
            self.eager_tokens_per_s[pol.training_key()] = t.values[0]
            name = f"trial {t.number} (eager {t.values[0]:.0f} tok/s)"  # all-fp32: a baseline, said so
            base = FP32_COMPILED if self.compile else FP32_GRAPH
            out.append((pol, f"{base}, {name}" if all_fp32(pol) else name))
        keys = {p.training_key() for p, _ in out}
        also = self.also if self.compile else []  # their gain only compiling shows
        twin = [(self.twin, "autocast twin")] if self.twin is not None else []
        forced = [] if no_bar(self) else twin + also
        for pol, label in forced:
            if pol.training_key() not in keys:
                out.append((pol, label))
                keys.add(pol.training_key())
        if not any(all_fp32(p) for p, _ in out):
            out.append((Policy.fp32(), FP32_COMPILED if self.compile else FP32_GRAPH))
        return out

    def _point(self, pol: Policy, m: Measurement, timed: bool = True) -> None:
        self.points.append(self._point_of(pol, m, timed))
        self._point_index[pol.training_key()] = len(self.points) - 1  # the head-to-head fills its speed in

    @staticmethod
    def _point_of(pol: Policy, m: Measurement, timed: bool = True, retired: bool = False) -> dict[str, Any]:
        """A finalist's row of the report (``retired``: the head-to-head timed it no further, and
        its ``note`` says at what ratio over which rounds)."""
        return {"policy": pol.summary(), "key": pol.training_key(), "lever": lever(pol),
                "tokens_per_s": m.tokens_per_s if timed else None,
                "step_times": list(m.step_times) if timed else [],  # the report's noise band
                "grad_rel_l2": m.grad_rel_l2, "peak_bytes": m.peak_bytes, "error": m.error,
                "note": m.note, "retired": retired}

    def _fits(self, m: Measurement) -> bool:
        return m.error is None and m.peak_bytes <= self.memory_budget and self.budget.feasible(m)

    def _rejected(self, pol: Policy, why: str) -> None:
        """Record why a finalist was rejected (the report's note: drift, memory, traj_rel)."""
        if (i := self._point_index.get(pol.training_key())) is not None:
            self.points[i]["rejected"] = why

    def _reject_reason(self, m: Measurement) -> str | None:
        """Why a finalist is not timed head to head (None: it is); its trajectory is
        checked only if the head-to-head would write it (:meth:`_head_to_head`)."""
        if m.error is not None:
            return m.error
        if not self.budget.feasible(m):
            return self.budget.explain(m)
        if self.memory_budget is not None and m.peak_bytes > self.memory_budget:
            return (f"peak {format_bytes(m.peak_bytes)} > memory budget {format_bytes(self.memory_budget)}"
                    + (over_memory(self.h.random) if self.compile else
                       " (without --no-compile, recomputation in backward can lower the peak)"))
        return None


def _take_timing(m: Measurement, t: Timing) -> None:
    """Give ``m`` the head-to-head's step times and speed (its drift and memory stay)."""
    if t.step_times:
        m.step_times, m.step_s, m.tokens_per_s = list(t.step_times), t.step_s, t.tokens_per_s
    m.add_note(t.error or t.note)
