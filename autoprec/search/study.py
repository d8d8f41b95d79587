"""``autoprec.tune``: an Optuna study over policies, measured on the device
(docs/architecture.md#data-flow, #search).

:func:`tune` reads as its phases: capture (load model.py, capture, FP32 reference) -> probe (which
low dtypes have a kernel within :data:`~autoprec.search.probe.TOL` of fp32's time) -> baselines
(FP32 and torch.autocast, eager; the drift budget) -> search (Optuna trials, each lowering the graph
and measuring eager training steps, ``grad_rel_l2`` and memory; a per-node dtype assignment already
measured in the study is reused; :mod:`autoprec.search.trials`) -> finalists (the fastest feasible
trials compiled with Inductor, or eager with ``--no-compile``, and measured again, drift included,
with ``max_memory`` fitted to the memory budget, timed head to head with the baselines, the choice
checked on ``traj_rel`` over K optimizer steps; :mod:`autoprec.search.contest`) -> write (report,
then the policy file).

Screening eagerly and compiling only finalists keeps a trial to a few eager steps instead of an
Inductor compile per trial (docs/architecture.md#design-choices); the finalists' compiled numbers
are what the policy file reports.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import torch

from autoprec._interrupt import check as check_interrupt
from autoprec._interrupt import deferred as deferred_interrupt
from autoprec._version import __version__
from autoprec.device import device_name, resolve_device
from autoprec.errors import AutoprecError, SearchError
from autoprec.measure import Harness, Measurement
from autoprec.measure.load import LoadMonitor
from autoprec.modelspec import ModelSpec, load_model_spec
from autoprec.nodekeys import graph_fingerprint
from autoprec.policy import Policy
from autoprec.search import attrs, screen_cut
from autoprec.search.batch_phase import BatchChoice, check_global_batch, micro_batch_phase
from autoprec.search.budgets import (
    check_memory_floor,
    default_device_budget,
    memory_budget,
    parse_dtypes,
    parse_max_drift,
    parse_max_memory,
)
from autoprec.search.contest import FP32_EAGER, Contest, compile_variants_arg
from autoprec.search.drift_budget import MAX_AUTO_REFERENCE, DriftBudget
from autoprec.search.finalist_pool import feasible, why_none_feasible
from autoprec.search.kernel_choice import (
    adopt_study_kernels,
    probe_decision,
    probe_phase,
    sensitivity_gemms,
    trial_cannot_win,
)
from autoprec.search.objective import Objective, name_nonfinite
from autoprec.search.phases import accounted, phase_bar
from autoprec.search.probe import TOL
from autoprec.search.progress import LoadClock, log
from autoprec.search.race import Decision
from autoprec.search.results import baseline_to_beat, measured_block, note_if_eager_was_faster, side_by_side
from autoprec.search.space import (
    ATTENTION_BASELINE,
    SAVED_LEVERS,
)
from autoprec.search.storage import (
    check_study,
    default_storage,
    default_study_name,
    open_study,
    precheck_study,
    study_choices,
)
from autoprec.search.trials import enqueue_baselines, finished, optimize, region_sensitivity
from autoprec.search.tune_state import TuneState

__all__ = ["TuneResult", "tune"]

#: A configuration whose training step takes longer than this many fp32 eager steps stops being
#: timed (two such steps in a row, or one over 4x: ``Harness.measure``'s ``max_step_s`` rule) and
#: is reported from its last step: it cannot win, and emulated dtypes (bf16 on AVX2 CPUs) run
#: 10-100x slower.
SLOW_RATIO = 3.0
#: ... but that limit is never below this many seconds: tiny models' steps are dominated by
#: Python overhead noise.
SLOW_FLOOR_S = 0.25
#: Trials a study should hold when ``trials`` is not given.
DEFAULT_TRIALS = 20


@dataclass
class TuneResult:
    """What :func:`tune` returns.

    Attributes:
        policy: The chosen policy with its ``measured`` and ``provenance`` blocks.
        study: The Optuna study (all trials and their ``autoprec:`` user attributes).
        table: Rows ``{"config", "tokens_per_s", "speedup_vs_fp32", "grad_rel_l2", "peak_bytes"}``
            for FP32, torch.autocast (eager and compiled) and the chosen policy.
        timings: Seconds spent per phase (``capture_s``, ``probe_s``, ``baselines_s``,
            ``sensitivity_s``, ``trials_s``, ``finalists_s``, ``micro_batch_s`` with ``global_batch``,
            ``compile_s``, ``total_s``); the
            Inductor compiles the finalists trigger lazily are in ``compile_s``, not ``finalists_s``.
        probes: Per-dtype matmul probe results.
        budget: The drift budget the written policy was judged by (:class:`DriftBudget`: the
            search's, the study's ``autoprec:drift_rule``, except on a graph that draws random
            numbers, whose compiled finalists are judged against torch.autocast + torch.compile's
            drift); the ``wrote`` line describes it.
        decision: The final head-to-head's :class:`~autoprec.search.race.Decision` (what was
            chosen, against which baseline, the verdict); None when none was made.
    """

    policy: Policy
    study: optuna.Study
    table: list[dict[str, Any]]
    timings: dict[str, float] = field(default_factory=dict)
    probes: dict[str, Any] = field(default_factory=dict)
    budget: DriftBudget | None = None
    decision: Decision | None = None


def tune(model_path: str | os.PathLike, trials: int | None = None, timeout: float | None = None,
         max_drift: str | float = "auto", device: str = "auto", storage: str | None = None,
         study_name: str | None = None, compile: bool = True, out: str | os.PathLike = "policy.json",
         seed: int = 0, finalists: int = 2, quiet: bool = False, progress: bool = True,
         dtypes: str | list[str] = "auto", traj_steps: int = 20, report: bool = True,
         max_memory: str | float | None = None, strict_timing: bool = False,
         compile_variants: str | bool = "flat", global_batch: int | None = None) -> TuneResult:
    """Search for the fastest policy within a drift budget and write it to ``out``.

    Args:
        model_path: A model file following the model.py contract (docs/architecture.md#modelpy-contract).
        trials: Finished trials the study should hold (default 20); a resumed or shared study
            counts the trials it already has, so re-running the same command resumes.
        timeout: Stop sampling new trials after this many seconds. device: ``auto``, ``cpu``, ``cuda``.
        max_drift: ``"auto"``: not worse than ``torch.autocast`` at the device's default low dtype,
            measured in this run on the same drift batches, beyond noise (a paired t-test on the
            per-batch ``grad_rel_l2``, 2% margin: :class:`autoprec.search.drift_budget.DriftBudget`);
            or a number, a hard limit on the mean ``grad_rel_l2`` over the drift batches.
        storage: Optuna storage URL (default: SQLite file beside ``out``); any RDB URL (shared).
        study_name: Study name (default derived from the model file, graph and device).
        compile: Compile finalists with Inductor (the policy is measured as training runs it);
            ``False`` measures everything eagerly.
        out: Policy file to write (atomically); the report goes beside it. seed: Sampler seed.
        finalists: How many of the fastest feasible trials are re-measured compiled (eagerly
            without compile); a trial's screening stops early once it cannot be one of them
            (:mod:`autoprec.search.screen_cut`; not with ``max_memory`` and without ``compile``).
        quiet: No log lines. progress: Show a progress bar (stderr) over each long phase
            (:mod:`autoprec.search.phases`) where stderr is a terminal.
        dtypes: Low dtypes to search: ``"auto"`` keeps those with a kernel the probe measured within
            10% of fp32's time on this device (native, or low storage with fp32 compute; fp8: faster,
            :mod:`autoprec.search.probe`); a list (or comma-separated string) forces them.
        traj_steps: K, the optimizer steps of the ``traj_rel`` check on the policy to be written
            when it lowers anything (budget: torch.autocast's ``traj_rel`` over the same steps).
        report: Write the markdown report and plots beside ``out``.
        max_memory: Memory budget for the chosen policy's ``peak_bytes``: None, ``"auto"``
            (torch.autocast's peak here, compiled with ``compile``), ``"<r>x"`` (of FP32 eager's),
            ``"<p>%"`` (of the device's memory) or bytes (:func:`~autoprec.search.budgets.parse_max_memory`).
            Compiled, a finalist over it is fitted by its memory levers (:class:`~autoprec.search.
            memory_fit.MemoryFit`); eager, trials and finalists over it are not finalists.
        compile_variants: The compile variants the compiled choice races, one compile each, the
            fastest's options written: ``"flat"``, ``"all"`` or ``"none"``
            (:data:`autoprec.policy.COMPILE_VARIANTS`; ``True``/``False``: ``"all"``/``"none"``).
        global_batch: Examples per optimizer step: the micro-batch is searched with the memory lever
            within ``max_memory`` and written (:mod:`autoprec.search.micro_batch`, ``Policy.batching``);
            None: the model file's batch, as before.
        strict_timing: Raise :class:`~autoprec.measure.load.BusyMachineError` when the machine is
            busy instead of warning (:mod:`autoprec.measure.load`: at the start, after the baselines,
            after the trials and after the head-to-head, before anything is written).

    Returns:
        :class:`TuneResult`.

    Raises:
        ModelSpecError, CaptureError: the model file is invalid, or cannot be captured (nothing written).
        SearchError: bad ``max_drift``, ``max_memory``, ``dtypes`` or ``global_batch`` (before any
            capture: :func:`_memory_arg`); no policy met the budgets.
        BusyMachineError: ``strict_timing`` and the machine is busy (CLI exit 2).
        PolicyError: ``out`` is a file other than a policy (before any work; kept). ValueError: a bad
            ``compile_variants`` (before any capture). OSError: the report or the policy file could
            not be written (one already at ``out`` is replaced whole or not at all)."""
    drift_arg, forced, variants = _parsed(max_drift, dtypes, compile_variants, out)
    spec = load_model_spec(model_path)
    memory_arg = _memory_arg(spec, max_memory, global_batch, device)
    run = _capture(spec, device, quiet, strict_timing, progress and not quiet and sys.stderr.isatty())
    run.kernels = probe_phase(run.gm, run.dev, run.clock, forced, SAVED_LEVERS if memory_arg else (), quiet)
    storage = storage or default_storage(out)
    study_name = study_name or default_study_name(run.spec.path, run.gm, run.dev, forced)
    _adopt(run, study_choices(storage, study_name))  # a shared study's kernels
    precheck_study(storage, study_name, run.space, _graph(run))  # a study this run cannot resume fails now
    _baselines(run, drift_arg, memory_arg)
    # the screening cut keeps k; --no-compile's budget may pass them; --global-batch's binds micro-batches
    contest_memory = memory_arg if global_batch is None else None
    study = _search(run, storage, study_name, seed, trials, timeout, run.progress,
                    finalists if contest_memory is None or compile else None)
    contest = _contest(run, compile, traj_steps, variants)
    chosen, chosen_m = _finalists(run, contest, study, finalists, contest_memory)
    batches = None if global_batch is None else micro_batch_phase(
        run, contest, chosen, global_batch, compile, _memory_bytes(run, contest, memory_arg))
    return _write(run, study, contest, batches.policy if batches else chosen, chosen_m, compile, out, report,
                  batches)


def _parsed(max_drift: str | float, dtypes: str | list[str], compile_variants: str | bool,
            out: str | os.PathLike) -> tuple[Any, Any, str]:
    """``tune``'s arguments that need no model, checked before any work: ``--max-drift``
    (:func:`parse_max_drift`), ``--dtypes`` (:func:`parse_dtypes`), ``--compile-variants``
    (:func:`~autoprec.search.contest.compile_variants_arg`), and ``out``, which must not be a file
    other than a policy (:meth:`Policy.check_replaceable`: the user's model file or config).
    Raises: ValueError: one is malformed. PolicyError: ``out`` is another file."""
    Policy.check_replaceable(out)
    return parse_max_drift(max_drift), parse_dtypes(dtypes), compile_variants_arg(compile_variants)


def _memory_arg(spec: ModelSpec, max_memory: str | float | None, global_batch: int | None,
                device: str) -> tuple[str, float] | None:
    """The parsed ``max_memory`` (:func:`parse_max_memory`; with ``global_batch`` on CUDA and no
    ``max_memory``, :func:`default_device_budget`), after the checks that need no capture: a
    ``global_batch`` the model file cannot give (:func:`check_global_batch`) and, as the CLI does, a
    byte budget not above the fp32 state (:func:`check_memory_floor`).

    Raises:
        SearchError: either check failed, or ``max_memory`` is not a budget."""
    memory_arg = parse_max_memory(max_memory)
    if global_batch is not None:
        check_global_batch(spec, global_batch, resolve_device(device))
        memory_arg = memory_arg or default_device_budget(resolve_device(device))
    if memory_arg is not None and memory_arg[0] == "bytes":
        check_memory_floor(memory_arg, spec.build_model(), spec.make_optimizer, option="max_memory")
    return memory_arg


def _capture(spec: ModelSpec, device: str, quiet: bool, strict_timing: bool = False,
             progress: bool = False) -> TuneState:
    """Phase 1: check the machine's load (:mod:`autoprec.measure.load`; again after the baselines,
    through the clock when the finalists begin, and after their head-to-head), capture the loaded
    model file and compute the FP32 reference (``Harness``).

    Raises:
        BusyMachineError: ``strict_timing`` and the machine is busy, before anything is captured.
    """
    dev = resolve_device(device)
    clock = LoadClock(LoadMonitor.start(dev, strict_timing), {"finalists_s": "after trials"})
    with clock("capture_s"):
        harness = Harness(spec, dev)
    log(f"captured {spec.path}: {len(harness.graph_module.graph.nodes)} nodes, "
        f"{harness.tokens} tokens/batch, device {device_name(dev)}", quiet)
    return TuneState(spec, dev, harness, clock, quiet, progress)


def _baselines(run: TuneState, drift_arg: float | None, memory_arg: tuple[str, float] | None) -> None:
    """Phase 3: FP32 and torch.autocast as users run them (their own module, eager), and the
    drift budget; a memory budget known now (not ``auto``) is checked before any trial.

    Raises:
        SearchError: the fp32 training step itself fails (non-finite: names the first node), the
            drift budget is not finite or torch.autocast's drift is not rounding
            (:data:`~autoprec.search.drift_budget.MAX_AUTO_REFERENCE`), or the memory budget is impossible.
        BusyMachineError: under ``strict_timing``, the machine is busy after the baselines.
    """
    h = run.harness
    with run.clock("baselines_s"), phase_bar("baselines", 2, run.progress) as bar:
        bar.step("fp32 eager")  # screened (its speed sets `slow`; the head-to-head's is reported)
        run.fp32 = h.measure(h.model, screen=True)
        if run.fp32.failed:  # nothing to tune against (case C09's always-inf forward)
            why = name_nonfinite(run.fp32, h.graph_module, h.batches)
            raise SearchError(f"{run.spec.path}: the model's own fp32 training step fails ({why}); autoprec "
                              "tunes a model that trains in fp32: fix the model or its batches first")
        run.slow = max(SLOW_RATIO * run.fp32.step_s, SLOW_FLOOR_S)
        run.baseline = run.kernels.autocast(run.slow)
        bar.step(f"torch.autocast({run.ac_dtype}) eager")
        run.autocast = run.baseline.measure_eager(h, run.slow, run.quiet)
    ac = run.autocast
    if drift_arg is None and not (math.isfinite(ac.grad_rel_l2) and ac.grad_rel_l2_batches):
        raise SearchError(f"drift budget is not finite (torch.autocast: {ac.error}); pass --max-drift X")
    if drift_arg is None and ac.grad_rel_l2 >= MAX_AUTO_REFERENCE:  # case C04 under fp16 autocast
        raise SearchError(
            f"{run.spec.path}: torch.autocast({run.ac_dtype})'s own gradients are grad_rel_l2 "
            f"{ac.grad_rel_l2:.3g} from fp32's (mean over {len(ac.grad_rel_l2_batches)} batches; rounding "
            "gives ~1e-3 to 1e-2): it overflows or underflows somewhere, so a budget relative to it would "
            "pass broken policies; pass --max-drift X")
    run.budget = (DriftBudget.auto(ac.grad_rel_l2_batches) if drift_arg is None
                  else DriftBudget.fixed(drift_arg))
    if memory_arg is not None and memory_arg[0] != "autocast":  # known now: fail before the trials
        memory_budget(memory_arg, run.fp32, ac, h.state_bytes, h.optimizer_name, run.dev)
    note = f" ({ac.error or ac.note})" if ac.error or ac.note else ""
    log(f"fp32 eager {run.fp32.tokens_per_s:.0f} tok/s; autocast({run.ac_dtype}) eager "
        + (f"{ac.tokens_per_s:.0f} tok/s" if ac.tokens_per_s else "not timed")
        + f"{note}, grad_rel_l2 {ac.grad_rel_l2:.3g} -> drift budget: {run.budget.describe()}; "
        f"{run.space.n_params} search parameters", run.quiet)
    if isinstance(run.clock, LoadClock):
        run.clock.monitor.check("after baselines")


def _search(run: TuneState, storage: str, study_name: str, seed: int, trials: int | None,
            timeout: float | None, progress: bool, cut_k: int | None) -> optuna.Study:
    """Phase 4: open (or resume) the study, queue the baselines in a new one, run the trials (with
    the screening cut for ``cut_k`` finalists unless None: :mod:`autoprec.search.screen_cut`)."""
    study = open_study(storage, study_name, seed)
    stamped = lambda: (study.user_attrs.get(attrs.SPACE) or {}).get("dtypes")  # noqa: E731
    _adopt(run, stamped())  # another worker's
    check_study(study, storage, run.space, probe=probe_decision(run.probes), graph=_graph(run))
    _adopt(run, stamped())  # one that stamped at the same moment
    study.set_user_attr(attrs.DRIFT_BUDGET, run.budget.value)
    study.set_user_attr(attrs.DRIFT_RULE, run.budget.to_dict())
    if study.trials:  # a resumed (or shared) study: say what it holds, as the trial numbers do not
        done = finished(study)  # what counts towards --trials
        want = trials if trials is not None else DEFAULT_TRIALS
        ran = sum(t.state != optuna.trial.TrialState.WAITING for t in study.trials)  # queued ones did not run
        log(f"resuming study {study.study_name!r}: {done} trial(s) that count kept (of {ran} run), "
            f"{max(want - done, 0)} more to reach {want}", run.quiet)
    if not study.trials:  # a new study: rank regions, then queue the baselines (resumes skip this)
        regions = len(run.space.region_params()) if run.space.low_dtypes else 0
        with (run.clock("sensitivity_s"),
              phase_bar("sensitivity", regions, run.progress and regions > 0) as bar):
            gemms = sensitivity_gemms(run.kernels, run.quiet)
            sens = region_sensitivity(run.harness, run.space, bar.step, gemms)
        if sens:
            study.set_user_attr(attrs.SENSITIVITY, sens)
            log("sensitivity (grad_rel_l2 with only that region lowered): "
                + ", ".join(f"{k} {v:.2g}" for k, v in sorted(sens.items(), key=lambda kv: -kv[1])),
                run.quiet)
        enqueue_baselines(study, run.space, sens)
    target = trials if trials is not None else DEFAULT_TRIALS
    if not run.space.low_dtypes and target > 1:  # every parameter's only float choice is fp32
        log(f"no low dtype is searched (none has a kernel measured within {TOL:.0%} of fp32's time here), "
            "so every policy is all-fp32: "
            f"1 trial instead of {target} (--dtypes bf16,fp16 searches them anyway)", run.quiet)
        target = 1
    objective = Objective(run.harness, run.space, run.budget, max_step_s=run.slow, finalists=cut_k,
                          cannot_win=lambda gm: trial_cannot_win(run.probes, gm, run.slow))
    with run.clock("trials_s"):
        optimize(study, objective, target, timeout, progress)
    if cut_k is not None:
        log(screen_cut.summary(study, cut_k), run.quiet)
    return study


def _adopt(run: TuneState, choices: list[str] | None) -> None:
    """Search a study's kernels where they differ from this run's probe's
    (:func:`~autoprec.search.kernel_choice.adopt_study_kernels`)."""
    run.kernels = adopt_study_kernels(run.kernels, run.gm, run.dev, choices, run.quiet)


def _contest(run: TuneState, compile: bool, traj_steps: int, compile_variants: str = "flat") -> Contest:
    """Phase 5's contest: the autocast twin, and the twin with math attention when attention is
    searched, always among the finalists."""
    twin, math_twin = run.space.twin(), run.space.attention_twin()
    also = [(run.space.to_policy(math_twin), ATTENTION_BASELINE[0])] if math_twin is not None else []
    return Contest(run.harness, run.budget, compile, run.baseline, run.slow, traj_steps, run.clock,
                   run.quiet, twin=run.space.to_policy(twin) if twin is not None else None,
                   progress=run.progress, also=also, compile_variants=compile_variants)


def _finalists(run: TuneState, contest: Contest, study: optuna.Study, k: int,
               memory_arg: tuple[str, float] | None) -> tuple[Policy, Measurement]:
    """Phase 5: the selector's pick among the ``k`` fastest feasible trials, the autocast twin and
    all-fp32, timed head to head with torch.autocast + torch.compile (torch.autocast eager without
    compile) and fp32 eager; fp32 eager's speed is then the head-to-head's (timed again with full
    steps only if the head-to-head did not time it), so every ratio rests on timings taken side by
    side and none on the baselines' screened passes."""
    h = run.harness
    with accounted(run.clock, "finalists_s"):  # the finalists' lazy Inductor compiles go to compile_s
        pool = feasible(study)
        if not pool:
            raise SearchError(why_none_feasible(study))
        chosen, chosen_m = contest.run(pool, k, lambda: _memory_bytes(run, contest, memory_arg))
    t = contest.timings.get(FP32_EAGER)  # timed in the head-to-head's rounds
    if t is None or not t.step_times:  # full steps again: the baselines phase screened its passes
        with run.clock("baselines_s"):
            t = h.measure(h.model)
    if t.step_times:
        run.fp32.step_times, run.fp32.step_s = list(t.step_times), t.step_s
        run.fp32.tokens_per_s = t.tokens_per_s
    return chosen, chosen_m


def _memory_bytes(run: TuneState, contest: Contest, memory_arg: tuple[str, float] | None) -> float | None:
    """The byte budget ``--max-memory`` means once the baselines are measured (``auto`` refers to
    torch.autocast as compiled, if it was; :func:`~autoprec.search.budgets.memory_budget`)."""
    h = run.harness
    ref = contest.autocast_compiled if _ok(contest.autocast_compiled) else run.autocast
    return memory_budget(memory_arg, run.fp32, ref, h.state_bytes, h.optimizer_name, run.dev)


def _write(run: TuneState, study: optuna.Study, contest: Contest, chosen: Policy, chosen_m: Measurement,
           compile: bool, out: str | os.PathLike, report: bool,
           batches: BatchChoice | None = None) -> TuneResult:
    """Phase 6: the policy's ``measured`` and ``provenance`` blocks, the side-by-side table, the
    report and the policy file (atomic, last), written together: a Ctrl-C while they are written
    is held back until both are (:func:`autoprec._interrupt.deferred`; it then raises), so a
    report never describes a policy that was not written (an older one at ``out``, say). The load
    is checked first (``after the head-to-head``: the rounds that decided; a user's one disturbance
    there went unreported), so a busy run warns, or under ``strict_timing`` writes nothing.

    Raises:
        BusyMachineError: ``strict_timing`` and the machine is busy; nothing is written."""
    run.clock.monitor.check("after the head-to-head")
    timings = run.clock.done()
    best = baseline_to_beat(contest, compile)
    options = contest.recorded_options(chosen) if compile else None  # how what was measured compiled
    measured = measured_block(run, contest, chosen, chosen_m, compile) | (
        batches.measured() if batches is not None else {})
    policy = dataclasses.replace(chosen, compile_options=options).with_measured(measured).with_provenance(
        model=str(run.spec.path), device=device_name(run.dev),  # the graph train captures: at the micro-batch
        graph_fingerprint=batches.graph_fingerprint if batches is not None else graph_fingerprint(run.gm),
        torch=torch.__version__, autoprec=__version__, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        study=study.study_name, compiled=compile, **({"baseline": best[0]} if best is not None else {}),
    )
    policy = policy.with_provenance(measured_policy=policy.measured_key)  # a later edit shows (edited_note)
    table = side_by_side(run, contest, chosen_m, compile)
    note_if_eager_was_faster(run, contest, chosen, chosen_m, compile)
    # what the report shows beyond the trials, kept in the study for ``autoprec report`` (the last run's)
    result = {"table": table, "policy": policy.to_dict(), "timings": timings, "shapes": run.harness.shapes,
              "levers": contest.finalists.rows,
              "decision": contest.decision.describe() if contest.decision is not None else None}
    if batches is not None:
        result["micro_batches"] = batches.report()
    study.set_user_attr(attrs.RESULT, result)
    check_interrupt()  # never begin writing after Ctrl-C, even one Python swallowed
    with deferred_interrupt():
        if report:
            from autoprec.search.report import write_report  # matplotlib: only when a report is written

            paths = write_report(study, Path(out).with_suffix(""), gm=run.gm,
                                 **{**result, "policy": policy})
            log("report: " + ", ".join(str(p) for p in paths), run.quiet)
        _note_replaced(out, run)
        policy.save(out)  # atomic; the last file written
    check_interrupt()  # a Ctrl-C that came while writing: both files are complete
    return TuneResult(policy, study, table, timings, run.probes, contest.budget, contest.decision)


def _note_replaced(out: str | os.PathLike, run: TuneState) -> None:
    """Say so when ``out`` holds a policy tuned for another model file (its ``provenance.model``),
    which the one written now replaces: a user's tune of another model into the same ``--out``
    replaced the first model's policy without a word. Nothing for a file that is not a policy."""
    try:
        old = Policy.load(out).provenance.get("model") if Path(out).is_file() else None
    except AutoprecError:
        return
    if old is not None and Path(str(old)).resolve() != Path(str(run.spec.path)).resolve():
        log(f"note: {out} held a policy tuned for {old}; it is replaced by this one, for {run.spec.path}",
            run.quiet)


def _graph(run: TuneState) -> dict:
    """The study's :data:`attrs.GRAPH` stamp of this run: its captured graph and model file."""
    return {"fingerprint": graph_fingerprint(run.gm), "model": str(run.spec.path)}


def _ok(m: Measurement | None) -> bool:  # measured (not skipped: it cannot win), without error
    return m is not None and not m.failed and m.peak_bytes > 0
