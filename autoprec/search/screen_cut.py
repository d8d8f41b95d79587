"""The screening cut (docs/architecture.md#search, "Screening cut"): a search trial stops its
drift passes as soon as they show it cannot become a finalist.

A trial's eager screening runs K drift passes (:meth:`autoprec.measure.Harness.measure` with
``screen=True``), each timed (batch 0's also counts memory). Only the k fastest
feasible trials go on (``tune --finalists k``), so a trial clearly slower than the k-th fastest
feasible one measured so far, or clearly over the drift budget, learns nothing more from its last
passes. Successive halving (Jamieson & Talwalkar 2016, "Non-stochastic Best Arm Identification
and Hyperparameter Optimization"; Li et al. 2017, Hyperband) spends the full measurement only on
candidates that can still win; this is its one-rung form with a margin for the noise of one pass.
On a deep model, where every pass is a full forward and backward, it is where trial time goes.

A trial whose steps trip the slow-step limit of timed steps (``max_step_s``, several times the FP32
step: :func:`autoprec.training.steps.slow_steps`, two in a row over it or one over 4x) is cut too,
from batch 0 on: timing would have stopped there, and before the k-th feasible trial exists the
speed rule has nothing to compare with (``tune --dtypes bf16`` on an AVX2 CPU: the autocast twin's
native bf16 steps took 9.2-9.8 s at 24 layers against a 1.71 s limit, four passes each, for each
of the first four trials).

The cut is asked after each drift batch but the last, and before a batch's loss-scale back-off
search (:func:`autoprec.measure.drift.measure_drift`: the overflowing pass is timed, the search
would cost more passes); a trial cut there has no drift for that batch (none at all on batch 0:
``grad_rel_l2`` inf, which the sampler sees as its drift objective).

A cut trial is recorded COMPLETE with what its passes measured (the sampler learns it is slow or
drifts), its constraint judged on the batches it ran (``DriftBudget.on_batches``), and
:data:`autoprec.search.attrs.CUT` saying why; it is never a finalist
(:func:`autoprec.search.finalist_pool.feasible`). A later trial of the same graph copies it while the cut,
asked then on the study as it is, stops its recorded passes again (the k-th fastest feasible trial
only gets faster as trials finish, so it mostly does); otherwise, e.g. in a study resumed with a
larger ``--finalists`` or a looser budget, it measures the graph again (``Objective``,
``objective.recorded``).

The same rung accepts too: a trial not cut whose drift on its first :data:`MIN_BATCHES` (or more)
batches is within the budget beyond noise (the upper one-sided 95% bound of the budget's own
statistic at most the budget, :meth:`DriftBudget.upper`: the mirror of the test that rejects)
stops its passes there, recorded COMPLETE with :data:`autoprec.search.attrs.ACCEPTED` saying why
and its constraint judged on those batches. The passes left could only have narrowed its speed,
and a finalist is measured again, on all K batches, as training runs it; the drift test, which
needs all K to reject a trial near the budget, gets them where the verdict is in doubt. On a
24-layer Qwen2 (AVX2 CPU, 20 trials) 8 of the 12 trials that had run all 4 passes had an upper
bound under the budget after 2: all-fp32 and the trials that lower a few regions. Tunes with the
rule accepted 8-13 of 20 trials early; their trials took 43-52 s against 57-60 s.
"""

from __future__ import annotations

from collections.abc import Callable

import optuna

from autoprec.applied.shape_cache import ordinal
from autoprec.measure import Measurement, Outcome
from autoprec.search import attrs
from autoprec.search.drift_budget import DriftBudget
from autoprec.search.finalist_pool import feasible
from autoprec.training.steps import slow_steps

__all__ = ["DRIFT_FACTOR", "MIN_BATCHES", "SPEED_MARGIN", "kth_feasible", "screening_cut", "summary"]

#: Drift batches a trial runs before the drift rule can cut it (the speed rule can after batch 0:
#: a pass of a 24-layer Qwen2 is half a second of one core, and a trial 1.3x slower than the k-th
#: learns nothing from a second one).
MIN_BATCHES = 2
#: The speed rule: cut when, on every drift batch it has timed, the trial's step took over
#: 1 / (1 - SPEED_MARGIN) times the k-th fastest feasible trial's step on that same batch (batches
#: of one model file may hold different token counts, so steps are compared batch for batch). One
#: eager pass of a 24-layer Qwen2 on a 2-core CPU varied by ±3-8% between the batches of one
#: trial; 0.15 leaves twice that, so the trials cut are those no later pass could have lifted
#: into the k fastest.
SPEED_MARGIN = 0.15
#: The drift rule: cut when the budget's own statistic on the batches so far, the geometric mean of
#: the trial's grad_rel_l2 over torch.autocast's batch for batch (``DriftBudget.ratio``; mean over
#: ``--max-drift`` for a fixed budget), exceeds this factor: the paired t-test at a 2% margin
#: over all K batches practically never passes such a trial.
DRIFT_FACTOR = 2.0


def kth_feasible(study: optuna.Study, k: int) -> optuna.trial.FrozenTrial | None:
    """The k-th fastest feasible, uncut trial of ``study`` by screening tokens/s (one per graph
    fingerprint: the finalists' own rule, :func:`autoprec.search.finalist_pool.feasible`), None while fewer
    than ``k`` are known."""
    ranked = feasible(study)
    return ranked[k - 1] if k >= 1 and len(ranked) >= k else None


def screening_cut(study: optuna.Study, k: int, budget: DriftBudget,
                  max_step_s: float | None = None) -> Callable[[Measurement], Outcome]:
    """The cut for the next trial of ``study``: a function of the measurement so far (its
    ``step_times``, seconds, one per drift batch 0, 1, ... run, when the device gives screening
    times) that returns its :class:`~autoprec.measure.outcome.Outcome`: cut (why), accepted (why), or
    go on; the slow-step limit and the speed rule from batch 0 on, the drift rule and early
    acceptance from :data:`MIN_BATCHES` batches on.

    The speed rule needs the k-th trial's screening step times (``autoprec:step_times``, batches
    0..K-1 in order); where they are missing (a device that times separate steps, CUDA) only the
    drift rule applies.

    Args:
        study: The study, read once now for the k-th fastest feasible trial (:func:`kth_feasible`).
        k: The finalists taken from the trials (``tune --finalists``).
        budget: The drift budget the trials are judged against.
        max_step_s: The slow-step limit in seconds (the module docstring; None: not applied).
    """
    kth = kth_feasible(study, k)
    ref = list(kth.user_attrs.get(attrs.STEP_TIMES) or []) if kth is not None else []

    def cut(m: Measurement) -> Outcome:
        n = len(m.grad_rel_l2_batches)
        judge = budget.on_batches(n)
        ratio = judge.ratio(m) if n >= MIN_BATCHES else 0.0
        if ratio > DRIFT_FACTOR:
            return Outcome.cut(f"grad_rel_l2 {ratio:.3g}x the drift budget on its first {n} batches "
                               f"(over {DRIFT_FACTOR:g}x)")
        timed = m.step_times
        if max_step_s is not None and (slow := slow_steps(timed, max_step_s)) is not None:
            return Outcome.cut(f"{slow.why} (the slow-step limit of timed steps)")
        both = min(len(timed), len(ref))  # the batches both timed (an accepted k-th timed fewer)
        if both and all(r is not None and r > 0 for r in ref[:both]):
            best = min(t / r for t, r in zip(timed[:both], ref, strict=False))  # its best batch vs the k-th's
            if best > 1 / (1 - SPEED_MARGIN):
                return Outcome.cut(f"{best:.2f}x the step time of trial {kth.number} (the {ordinal(k)} "
                                   f"fastest feasible) on its best timed batch, over "
                                   f"{1 / (1 - SPEED_MARGIN):.3g}x")
        # accepted: every batch measured (none left before a back-off) and its drift within the budget
        # beyond noise; more passes would only narrow its speed, which the finalists re-time
        if n >= MIN_BATCHES and len(m.pass_times) <= n and (upper := judge.upper(m)) <= 1.0:
            return Outcome.accepted(f"drift within the budget on its first {n} batches (95% upper bound "
                                    f"{upper:.2f}x the budget)")
        return Outcome.go_on()

    return cut


def summary(study: optuna.Study, k: int) -> str:
    """One log line: how many of the study's complete trials the cut stopped, after how many
    drift passes (none: "not run", ``Objective``'s ``cannot_win``), and how many of those before a
    loss-scale back-off search (``"screening cut: 9 of 20 complete trials (not run: 1; drift passes
    run after 1: 5, after 2: 2; 3 before a loss-scale back-off; 1 copied from a cut trial of the
    same graph), steps over 1.18x the 2nd fastest feasible trial's or drift over 2x the budget"``).
    A trial's passes are its timed drift batches (``autoprec:step_times``), or its measured ones
    (``autoprec:grad_rel_l2_batches``) where the device gives no screening times; one timed pass
    more than it measured is a batch whose
    gradients overflowed and whose back-off search the cut spared
    (:func:`autoprec.measure.drift.measure_drift`). A copy ran no passes and is counted apart.
    Trials accepted early (``autoprec:accepted``) end the line: ``"; 6 accepted early, their drift
    within the budget beyond noise after 2 passes"``."""
    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    cut = [t for t in done if attrs.CUT in t.user_attrs]
    after: dict[int, int] = {}
    early = 0
    copies = sum(attrs.REUSED_FROM in t.user_attrs for t in cut)
    for t in (t for t in cut if attrs.REUSED_FROM not in t.user_attrs):
        measured = len(t.user_attrs.get(attrs.GRAD_REL_L2_BATCHES) or [])
        timed = len(t.user_attrs.get(attrs.STEP_TIMES) or [])
        early += timed > measured
        after[max(timed, measured)] = after.get(max(timed, measured), 0) + 1
    not_run = after.pop(0, 0)  # cut before batch 0 (search/kernel_choice.trial_cannot_win)
    where = ", ".join(f"after {n}: {c}" for n, c in sorted(after.items()))
    parts = ([f"not run: {not_run}"] if not_run else []) + ([f"drift passes run {where}"] if where else [])
    spared = f"; {early} before a loss-scale back-off" if early else ""
    copied = f"; {copies} copied from a cut trial of the same graph" if copies else ""
    run = f" ({'; '.join(parts)}{spared}{copied})" if cut else ""
    accepted = [len(t.user_attrs.get(attrs.GRAD_REL_L2_BATCHES) or []) for t in done
                if attrs.ACCEPTED in t.user_attrs and attrs.REUSED_FROM not in t.user_attrs]
    passes = "/".join(str(n) for n in sorted(set(accepted)))
    early_ok = (f"; {len(accepted)} accepted early, their drift within the budget beyond noise after "
                f"{passes} passes" if accepted else "")
    return (f"screening cut: {len(cut)} of {len(done)} complete trials{run}, steps over "
            f"{1 / (1 - SPEED_MARGIN):.3g}x the {ordinal(k)} fastest feasible trial's or the slow-step "
            f"limit, or drift over {DRIFT_FACTOR:g}x the budget{early_ok}")
