"""The finalists' contest: how ``tune`` chooses the policy it writes
(docs/architecture.md#how-a-policy-is-chosen).

It reads as four parts:

- **Candidates** (``Candidate``), each with its ``Role``: a policy that may be written (the
  fastest feasible trials, the autocast twin and its variants), a baseline to beat (torch.autocast
  + torch.compile, fp32 + torch.compile, fp32 eager), or shown only (torch.autocast + torch.compile
  over the drift or memory budget: a row of the table, no bar). :meth:`Contest.candidates` builds
  the list; torch.autocast comes from :class:`~autoprec.search.autocast_baseline.AutocastBaseline`,
  the one place the device's emulation is decided.
- **Gates** (:class:`~autoprec.search.gates.Gate`, in :mod:`autoprec.search.gates` with the
  candidate types): one protocol that turns an ``Entry`` (a candidate, its module and its
  measurement) into an :class:`~autoprec.measure.outcome.Outcome`: ``DriftGate``, ``MemoryGate``,
  ``TrajectoryGate``. The screening of search trials uses the same outcome type
  (:mod:`autoprec.search.screen_cut`) and the same drift rule.
- **One race rule** (:class:`~autoprec.search.race.Race`): retire, settled, tie order and the verdict.
- :meth:`Contest.run`: measure, gate, race, check the choice on its trajectory, race again without a
  rejected one, and record everything the report reads (:class:`FinalistRows`, the head-to-head's
  timings, the :class:`~autoprec.search.race.Decision`).

Finalists are compiled with Inductor unless ``--no-compile`` (then they run eagerly, and the bars
are torch.autocast eager and fp32 eager); with ``--max-memory`` a compiled finalist over the budget
is fitted first (:mod:`autoprec.search.memory_fit`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import optuna

from autoprec._interrupt import check as check_interrupt
from autoprec.applied.compile import compile_graph
from autoprec.applied.saved import saved_eager
from autoprec.capture import autocast_dynamic
from autoprec.errors import SearchError
from autoprec.measure import Config, Harness, Measurement, Stage, Timing, format_rate, time_interleaved
from autoprec.passes import run_pipeline
from autoprec.policy import COMPILE_VARIANTS, REGIONAL_EMULATED, CompileOptions, Policy
from autoprec.search import attrs
from autoprec.search.autocast_baseline import AutocastBaseline
from autoprec.search.budgets import format_bytes, why_no_finalist
from autoprec.search.drift_budget import DriftBudget
from autoprec.search.finalist_rows import FinalistRows
from autoprec.search.gates import (
    Candidate,
    DriftGate,
    Entry,
    Gate,
    MemoryGate,
    Role,
    TrajectoryGate,
    first_failure,
)
from autoprec.search.memory_fit import MemoryFit, eager_fitting, lever
from autoprec.search.phases import PhaseBar, phase_bar
from autoprec.search.progress import Clock, log
from autoprec.search.race import Contender, Decision, Race, all_fp32
from autoprec.search.trajectory import TrajectoryCheck
from autoprec.training.train import make_scaler

#: Names of the baselines in the final head-to-head (and its log lines); without compile
#: torch.autocast's is ``AUTOCAST_EAGER`` and the all-fp32 policy's ``FP32_GRAPH``.
AUTOCAST_COMPILED = "torch.autocast + torch.compile"
AUTOCAST_EAGER = "torch.autocast eager"
FP32_COMPILED = "fp32 + torch.compile"
FP32_GRAPH = "all-fp32"
FP32_EAGER = "fp32 eager"

__all__ = ["AUTOCAST_COMPILED", "AUTOCAST_EAGER", "FP32_COMPILED", "FP32_EAGER",
           "FP32_GRAPH", "Contest", "compile_variants_arg", "contenders", "fitted_label", "variant_options"]


def compile_variants_arg(value: str | bool) -> str:
    """``tune``'s ``compile_variants`` as one of :data:`COMPILE_VARIANTS` (True: ``"all"``, False:
    ``"none"``, the flag's meanings before it took a value).

    Raises:
        ValueError: any other value (names it and the choices)."""
    if isinstance(value, bool):
        return "all" if value else "none"
    if value not in COMPILE_VARIANTS:
        raise ValueError(f"compile_variants: expected one of {', '.join(COMPILE_VARIANTS)}, got {value!r}")
    return value


def variant_options(pol: Policy, fn: Any, which: str = "all") -> list[CompileOptions]:
    """The compile variants worth timing against ``pol`` compiled as ``fn`` (a
    :class:`~autoprec.applied.compile.CompiledGraph`), not a cross product: one flat graph where
    ``fn`` compiled repeated blocks as regions (published: 21.5% slower regional on an H100,
    bghira/SimpleTuner PR #3152), and, with ``which`` ``"all"``, fp32 intermediates
    (``emulate_precision_casts`` off: its cast chains stay in Triton code otherwise,
    pytorch/pytorch #196958) where ``pol`` lowers anything (an all-fp32 graph has no casts to
    emulate). Empty for a policy that names its options, and for ``which`` ``"none"``.

    Raises:
        ValueError: ``which`` is not one of :data:`COMPILE_VARIANTS`."""
    if compile_variants_arg(which) == "none" or pol.compile_options is not None:
        return []
    regions = getattr(fn, "regions", None)  # a CompiledGraph's outlining plan (None: compiled flat)
    out = [CompileOptions(regional=False, emulate_precision_casts=True)] if regions and regions.blocks else []
    if which == "all" and pol.dtypes_used() - {"fp32"}:
        out.append(CompileOptions(regional=True, emulate_precision_casts=False))
    return out


def contenders(survivors: list[Entry], autocast: Entry | None,
               timings: dict[str, Timing] | None = None) -> list[Contender]:
    """The contenders the race decides among: the gated ``survivors`` (a baseline when their role
    is), torch.autocast (``autocast``) when its role is :attr:`Role.BASELINE` (a :attr:`Role.SHOWN`
    one is timed for the table only), and fp32 eager (:data:`FP32_EAGER`), each with its timing in
    ``timings`` (untimed when missing: the roles alone fix the :class:`Race`)."""
    timings = timings or {}
    of = lambda name: timings.get(name, Timing())  # noqa: E731
    out = [Contender(e.name, e.candidate.policy, of(e.name),
                     e.measurement.grad_rel_l2 if e.tie_drift is None else e.tie_drift,
                     baseline=e.candidate.role is Role.BASELINE) for e in survivors]
    if autocast is not None and autocast.candidate.role is Role.BASELINE:
        out.append(Contender(autocast.name, None, of(autocast.name), autocast.measurement.grad_rel_l2,
                             baseline=True))
    # a bar, not a choice: with compile the policy file is trained compiled (when fp32 eager is the
    # fastest, the decision says "slower" and the log suggests --no-compile); without, the all-fp32
    # policy computes what it computes and ties with it
    out.append(Contender(FP32_EAGER, None, of(FP32_EAGER), 0.0, baseline=True))
    return out


def fitted_label(label: str, pol: Policy) -> str:
    """A finalist's label once the memory fit has given its policy a lever
    (:func:`autoprec.search.memory_fit.lever`): the lever named, and no longer called fp32 +
    torch.compile (a baseline, :func:`autoprec.search.race.all_fp32`) when the lever makes it
    another computation, e.g. ``"fp32 + torch.compile, trial 0 (eager 867 tok/s)"`` ->
    ``"trial 0 (eager 867 tok/s) with saved bf16"``. Unchanged when ``pol`` has no lever."""
    if lever(pol) == "none":
        return label
    for base in (FP32_COMPILED, FP32_GRAPH):
        if label.startswith(base + ", ") and not all_fp32(pol):
            label = label[len(base) + 2:]
    return f"{label} with {lever(pol)}"


class Contest:
    """Re-measures the fastest feasible trials as training will run them, with the baselines, and
    picks the policy to write (the module docstring).

    Args:
        harness: The run's :class:`Harness`.
        budget: The drift budget.
        compile: Compile finalists with Inductor (else they run eagerly, and the bar is torch.autocast
            eager).
        autocast: torch.autocast on this device (:class:`AutocastBaseline`: its dtype, whether its
            drift is emulated, whether it cannot win).
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
        progress: Show a bar over the finalists (and the head-to-head) and one over each memory fit.
        compile_variants: Once the race has chosen, time the choice against its compile variants
            (:func:`variant_options`, one of :data:`COMPILE_VARIANTS`: ``"flat"`` where it compiled
            in regions; ``"all"``: fp32 intermediates too, where it lowers anything; ``"none"``) in
            a second head-to-head, and keep the fastest (ties: the choice as first compiled).
            Compiled only.

    Attributes:
        timings: The final head-to-head's :class:`~autoprec.measure.noise.Timing` per contender.
        decision: The :class:`~autoprec.search.race.Decision` (None before :meth:`run`).
        ac_label: torch.autocast's name in the head-to-head (:data:`AUTOCAST_COMPILED`, or
            :data:`AUTOCAST_EAGER` without compile).
        autocast_compiled, autocast_eager: torch.autocast's measurement as the bar (compiled, or
            eager without compile; the other is None), with the head-to-head's speed.
        fp32_compiled: The all-fp32 finalist's measurement, compiled (fp32 + torch.compile).
        memory_budget: The byte budget (None: none).
        trajectory: The :class:`~autoprec.search.trajectory.TrajectoryCheck` (``traj_rel`` per
            policy checked).
        eager_tokens_per_s: ``Policy.training_key()`` -> the trial's eager (screening) tokens/s.
        finalists: The report's rows (:class:`FinalistRows`).
        variants: ``(name, policy, measurement)`` of the choice as first compiled and of its compile
            variants, when they raced (:meth:`_vary`; empty otherwise): the table's rows.
    """

    def __init__(self, harness: Harness, budget: DriftBudget, compile: bool, autocast: AutocastBaseline,
                 slow: float | None, traj_steps: int, clock: Clock, quiet: bool, twin: Policy | None = None,
                 progress: bool = False, also: list[tuple[Policy, str]] | tuple = (),
                 compile_variants: str | bool = "flat") -> None:
        self.h, self.budget, self.compile, self.autocast = harness, budget, compile, autocast
        self.slow, self.clock, self.quiet = slow, clock, quiet
        self.twin, self.also, self.progress = twin, list(also), progress
        self.compile_variants = compile_variants_arg(compile_variants) if compile else "none"
        self._fit_bar: PhaseBar | None = None  # the memory fit's bar while it runs: each compile is a try
        self.timings: dict[str, Timing] = {}
        self.decision: Decision | None = None
        self.ac_label = AUTOCAST_COMPILED if compile else AUTOCAST_EAGER
        self.autocast_compiled: Measurement | None = None
        self.autocast_eager: Measurement | None = None
        self.fp32_compiled: Measurement | None = None
        self.memory_budget: float | None = None
        self.eager_tokens_per_s: dict[str, float] = {}
        self.finalists = FinalistRows()
        self.variants: list[tuple[str, Policy, Measurement]] = []
        self._autocast_fn: Any = None  # torch.autocast's module as compiled for its baseline
        self._fp32_fn: Any = None  # the all-fp32 finalist as compiled (fp32 + torch.compile), once measured
        self._chosen_fn: Any = None  # the choice as compiled, once the race decided
        self.trajectory = TrajectoryCheck(harness, autocast, traj_steps, lambda: (
            self._autocast_fn if self._autocast_fn is not None else self.build(self.h.model)),
            lambda: self._fp32_fn)
        self._notes: dict[str, str | None] = {}  # a contender's note before any head-to-head

    @property
    def autocast_bar(self) -> Measurement | None:
        """torch.autocast's measurement as the head-to-head's bar: :attr:`autocast_compiled`, or
        :attr:`autocast_eager` without compile (None before :meth:`run`)."""
        return self.autocast_compiled if self.compile else self.autocast_eager

    @property
    def gates(self) -> list[Gate]:
        """The gates every finalist (and torch.autocast as a bar) passes before the race: drift, memory."""
        return [DriftGate(self.budget), MemoryGate(self.memory_budget, self.compile, self.h.random)]

    def build(self, gm: Any, activation_memory_budget: float = 1.0,
              options: CompileOptions = REGIONAL_EMULATED) -> Any:
        """``gm`` as the contest trains it: compiled with Inductor under ``options`` (a lowered
        graph; the model itself, torch.autocast's baseline, with Inductor's defaults, dynamic if its
        batch shapes vary), or with its saved dtypes eagerly without compile."""
        if self._fit_bar is not None:
            self._fit_bar.step(f"activation memory budget {activation_memory_budget:g}")
        if not self.compile:
            return saved_eager(gm)
        with self.clock("compile_s"):
            dynamic = autocast_dynamic(self.h.batches) if gm is self.h.model else None
            return compile_graph(gm, activation_memory_budget, dynamic=dynamic, regional=options.regional,
                                 emulate_precision_casts=options.emulate_precision_casts)

    @staticmethod
    def compiled_as(pol: Policy) -> CompileOptions:
        """The options the contest compiles ``pol`` with, and the ones a written policy records: its
        own (a compile variant's), else :data:`~autoprec.policy.compile_options.REGIONAL_EMULATED`."""
        return pol.compile_options or REGIONAL_EMULATED

    def recorded_options(self, pol: Policy) -> CompileOptions:
        """The options a written policy records for ``pol``, the choice: :meth:`compiled_as` as its
        compile carried them out, flat where regional was asked for but the policy's saved dtypes or
        memory budget keep the graph flat (:meth:`Policy.carried_out`), or where the compile outlined
        no repeated blocks (a model without them: what was measured, and what ``apply`` compiles, is
        one flat graph)."""
        options = pol.carried_out(self.compiled_as(pol))
        regions = getattr(self._chosen_fn, "regions", None)  # a CompiledGraph's outlining plan
        if options.regional and self._chosen_fn is not None and not (regions and regions.blocks):
            options = dataclasses.replace(options, regional=False)
        return options

    def measure(self, pol: Policy) -> tuple[Any, Measurement]:
        """``pol``'s module as the contest trains it (:meth:`build`, Inductor's default activation
        memory budget: the memory fit lowers it; its ``compile_options``, regional with emulated
        casts where it has none) and its measurement: drift and memory, timed now only on CUDA
        (elsewhere in the head-to-head's rounds)."""
        fn = self.build(run_pipeline(self.h.graph_module, pol).graph_module, options=self.compiled_as(pol))
        return fn, self._measure_fn(fn, pol, timing=self.h.device.type == "cuda")

    def _measure_fn(self, fn: Any, pol: Policy, timing: bool = True) -> Measurement:
        return self.h.measure(fn, lambda: make_scaler(pol), timing=timing, max_step_s=self.slow)

    def run(self, feasible: list[optuna.trial.FrozenTrial], k: int,
            memory_budget: Callable[[], float | None] = lambda: None) -> tuple[Policy, Measurement]:
        """The policy to write, with its measurement: the candidates measured, gated on drift and
        memory, raced head to head with the baselines, the choice checked on its trajectory and the
        race run again without it when it fails. ``memory_budget`` is called once torch.autocast
        is measured (``--max-memory auto`` refers to it) and gives the byte budget or None.

        Raises:
            SearchError: no feasible trial; no finalist passed the gates (the message says why
                each failed); no policy was timed, or every one timed failed its trajectory.
        """
        if not feasible:
            raise SearchError("no trial met the drift budget, not even all-fp32 (see the study's "
                              "autoprec:error attributes)")
        with phase_bar("finalists", None, self.progress) as bar:
            return self._run(feasible, k, memory_budget, bar)

    def _run(self, feasible, k, memory_budget, bar: PhaseBar) -> tuple[Policy, Measurement]:
        bar.step(self.ac_label)
        self.measure_autocast()
        self.memory_budget = memory_budget()
        if self.memory_budget is not None:
            log(f"memory budget {format_bytes(self.memory_budget)}", self.quiet)
            feasible = feasible if self.compile else eager_fitting(feasible, self.memory_budget)
        survivors: list[Entry] = []
        measured: list[Measurement] = []
        candidates = self.candidates(feasible, k)
        bar.set_total(len(candidates) + 2)  # torch.autocast's compile, the finalists, the head-to-head
        for cand in candidates:
            check_interrupt()
            log(f"finalist {cand.name}: {cand.policy.summary()}", self.quiet)
            bar.step(cand.name)
            entry = self._enter(cand)
            measured.append(entry.measurement)
            how = "compiled" if self.compile else "eager"
            why = entry.outcome.reason if not entry.outcome.going_on else None
            log(f"  {how}: grad_rel_l2 {entry.measurement.grad_rel_l2:.3g}"
                + (f" -> rejected: {why}" if why else ""), self.quiet)
            if why is None:
                survivors.append(entry)
            elif not entry.measurement.failed:
                self.finalists.reject(entry.candidate.policy, why)
        if not survivors:
            raise SearchError(why_no_finalist(measured, self.budget, self.memory_budget, self.compile,
                                              self.h.random))
        bar.step("head-to-head")
        try:
            return self.race(survivors)
        finally:
            self.trajectory.release()  # the head-to-head's training runs (TrajectoryCheck.share)

    def measure_autocast(self) -> None:
        """Build torch.autocast + torch.compile (eager without compile), the comparison users care
        about, and measure its drift and memory (:attr:`autocast_compiled`, or :attr:`autocast_eager`
        without compile); on a graph that draws random numbers the drift budget becomes its compiled
        one (:meth:`AutocastBaseline.compiled_budget`). Where it is not in the contest
        (:meth:`AutocastBaseline.in_contest`) nothing runs and, with compile, its row says why.
        The first step of :meth:`run`."""
        if not self.autocast.in_contest(self.h.random):
            log(f"{self.ac_label}: not {'compiled' if self.compile else 'timed'}, "
                f"{self.autocast.cannot_win}: it cannot be the baseline to beat", self.quiet)
            if self.compile:
                self.autocast_compiled = self.autocast.not_run()
            return
        if self.compile:
            log("compiling the torch.autocast baseline with Inductor", self.quiet)
        self._autocast_fn = self.build(self.h.model) if self.compile else self.h.model
        ac = self.autocast.measure_in_contest(self.h, self._autocast_fn, self.compile, self.slow)
        if not self.compile:
            self.autocast_eager = ac
            return
        self.autocast_compiled = ac
        compiled = AutocastBaseline.compiled_budget(ac, self.budget, self.h.random)
        if compiled is not None:
            self.budget = compiled
            log(f"the graph draws random numbers: compiled finalists are judged against torch.autocast + "
                f"torch.compile's drift (mean {ac.grad_rel_l2:.3g}), both compiled", self.quiet)

    def _enter(self, cand: Candidate) -> Entry:
        """Measure ``cand``, fit it to the memory budget where it is over it (compiled only), and
        gate it on drift and memory."""
        pol = cand.policy
        fn, m = self.measure(pol)
        self.finalists.add(pol, m, timed=bool(m.step_times))
        entry = Entry(cand, fn, m)
        if (self.compile and self.memory_budget is not None and not m.failed and self.budget.feasible(m)
                and m.peak_bytes > self.memory_budget):
            with phase_bar("memory fit", None, self.progress) as self._fit_bar:
                try:
                    pol, fn, m = self._memory_fit().fit(pol, m)
                finally:
                    self._fit_bar = None
            role = Role.BASELINE if all_fp32(pol) else Role.POLICY  # a lever makes fp32 another computation
            entry = Entry(Candidate(fitted_label(cand.name, pol), role, pol), fn, m)
        if self.compile and all_fp32(pol) and not m.failed:  # the trajectory check's reference
            self._fp32_fn, self.fp32_compiled = fn, m
        entry.outcome = first_failure(entry, self.gates)
        return entry

    def _memory_fit(self) -> MemoryFit:
        return MemoryFit(self.h, self.build, self._measure_fn, self.budget.feasible, self.memory_budget,
                         self.finalists.add, self.quiet)

    def race(self, survivors: list[Entry]) -> tuple[Policy, Measurement]:
        """Time the surviving finalists (gated entries) with the baselines (:meth:`_time`) and pick
        by the race rule; the choice must pass the :class:`TrajectoryGate`. One that fails is rejected (the
        report's note) and the rest are timed again without it, so the next decision rests on rounds
        whose retire and stop rules never saw the rejected policy; only a rejection pays a second
        head-to-head.

        Raises:
            SearchError: no policy was timed, or every one timed failed the trajectory check."""
        rejected: list[str] = []
        gate = TrajectoryGate(self.trajectory)
        while True:
            lineup, race = self._time(survivors)
            try:
                decision = race.decide(lineup)
            except ValueError:
                self.decision = None
                raise SearchError("no finalist was timed in the final head-to-head" + (
                    f" after {', '.join(rejected)} failed the trajectory check" if rejected else "")
                    + " (see the log)") from None
            chosen = next(e for e in survivors if e.name == decision.chosen.name)
            outcome = gate.judge(chosen)
            if outcome.going_on:
                break
            log(f"  {chosen.name} -> rejected: {outcome.reason}; the others timed again without it",
                self.quiet)
            self.finalists.reject(chosen.candidate.policy, outcome.reason)
            rejected.append(chosen.name)
            survivors = [e for e in survivors if e.name != chosen.name]
        if self.compile_variants != "none":
            chosen, decision = self._vary(chosen, survivors, decision)
        pol, self._chosen_fn = chosen.candidate.policy, chosen.fn
        if pol.training_key() in self.trajectory.traj:  # measured: it lowers something, K > 0
            t = self.trajectory
            log(f"  {chosen.name}: traj_rel {t.of(pol):.3g} over {t.steps} steps (torch.autocast's "
                f"{t.budget:.3g}" + ("" if t.budget_steps >= t.steps else
                                     f" or more: {t.budget_steps} of its steps decided") + ")", self.quiet)
        decision.rejected = rejected
        self.decision = decision
        log(decision.describe(), self.quiet)
        return pol, chosen.measurement

    def _vary(self, chosen: Entry, survivors: list[Entry], decision: Decision) -> tuple[Entry, Decision]:
        """The choice against its compile variants (:func:`variant_options`), each measured and gated
        as the finalists are, timed in a second head-to-head with the baselines among ``survivors``;
        the race decides again (a tie keeps the choice as first compiled: earlier in the lineup, same
        rules, and a variant's drift counts as at least the choice's, ``Entry.tie_drift``). A variant
        chosen must pass the trajectory gate too, else the first decision stands. Returns the choice
        and its decision."""
        pol = chosen.candidate.policy
        variants = []
        for options in variant_options(pol, chosen.fn, self.compile_variants):
            vpol = dataclasses.replace(pol, compile_options=options)
            fn, m = self.measure(vpol)
            self.finalists.add(vpol, m, timed=bool(m.step_times))
            # a tie keeps the choice as first compiled: the variant computes the same policy, and a
            # drift lower by the compile's summation order (3.45e-7 against 3.53e-7) is no reason
            e = Entry(Candidate(f"{chosen.name}, compiled {options.describe()}", chosen.candidate.role, vpol),
                      fn, m, tie_drift=max(m.grad_rel_l2, chosen.measurement.grad_rel_l2))
            e.outcome = first_failure(e, self.gates)
            log(f"  compile variant {e.name}: grad_rel_l2 {m.grad_rel_l2:.3g}"
                + ("" if e.outcome.going_on else f" -> rejected: {e.outcome.reason}"), self.quiet)
            variants += [e] if e.outcome.going_on else []
        if not variants:
            return chosen, decision
        log(decision.describe(), self.quiet)  # the first decision, before its variants race it
        bars = [e for e in survivors if e.candidate.role is Role.BASELINE and e is not chosen]
        entries = [chosen, *variants, *bars]
        lineup, race = self._time(entries)
        self.variants = [(e.name, e.candidate.policy, e.measurement) for e in [chosen, *variants]]
        again = race.decide(lineup)
        winner = next(e for e in entries if e.name == again.chosen.name)
        if winner in variants and not TrajectoryGate(self.trajectory).judge(winner).going_on:
            log(f"  {winner.name} -> rejected: {self.trajectory.reason(winner.candidate.policy)}; "
                f"{chosen.name} stands", self.quiet)
            return chosen, decision
        again.rejected = decision.rejected
        return winner, again

    def _time(self, survivors: list[Entry]) -> tuple[list[Contender], Race]:
        """Time ``survivors`` beside torch.autocast (a bar when within the drift and memory budgets,
        else shown) and fp32 eager in one interleaved run (:func:`time_interleaved`, with the
        race's retire and settled rules); every measurement (the baselines' included) takes its
        speed from those rounds, so the ratios the report and the policy file give are side by
        side in one process. Returns the contenders and their race."""
        ac = self.autocast_bar
        for name, m in [(e.name, e.measurement) for e in survivors] + [(self.ac_label, ac)]:
            if m is not None:  # a timing again (after a rejection) drops the last one's note
                m.note = self._notes.setdefault(name, m.note)
        autocast = self._autocast_entry()
        configs = [self._config(e.name, e.fn, lambda p=e.candidate.policy: make_scaler(p)) for e in survivors]
        if autocast is not None:  # timed either way: the side-by-side table reports it
            configs.append(self._config(self.ac_label, self._autocast_fn, self.autocast.scaler_factory(),
                                        self.autocast.dtype))
        configs.append(Config(FP32_EAGER, self.h.model, guarded=False))  # the slow-step limit's reference
        log(f"final head-to-head, interleaved: {', '.join(c.name for c in configs)}", self.quiet)
        race = Race.of(contenders(survivors, autocast))  # the roles, before any timing
        start = time.perf_counter()
        self.timings = time_interleaved(self.h, configs, max_step_s=self.slow, retire=race.retire(),
                                        settled=race.settled(),
                                        narrow=race.narrow(lambda ts: contenders(survivors, autocast, ts)))
        rounds = max((t.rounds for t in self.timings.values()), default=0)
        log(f"  {rounds} rounds in {time.perf_counter() - start:.0f} s, warm-up included", self.quiet)
        for e in survivors:
            _take_timing(e.measurement, self.timings[e.name])
            self.finalists.timed(e.candidate.policy, e.measurement, retired=self.timings[e.name].retired)
        if autocast is not None:
            _take_timing(ac, self.timings[self.ac_label])
        lineup = contenders(survivors, autocast, self.timings)
        shown = [(c.name, c.timing, "") for c in lineup]
        if autocast is not None and autocast.candidate.role is Role.SHOWN:  # a row of the log too
            shown.insert(-1, (self.ac_label, self.timings[self.ac_label],
                              "over the drift or memory budget: not a bar"))
        for name, t, extra in shown:
            why = "; ".join(x for x in (t.error or t.note, extra) if x)
            log(f"  {name}: {format_rate(t)} tok/s" + (f" ({why})" if why else ""), self.quiet)
        return lineup, race

    def _autocast_entry(self) -> Entry | None:
        """torch.autocast in the head-to-head (None where it was not run or failed): a baseline
        when it passes the drift and memory gates as the finalists do (judged batch for batch when
        its drift ran on batch 0 only, :meth:`AutocastBaseline.drift_on_batch_0`), else shown."""
        ac = self.autocast_bar
        if self._autocast_fn is None or ac is None or ac.failed:
            return None
        cut = ac.outcome.stage is Stage.CUT  # its drift ran on batch 0 only
        drift = self.budget.on_batches(len(ac.grad_rel_l2_batches)) if cut else self.budget
        entry = Entry(Candidate(self.ac_label, Role.SHOWN), self._autocast_fn, ac)
        entry.outcome = first_failure(entry, [DriftGate(drift), MemoryGate(self.memory_budget)])
        if entry.outcome.going_on:
            entry.candidate = Candidate(self.ac_label, Role.BASELINE)
        return entry

    def _config(self, label: str, fn: Any, scaler_factory: Any, autocast_dtype: Any = None) -> Config:
        """A head-to-head configuration whose timed steps are one training run from the initial
        weights, whose losses the trajectory check reads if it needs them (TrajectoryCheck.share)."""
        run = self.trajectory.share(fn, scaler_factory, autocast_dtype)
        return Config(label, fn, scaler_factory, autocast_dtype, run=run)

    def candidates(self, feasible: list[optuna.trial.FrozenTrial], k: int) -> list[Candidate]:
        """The k fastest feasible trials, plus the autocast twin (the fallback when nothing beats
        torch.autocast + torch.compile), the ``also`` policies (compiled only) and all-fp32 (fp32 +
        torch.compile, a baseline; :data:`FP32_GRAPH` without compile), each once: a lowered policy
        must beat both measured the same way to be chosen. Where torch.autocast is not in the
        contest (:meth:`AutocastBaseline.in_contest`) the twin and ``also`` have nothing to match
        (their gain was fast low-precision GEMMs): they are finalists only as trials, by their
        eager speed."""
        base = FP32_COMPILED if self.compile else FP32_GRAPH
        out = []
        for t in feasible[:k]:
            pol = Policy.from_dict(t.user_attrs[attrs.POLICY])
            self.eager_tokens_per_s[pol.training_key()] = t.values[0]
            name = f"trial {t.number} (eager {t.values[0]:.0f} tok/s)"  # all-fp32: a baseline, said so
            out.append(Candidate(f"{base}, {name}", Role.BASELINE, pol) if all_fp32(pol)
                       else Candidate(name, Role.POLICY, pol))
        keys = {c.policy.training_key() for c in out}
        also = self.also if self.compile else []  # their gain only compiling shows
        twin = [(self.twin, "autocast twin")] if self.twin is not None else []
        forced = twin + also if self.autocast.in_contest(self.h.random) else []
        for pol, label in forced:
            if pol.training_key() not in keys:
                out.append(Candidate(label, Role.POLICY, pol))
                keys.add(pol.training_key())
        if not any(all_fp32(c.policy) for c in out):
            out.append(Candidate(base, Role.BASELINE, Policy.fp32()))
        return out


def _take_timing(m: Measurement, t: Timing) -> None:
    """Give ``m`` the head-to-head's step times and speed (its drift and memory stay)."""
    if t.step_times:
        m.step_times, m.step_s, m.tokens_per_s = list(t.step_times), t.step_s, t.tokens_per_s
    m.add_note(t.error or t.note)
