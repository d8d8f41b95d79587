"""The screening cut: a trial's drift passes stop once it cannot become a finalist
(autoprec/search/screen_cut.py); the harness's ``cut`` and ``measure_drift``'s ``stop``."""

from __future__ import annotations

import math

import optuna
import pytest
import torch

from autoprec.measure import DRIFT_BATCHES, Harness, Measurement, Outcome, Stage
from autoprec.measure.drift import measure_drift
from autoprec.modelspec import load_model_spec
from autoprec.policy import Policy
from autoprec.search import attrs
from autoprec.search.drift_budget import DriftBudget
from autoprec.search.finalist_pool import feasible
from autoprec.search.objective import Objective
from autoprec.search.screen_cut import (
    MIN_BATCHES,
    SPEED_MARGIN,
    kth_feasible,
    screening_cut,
    summary,
)
from autoprec.search.space import SearchSpace
from autoprec.search.storage import open_study
from autoprec.training.train import make_scaler
from tests.conftest import MODELS

MODEL = str(MODELS / "c01_overflow.py")


@pytest.fixture(scope="module")
def harness():
    return Harness(load_model_spec(MODEL), torch.device("cpu"), warmup=1, steps=2)


def test_measure_drift_stops_where_stop_says_and_is_never_asked_after_the_last_batch():
    refs = [(1.0, [torch.ones(3)]) for _ in range(4)]
    asked = []

    def step(k, count):
        return 1.0, [torch.ones(3) * (1 + 0.01 * k)], 7 if count else 0

    def stop(d):
        asked.append(len(d.batches))
        return len(d.batches) == 2

    d = measure_drift(step, refs, None, stop=stop)
    assert d.stopped and len(d.batches) == 2 and asked == [1, 2] and d.saved_bytes == 7
    asked.clear()
    full = measure_drift(step, refs, None, stop=lambda d: asked.append(len(d.batches)) or False)
    assert not full.stopped and len(full.batches) == 4 and asked == [1, 2, 3]  # not after batch 3
    assert [b.grad_rel_l2 for b in d.batches] == [b.grad_rel_l2 for b in full.batches[:2]]


def test_harness_cut_runs_no_more_passes_and_keeps_what_the_first_measured(harness):
    gm = harness.graph_module
    from autoprec.passes import run_pipeline

    pol = Policy.default("bf16")
    low = run_pipeline(gm, pol).graph_module
    full = harness.measure(low, lambda: make_scaler(pol), screen=True)
    seen = []

    def cut(m):
        seen.append((len(m.grad_rel_l2_batches), list(m.step_times)))
        return Outcome.cut("enough") if len(m.grad_rel_l2_batches) == MIN_BATCHES else Outcome.go_on()

    part = harness.measure(low, lambda: make_scaler(pol), screen=True, cut=cut)
    assert full.cut is None and len(full.grad_rel_l2_batches) == DRIFT_BATCHES
    assert part.cut == "enough" and len(part.grad_rel_l2_batches) == MIN_BATCHES
    # the cut saw a screening measurement: each batch's pass plus the update, batch 0's from the first
    assert [n for n, _ in seen] == [1, 2] and len(seen[0][1]) == 1 and len(seen[1][1]) == 2
    assert seen[1][1][0] > part.pass_times[0] and seen[1][1][1] > part.pass_times[1]
    assert len(part.pass_times) == MIN_BATCHES and len(part.step_times) == 2 and part.tokens_per_s > 0
    # same weights, batches and RNG: the batches run are the full measurement's, bit for bit
    assert part.grad_rel_l2_batches == full.grad_rel_l2_batches[:MIN_BATCHES]
    assert part.peak_bytes == full.peak_bytes


def _m(grads, step_times=(0.1,)):
    return Measurement(grad_rel_l2_batches=list(grads), grad_rel_l2=sum(grads) / len(grads),
                       step_times=list(step_times))


def _near(n):
    """n drift values around a 1e-2 budget, 10% either side: within the drift rule, not within the
    budget beyond noise (no early acceptance), so only the speed and slow-step rules decide."""
    return [1e-2 * (0.9 if k % 2 == 0 else 1.1) for k in range(n)]


def _study_with(tokens_per_s, cut=(), infeasible=(), step_times=None):
    study = optuna.create_study(directions=["maximize", "minimize", "minimize"])
    for i, tps in enumerate(tokens_per_s):
        ua = {attrs.CONSTRAINT: 1.0 if i in infeasible else -1.0, attrs.FINGERPRINT: f"fp{i}",
              attrs.STEP_TIMES: (step_times or {}).get(i, [100.0 / tps] * 3)}
        if i in cut:
            ua[attrs.CUT] = "slow"
        study.add_trial(optuna.trial.create_trial(values=[tps, 1e-3, 1.0], user_attrs=ua))
    return study


def test_speed_rule_compares_steps_batch_for_batch_with_the_kth_fastest_feasible_uncut_trial():
    budget = DriftBudget.auto([1e-2] * 4)
    # batches of unequal tokens: trial 3's steps on drift batches 0, 1, 2 are 0.1, 0.3, 0.05 s
    kth = [0.1, 0.3, 0.05]
    # 2000 is cut (not counted), 1500 infeasible: the 2nd fastest feasible uncut trial is #3 (800)
    study = _study_with([1000, 2000, 1500, 800], cut=(1,), infeasible=(2,), step_times={3: kth})
    assert kth_feasible(study, 1).number == 0 and kth_feasible(study, 2).number == 3
    assert kth_feasible(study, 3) is None
    cut = screening_cut(study, 2, budget)
    limit = 1 / (1 - SPEED_MARGIN)
    slow = _m(_near(2), step_times=[0.1 * limit * 1.01])
    assert "the step time of trial 3 (the 2nd fastest feasible)" in cut(slow).reason
    assert cut(_m(_near(2), step_times=[0.1 * limit * 0.99])).going_on
    # batch 2 holds more tokens: its 0.33 s step is as fast as the k-th's 0.3 s, not 3.3x its batch 1
    assert cut(_m(_near(3), step_times=[0.1 * limit * 1.5, 0.33])).going_on
    assert not cut(_m(_near(3), step_times=[0.1 * limit * 1.5, 0.3 * limit * 1.1])).going_on
    # from batch 0 on, the first pass of both: a trial 1.3x slower learns nothing from a second
    assert "the step time of trial 3" in cut(_m([1e-3], step_times=[0.1 * limit * 1.01])).reason
    assert cut(_m([1e-3], step_times=[0.1 * limit * 0.99])).going_on
    assert screening_cut(study, 3, budget)(slow).going_on  # fewer than k feasible: no speed rule
    assert cut(_m(_near(2), step_times=[])).going_on  # no screening times (CUDA): no speed rule
    no_times = _study_with([1000, 800], step_times={1: []})
    assert screening_cut(no_times, 2, budget)(slow).going_on  # nor without the k-th's


def test_slow_step_limit_cuts_from_batch_0_before_any_kth_trial_exists():
    """The timed steps' slow-step limit (two in a row over it, or one over 4x) applies to screening
    steps from batch 0 on, even while fewer than k trials are feasible (no speed rule yet)."""
    budget = DriftBudget.auto([1e-2] * 4)
    study = _study_with([1000])  # one feasible trial: no 2nd fastest to compare with
    cut = screening_cut(study, 2, budget, max_step_s=1.0)
    why = cut(_m([1e-3], step_times=[9.2]))  # the autocast twin's native bf16 step on AVX2
    assert why == Outcome.cut("a step took 9.20 s, over 4 x the 1.00 s limit (the slow-step limit of timed "
                              "steps)")
    assert cut(_m([1e-3], step_times=[1.5])).going_on  # one step over the limit: noise, go on
    assert "2 steps in a row took over the 1.00 s limit" in cut(_m([1e-3] * 2, step_times=[1.5, 1.2])).reason
    assert cut(_m(_near(2), step_times=[1.5, 0.9])).going_on
    assert screening_cut(study, 2, budget)(_m([1e-3], step_times=[9.2])).going_on  # no limit given


def test_a_trial_within_the_budget_beyond_noise_is_accepted_after_min_batches():
    """Early acceptance: from MIN_BATCHES batches on, an uncut trial whose drift's upper 95% bound is
    within the budget stops its passes, accepted (not cut); in doubt, or with a batch left before a
    loss-scale back-off, it goes on; a cut rule that applies wins."""
    budget = DriftBudget.auto([1e-2] * 4)
    cut = screening_cut(_study_with([]), 2, budget)
    assert cut(_m([3e-3])).going_on  # one batch: no sd, no verdict
    why = cut(_m([3e-3, 3.3e-3]))
    assert why.stage is Stage.ACCEPTED
    assert why.reason.startswith("drift within the budget on its first 2 batches")
    assert cut(_m(_near(2))).going_on and cut(_m(_near(3))).going_on  # in doubt: all K batches decide
    pending = _m([3e-3, 3.3e-3])
    pending.pass_times = [0.1, 0.1, 0.1]  # batch 2 overflowed: its back-off search is next
    assert cut(pending).going_on
    # clearly slower than the k-th fastest: cut, however small its drift
    study = _study_with([1000, 900])
    assert screening_cut(study, 2, budget)(_m([3e-3, 3.3e-3], step_times=[0.5, 0.5])).stage is Stage.CUT
    fixed = screening_cut(_study_with([]), 2, DriftBudget.fixed(1e-2))
    assert fixed(_m([3e-3, 3.3e-3])).stage is Stage.ACCEPTED and fixed(_m([9e-3, 1.1e-2])).going_on


def test_speed_rule_against_an_accepted_kth_trial_compares_the_batches_both_timed():
    budget = DriftBudget.auto([1e-2] * 4)
    study = _study_with([1000, 800], step_times={1: [0.125, 0.125]})  # the 2nd, accepted after 2 passes
    cut = screening_cut(study, 2, budget)
    limit = 1 / (1 - SPEED_MARGIN)
    assert not cut(_m(_near(3), step_times=[0.125 * limit * 1.1, 0.125 * limit * 1.1, 0.01])).going_on
    assert cut(_m(_near(3), step_times=[0.125, 0.125 * limit * 1.1, 9.0])).going_on  # batch 0 as fast


def test_harness_stops_an_accepted_measurement_without_a_cut(harness):
    from autoprec.passes import run_pipeline

    pol = Policy.default("bf16")
    low = run_pipeline(harness.graph_module, pol).graph_module
    settle = lambda m: (Outcome.accepted("settled") if len(m.grad_rel_l2_batches) == MIN_BATCHES  # noqa: E731
                        else Outcome.go_on())
    m = harness.measure(low, lambda: make_scaler(pol), screen=True, cut=settle)
    assert m.accepted == "settled" and m.cut is None and m.error is None
    assert len(m.grad_rel_l2_batches) == MIN_BATCHES == len(m.step_times) and m.tokens_per_s > 0


def test_drift_rule_is_the_budgets_paired_ratio_on_the_same_batches():
    budget = DriftBudget.auto([1e-3, 1e-2, 1e-1, 1e-1])
    cut = screening_cut(_study_with([]), 2, budget)
    # the mean (1.2e-2) is over 2x the first two batches' mean (5.5e-3), but batch for batch the
    # ratios are 1 and 2.3 (geometric mean 1.52): the budget's rule could still pass it
    assert cut(_m([1e-3, 2.3e-2])).going_on
    assert budget.on_batches(2).ratio([1e-3, 2.3e-2]) == pytest.approx(math.sqrt(2.3))
    over = _m([2.1e-3, 2.1e-2])  # 2.1x on both
    assert "2.1x the drift budget on its first 2 batches (over 2x)" in cut(over).reason
    assert budget.on_batches(2).reference == (1e-3, 1e-2) and budget.on_batches(9) is budget
    fixed = screening_cut(_study_with([]), 2, DriftBudget.fixed(1e-2))
    assert not fixed(_m([0.03, 0.03])).going_on and fixed(_m([0.015, 0.015])).going_on
    assert DriftBudget.fixed(1e-2).on_batches(2) == DriftBudget.fixed(1e-2)
    assert not cut(_m([math.inf, 1.0])).going_on


def test_cut_trial_is_complete_marked_measured_in_part_and_never_a_finalist(tmp_path, harness):
    study = open_study(f"sqlite:///{tmp_path}/s.db", "cut", seed=0)
    space = SearchSpace(["bf16"])
    study.enqueue_trial({"matmul": "fp32", "sensitive": "fp32", "follow": "fp32"})
    study.enqueue_trial({"matmul": "bf16", "sensitive": "bf16", "follow": "bf16"})
    study.enqueue_trial({"matmul": "bf16", "sensitive": "bf16", "follow": "auto"})  # #1's graph too
    study.enqueue_trial({"matmul": "bf16", "sensitive": "bf16", "follow": "bf16"})  # #1's graph again
    # a budget bf16 cannot meet: the all-fp32 trial (drift 0) is accepted after 2 batches, within the
    # budget beyond noise, the bf16 ones are cut
    budget = DriftBudget.fixed(1e-5)
    study.optimize(Objective(harness, space, budget, max_step_s=60.0, finalists=2), n_trials=4)
    fp32, low, low2, again = study.trials
    assert attrs.CUT not in fp32.user_attrs and fp32.user_attrs[attrs.CONSTRAINT] <= 0
    assert fp32.user_attrs[attrs.ACCEPTED].startswith("drift within the budget on its first 2 batches")
    assert len(fp32.user_attrs[attrs.GRAD_REL_L2_BATCHES]) == MIN_BATCHES
    for t in (low, low2, again):
        assert t.state == optuna.trial.TrialState.COMPLETE
        assert "x the drift budget on its first 2 batches (over 2x)" in t.user_attrs[attrs.CUT]
        assert len(t.user_attrs[attrs.GRAD_REL_L2_BATCHES]) == MIN_BATCHES
        assert t.user_attrs[attrs.CONSTRAINT] > 0  # judged on the batches it ran: over the budget
    # the same graph as a cut trial, which the cut would stop again, is copied from it
    for t in (low2, again):
        assert t.user_attrs[attrs.FINGERPRINT] == low.user_attrs[attrs.FINGERPRINT]
        assert t.user_attrs[attrs.REUSED_FROM] == low.number and t.values == low.values
    assert [t.number for t in feasible(study)] == [0]
    line = summary(study, 2)
    assert line.startswith("screening cut: 3 of 4 complete trials (drift passes run after 2: 1;"
                           " 2 copied from a cut trial of the same graph), steps over 1.18x")
    assert line.endswith("; 1 accepted early, their drift within the budget beyond noise after 2 passes")
    # under a budget its recorded drift meets beyond noise, the cut accepts its recorded passes: a
    # copy, accepted, judged under that budget; the all-fp32 graph is copied, accepted too
    study.enqueue_trial({"matmul": "bf16", "sensitive": "bf16", "follow": "bf16"})
    study.enqueue_trial({"matmul": "fp32", "sensitive": "fp32", "follow": "fp32"})
    loosened = Objective(harness, space, DriftBudget.fixed(1.0), max_step_s=60.0, finalists=2)
    study.optimize(loosened, n_trials=2)
    loose, fp32_again = study.trials[-2:]
    assert loose.user_attrs[attrs.FINGERPRINT] == low.user_attrs[attrs.FINGERPRINT]
    assert loose.user_attrs[attrs.REUSED_FROM] == low.number and attrs.CUT not in loose.user_attrs
    assert attrs.ACCEPTED in loose.user_attrs and loose.user_attrs[attrs.CONSTRAINT] <= 0
    assert loose.user_attrs[attrs.GRAD_REL_L2_BATCHES] == low.user_attrs[attrs.GRAD_REL_L2_BATCHES]
    # under a budget its passes neither exceed by 2x nor meet beyond noise: measured again
    mid = 0.8 * float(sum(low.user_attrs[attrs.GRAD_REL_L2_BATCHES]) / MIN_BATCHES)  # 1.25x, not 2x
    study.enqueue_trial({"matmul": "bf16", "sensitive": "bf16", "follow": "bf16"})
    # finalists=10: there is no 10th fastest feasible trial, so the speed rule, which a bf16 step
    # on a CPU without native bf16 can trip (1.35x the fp32 trial's step in one CI run), stays out
    tight = Objective(harness, space, DriftBudget.fixed(mid), max_step_s=60.0, finalists=10)
    study.optimize(tight, n_trials=1)
    remeasured = study.trials[-1]
    assert attrs.REUSED_FROM not in remeasured.user_attrs and attrs.CUT not in remeasured.user_attrs
    assert len(remeasured.user_attrs[attrs.GRAD_REL_L2_BATCHES]) == DRIFT_BATCHES
    assert fp32_again.user_attrs[attrs.REUSED_FROM] == fp32.number and attrs.ACCEPTED in fp32_again.user_attrs
    assert {t.number for t in feasible(study)} == {0, loose.number}  # accepted: finalist candidates
    from autoprec.search.report import pareto_front, trial_rows

    rows = {r["number"]: r for r in trial_rows(study)}
    assert rows[1]["cut"] and not rows[1]["feasible"] and rows[0]["cut"] is None
    assert rows[0]["accepted"].startswith("drift within the budget") and rows[0]["feasible"]
    from autoprec.search.report import report_study

    md = next(p for p in report_study(study, tmp_path / "r") if p.suffix == ".md").read_text()
    assert "| accepted early: drift within the budget on its first 2 batches" in md
    assert rows[3]["cut"] and rows[3]["reused_from"] == 1 and not rows[3]["feasible"]
    # measured in part: off the front (trial 4, measured in full under a looser budget, is on it)
    assert 1 not in {r["number"] for r in pareto_front(list(rows.values()))}
    # without finalists (no cut) the same trial runs all its passes
    study2 = open_study(f"sqlite:///{tmp_path}/s.db", "nocut", seed=0)
    study2.enqueue_trial({"matmul": "bf16", "sensitive": "bf16", "follow": "bf16"})
    study2.optimize(Objective(harness, space, budget, max_step_s=60.0), n_trials=1)
    t = study2.trials[0]
    assert attrs.CUT not in t.user_attrs and len(t.user_attrs[attrs.GRAD_REL_L2_BATCHES]) == DRIFT_BATCHES
    assert t.user_attrs[attrs.GRAD_REL_L2_BATCHES][:MIN_BATCHES] == low.user_attrs[attrs.GRAD_REL_L2_BATCHES]


def test_a_cut_trials_constraint_is_judged_on_the_batches_it_ran():
    """Against all K of torch.autocast's batches (the K = 1 rule on means) a trial cut on batches
    that autocast found easy would look feasible; on the same batches it is not."""
    from autoprec.search.objective import _record

    budget = DriftBudget.auto([1e-3, 1e-3, 1e-1, 1e-1])
    m = _m([3e-3, 3e-3])
    m.outcome = Outcome.cut("drift")
    assert budget.excess(m) < 0 < budget.on_batches(2).excess(m)
    study = optuna.create_study(directions=["maximize", "minimize", "minimize"])
    trial = study.ask()
    _record(trial, m, budget)
    assert trial.user_attrs[attrs.CONSTRAINT] > 0 and trial.user_attrs[attrs.CUT] == "drift"


def test_a_trial_cut_for_speed_before_its_loss_scale_back_off_runs_one_pass(tmp_path):
    """An fp16 trial whose batch-0 gradients overflow at the initial loss scale is shown to the cut
    with that pass timed, before the back-off search; cut there, it ran one pass, its drift is not
    measured (inf, no error), and the study's summary counts it."""
    from autoprec.passes import run_pipeline
    from autoprec.policy import Rule
    from autoprec.search.objective import _record
    from tests.measure.test_drift_backoff import MODEL as OVERFLOW  # fp16 gradients overflow at 2^16

    f = tmp_path / "m.py"
    f.write_text(OVERFLOW)
    h = Harness(load_model_spec(f), torch.device("cpu"), warmup=0, steps=1)
    pol = Policy(default_dtype="fp32", rules=(Rule(op_class="follow", dtype="fp16", compute="fp32"),))
    gm = run_pipeline(h.graph_module, pol).graph_module
    passes = []
    gm.register_forward_pre_hook(lambda *_: passes.append(1))
    full = h.measure(gm, lambda: make_scaler(pol), screen=True)
    assert full.error is None and "loss-scale backoff" in full.note and len(passes) > DRIFT_BATCHES + 1
    seen = []

    def cut(m):
        seen.append((len(m.grad_rel_l2_batches), list(m.step_times), m.error))
        return Outcome.cut("slow") if m.step_times else Outcome.go_on()

    passes.clear()
    m = h.measure(gm, lambda: make_scaler(pol), screen=True, cut=cut)
    assert len(passes) == 1 and seen == [(0, m.step_times, None)] and len(m.step_times) == 1
    assert m.cut == "slow" and m.error is None and math.isinf(m.grad_rel_l2) and m.tokens_per_s > 0
    assert "drift is not measured" in m.note and m.peak_bytes == full.peak_bytes
    study = optuna.create_study(directions=["maximize", "minimize", "minimize"])
    trial = study.ask()
    _record(trial, m, DriftBudget.fixed(1e-2))
    assert trial.user_attrs[attrs.GRAD_REL_L2] is None and trial.user_attrs[attrs.CONSTRAINT] > 0
    study.tell(trial, [m.tokens_per_s, m.grad_rel_l2, float(m.peak_bytes)])
    assert study.trials[0].state == optuna.trial.TrialState.COMPLETE
    assert "(drift passes run after 1: 1; 1 before a loss-scale back-off)" in summary(study, 2)


def test_recorded_reads_back_what_record_stored_non_finite_drift_as_inf():
    """The cut of a later trial of the same graph is asked on the recorded measurement."""
    from autoprec.search.objective import _record, recorded

    budget = DriftBudget.fixed(1e-2)
    m = _m([3e-3, math.inf], step_times=[0.2, 0.3])
    m.outcome, m.tokens_per_s, m.step_s = Outcome.cut("slow"), 1234.0, 0.25
    study = optuna.create_study(directions=["maximize", "minimize", "minimize"])
    trial = study.ask()
    _record(trial, m, budget)
    back = recorded(trial)
    assert back.grad_rel_l2_batches == [3e-3, math.inf] and back.grad_rel_l2 == math.inf
    assert back.step_times == [0.2, 0.3] and back.tokens_per_s == 1234.0 and back.cut == "slow"
    assert budget.on_batches(2).excess(back) == budget.on_batches(2).excess(m) == attrs.INFEASIBLE
