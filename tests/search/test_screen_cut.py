"""The screening cut: a trial's drift passes stop once it cannot become a finalist
(autoprec/search/screen_cut.py); the harness's ``cut`` and ``measure_drift``'s ``stop``."""

from __future__ import annotations

import math

import optuna
import pytest
import torch

from autoprec.measure import DRIFT_BATCHES, Harness, Measurement
from autoprec.measure.drift import measure_drift
from autoprec.modelspec import load_model_spec
from autoprec.policy import Policy
from autoprec.search import attrs
from autoprec.search.decide import DriftBudget
from autoprec.search.objective import Objective
from autoprec.search.pool import feasible
from autoprec.search.screen_cut import (
    DRIFT_FACTOR,
    MIN_BATCHES,
    SPEED_MARGIN,
    finalist_floor,
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
        return "enough" if len(m.grad_rel_l2_batches) == MIN_BATCHES else None

    part = harness.measure(low, lambda: make_scaler(pol), screen=True, cut=cut)
    assert full.cut is None and len(full.grad_rel_l2_batches) == DRIFT_BATCHES
    assert part.cut == "enough" and len(part.grad_rel_l2_batches) == MIN_BATCHES
    # the cut saw a screening measurement: batch 0 untimed, batch 1's pass plus the update
    assert seen[0] == (1, []) and len(seen[1][1]) == 1 and seen[1][1][0] > part.pass_times[1]
    assert len(part.pass_times) == MIN_BATCHES and len(part.step_times) == 1 and part.tokens_per_s > 0
    # same weights, batches and RNG: the batches run are the full measurement's, bit for bit
    assert part.grad_rel_l2_batches == full.grad_rel_l2_batches[:MIN_BATCHES]
    assert part.peak_bytes == full.peak_bytes


def _m(grads, step_times=(0.1,), tokens_per_step=100.0):
    m = Measurement(grad_rel_l2_batches=list(grads), grad_rel_l2=sum(grads) / len(grads),
                    step_times=list(step_times))
    if step_times:
        m.step_s = sorted(step_times)[len(step_times) // 2]
        m.tokens_per_s = tokens_per_step / m.step_s
    return m


def _study_with(tokens_per_s, cut=(), infeasible=()):
    study = optuna.create_study(directions=["maximize", "minimize", "minimize"])
    for i, tps in enumerate(tokens_per_s):
        ua = {attrs.CONSTRAINT: 1.0 if i in infeasible else -1.0, attrs.FINGERPRINT: f"fp{i}"}
        if i in cut:
            ua[attrs.CUT] = "slow"
        study.add_trial(optuna.trial.create_trial(values=[tps, 1e-3, 1.0], user_attrs=ua))
    return study


def test_speed_rule_cuts_below_the_margin_under_the_kth_fastest_feasible_uncut_trial():
    budget = DriftBudget.auto([1e-2] * 4)
    # 2000 is cut (not counted), 1500 infeasible: the 2nd fastest feasible uncut trial is 800
    study = _study_with([1000, 2000, 1500, 800], cut=(1,), infeasible=(2,))
    assert finalist_floor(study, 1) == 1000 and finalist_floor(study, 2) == 800
    assert finalist_floor(study, 3) is None
    cut = screening_cut(study, 2, budget)
    floor = 800 * (1 - SPEED_MARGIN)
    slow = _m([1e-3, 1e-3], step_times=[100.0 / (floor * 0.99)])
    assert "under 0.85x the 2nd fastest feasible trial's 800" in cut(slow)
    assert cut(_m([1e-3, 1e-3], step_times=[100.0 / (floor * 1.01)])) is None
    # its fastest pass counts, not the median: one slow pass does not cut it
    assert cut(_m([1e-3] * 3, step_times=[100.0 / (floor * 1.05), 100.0 / (floor * 0.5)])) is None
    assert cut(_m([1e-3], step_times=[1e9])) is None  # before MIN_BATCHES nothing is cut
    assert screening_cut(study, 3, budget)(slow) is None  # fewer than k feasible: no speed rule


def test_drift_rule_compares_the_same_batches_of_the_budget():
    budget = DriftBudget.auto([1e-3, 3e-3, 1e-1, 1e-1])  # the first two batches' mean is 2e-3
    cut = screening_cut(_study_with([]), 2, budget)
    over = _m([DRIFT_FACTOR * 2e-3 * 1.1] * 2)
    assert "over 2x the budget on them (0.002)" in cut(over)
    assert cut(_m([DRIFT_FACTOR * 2e-3 * 0.9] * 2)) is None
    fixed = screening_cut(_study_with([]), 2, DriftBudget.fixed(1e-2))
    assert fixed(_m([0.03, 0.03])) is not None and fixed(_m([0.015, 0.015])) is None
    assert cut(_m([math.inf, 1.0])) is not None


def test_cut_trial_is_complete_marked_measured_in_part_and_never_a_finalist(tmp_path, harness):
    study = open_study(f"sqlite:///{tmp_path}/s.db", "cut", seed=0)
    space = SearchSpace(["bf16"])
    study.enqueue_trial({"matmul": "fp32", "sensitive": "fp32", "follow": "fp32"})
    study.enqueue_trial({"matmul": "bf16", "sensitive": "bf16", "follow": "bf16"})
    study.enqueue_trial({"matmul": "bf16", "sensitive": "bf16", "follow": "auto"})
    # a budget bf16 cannot meet: the all-fp32 trial (drift ~1e-7) runs in full, the bf16 ones are cut
    study.optimize(Objective(harness, space, DriftBudget.fixed(1e-5), max_step_s=60.0, finalists=2),
                   n_trials=3)
    fp32, low, low2 = study.trials
    assert attrs.CUT not in fp32.user_attrs
    assert len(fp32.user_attrs[attrs.GRAD_REL_L2_BATCHES]) == DRIFT_BATCHES
    for t in (low, low2):
        assert t.state == optuna.trial.TrialState.COMPLETE
        assert "over 2x the budget" in t.user_attrs[attrs.CUT]
        assert len(t.user_attrs[attrs.GRAD_REL_L2_BATCHES]) == MIN_BATCHES
    assert [t.number for t in feasible(study)] == [0]
    assert summary(study, 2).startswith("screening cut: 2 of 3 complete trials (drift batches run "
                                        "after 2: 2), slower than 0.85x the 2nd fastest feasible one")
    from autoprec.search.report import trial_rows

    rows = {r["number"]: r for r in trial_rows(study)}
    assert rows[1]["cut"] and not rows[1]["feasible"] and rows[0]["cut"] is None
    # without finalists (no cut) the same trial runs all its passes
    study2 = open_study(f"sqlite:///{tmp_path}/s.db", "nocut", seed=0)
    study2.enqueue_trial({"matmul": "bf16", "sensitive": "bf16", "follow": "bf16"})
    study2.optimize(Objective(harness, space, DriftBudget.fixed(1e-5), max_step_s=60.0), n_trials=1)
    t = study2.trials[0]
    assert attrs.CUT not in t.user_attrs and len(t.user_attrs[attrs.GRAD_REL_L2_BATCHES]) == DRIFT_BATCHES
    assert t.user_attrs[attrs.GRAD_REL_L2_BATCHES][:MIN_BATCHES] == low.user_attrs[attrs.GRAD_REL_L2_BATCHES]
