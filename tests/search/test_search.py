"""Search: failed candidates, reuse of equal graphs, SIGKILL resume, two workers on one study."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import optuna
import pytest
import torch

from autoprec.measure import DRIFT_BATCHES, Harness
from autoprec.modelspec import load_model_spec
from autoprec.policy import Policy
from autoprec.search.attrs import ATTR
from autoprec.search.drift_budget import DriftBudget
from autoprec.search.objective import Objective
from autoprec.search.space import SearchSpace, find_blocks, outside_matmuls
from autoprec.search.storage import open_study
from tests.conftest import MODELS

OVERFLOW_MODEL = str(MODELS / "c01_overflow.py")


@pytest.fixture
def overflow_spec():
    return load_model_spec(OVERFLOW_MODEL)


_BUDGET = DriftBudget.fixed(1.0)


def _run(study, spec, lows, n, budget=_BUDGET):
    h = Harness(spec, torch.device("cpu"), warmup=1, steps=2)
    blocks = find_blocks(h.graph_module)
    space = SearchSpace(lows, blocks, outside_matmuls(h.graph_module, blocks))
    for _name, params in space.baselines():
        study.enqueue_trial(params)
    study.optimize(Objective(h, space, budget, max_step_s=60.0), n_trials=n, catch=(Exception,))
    return study


def test_nan_candidate_recorded_failed_and_study_continues(tmp_path, overflow_spec):
    study = open_study(f"sqlite:///{tmp_path}/s.db", "nan", seed=0)
    _run(study, overflow_spec, ["fp16"], n=5)
    states = {t.number: t.state for t in study.trials}
    assert len(states) == 5
    # Baseline 0 is all fp32: finite, completes. The all-fp16 baseline overflows (C01): FAIL.
    assert states[0] == optuna.trial.TrialState.COMPLETE
    # a screened trial (eager, CPU) is timed on its K drift passes, no step of its own
    assert len(study.trials[0].user_attrs[ATTR + "step_times"]) == DRIFT_BATCHES
    all_low = study.trials[4]  # after fp32, the autocast twin, autocast-equivalent, low-except-sensitive
    assert {k: all_low.params[k] for k in ("matmul", "sensitive", "follow")} == {
        "matmul": "fp16", "sensitive": "fp16", "follow": "fp16"}
    assert all_low.state == optuna.trial.TrialState.FAIL
    # C01: the trial names the node whose output first went non-finite, the fp16 projection
    assert all_low.user_attrs[ATTR + "error"].startswith("non-finite loss (drift batch 0)")
    assert all_low.user_attrs[ATTR + "error"].endswith(  # and the model's line that made it
        f"; first non-finite output: node up/linear#0 (from {OVERFLOW_MODEL}:18 (forward): "
        "h = self.up(x) + x[:, :1])")
    # Never exported: no failed trial counts as feasible.
    from autoprec.search.finalist_pool import feasible as _feasible

    feasible = {t.number: t for t in _feasible(study)}
    assert 0 in feasible and all_low.number not in feasible  # all-fp32 is within any budget; C01 is not
    assert all(t.values[1] <= 1.0 for t in feasible.values())  # the budget _run searched with


def test_equal_graphs_are_measured_once(tmp_path, overflow_spec):
    study = open_study(f"sqlite:///{tmp_path}/s.db", "dedup", seed=0)
    h = Harness(overflow_spec, torch.device("cpu"), warmup=1, steps=2)
    space = SearchSpace(["bf16"])
    # 'follow' explicitly fp32 and 'auto' give the same graph when nothing is lowered.
    study.enqueue_trial({"matmul": "fp32", "sensitive": "fp32", "follow": "fp32"})
    study.enqueue_trial({"matmul": "fp32", "sensitive": "fp32", "follow": "auto"})
    study.optimize(Objective(h, space, DriftBudget.fixed(1.0), max_step_s=60.0), n_trials=2)
    a, b = study.trials
    assert a.user_attrs[ATTR + "fingerprint"] == b.user_attrs[ATTR + "fingerprint"]
    assert ATTR + "reused_from" not in a.user_attrs
    assert b.user_attrs[ATTR + "reused_from"] == 0 and b.values == a.values


def _tune_cmd(model, out, trials, extra=()):
    return [sys.executable, "-m", "autoprec.cli", "tune", str(model), "--out", str(out), "--trials",
            str(trials), "--no-compile", "--dtypes", "bf16", "--traj-steps", "0", *extra]


def _finished(db, name):
    try:
        s = optuna.load_study(study_name=name, storage=f"sqlite:///{db}")
    except KeyError:
        return []
    return [t for t in s.trials if t.state.is_finished()]


def _study_name(db):
    names = [s.study_name for s in optuna.get_all_study_summaries(f"sqlite:///{db}")]
    return names[0] if names else None


@pytest.mark.heavy
def test_sigkill_resume_keeps_finished_trials(tmp_path):
    model = str(MODELS / "micro_lm.py")
    out = tmp_path / "p.json"
    db = tmp_path / "p.optuna.db"
    proc = subprocess.Popen(_tune_cmd(model, out, 12), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    done = []
    while time.time() < deadline and proc.poll() is None:
        try:
            name = _study_name(db) if db.exists() else None
            done = _finished(db, name) if name else []
        except Exception:  # noqa: BLE001 - the tune process may still be creating the schema
            done = []
        if len(done) >= 3:
            break
        time.sleep(0.3)
    assert proc.poll() is None, "tune finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    name = _study_name(db)
    before = {t.number: (t.state, t.values) for t in _finished(db, name)}
    assert len(before) >= 3
    assert not out.exists()  # killed before the end: no half-written policy
    r = subprocess.run(_tune_cmd(model, out, 12), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    after = {t.number: (t.state, t.values) for t in _finished(db, name)}
    for num, val in before.items():
        assert after[num] == val  # kept, not re-run
    # the trial the kill cut short is marked and re-run, not counted towards --trials 12
    counted = [t for t in _finished(db, name) if not t.user_attrs.get(ATTR + "interrupted")]
    assert len(counted) == 12 and len(after) - len(counted) <= 1
    assert Policy.load(out).measured["tokens_per_s"] > 0


@pytest.mark.heavy
def test_a_study_of_another_model_is_refused_before_any_measurement(tmp_path):
    """The same --storage and --study-name for another model: its trials measured another graph,
    so the tune stops (exit 2) naming both model files, before its baselines, writing nothing and
    leaving the study as it was."""
    storage = f"sqlite:///{tmp_path}/shared.db"
    extra = ("--storage", storage, "--study-name", "mine")
    first = MODELS / "micro_lm.py"
    r = subprocess.run(_tune_cmd(first, tmp_path / "a.json", 2, extra), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "\r" not in r.stderr and "step/s" not in r.stderr  # no progress bars into a pipe or file
    before = optuna.load_study(study_name="mine", storage=storage)
    assert before.user_attrs[ATTR + "graph"]["model"] == str(first)
    other = MODELS / "varlen_lm.py"
    r = subprocess.run(_tune_cmd(other, tmp_path / "b.json", 2, extra), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"study 'mine' in {storage} holds trials of {first}" in r.stderr
    assert f"this run's {other} captures another graph" in r.stderr and "--study-name" in r.stderr
    assert "fp32 eager" not in r.stderr  # refused before the baselines
    assert not (tmp_path / "b.json").exists()
    after = optuna.load_study(study_name="mine", storage=storage)
    assert len(after.trials) == len(before.trials) and after.user_attrs == before.user_attrs


@pytest.mark.heavy
def test_two_workers_share_one_study(tmp_path):
    model = str(MODELS / "micro_lm.py")
    storage = f"sqlite:///{tmp_path}/shared.db"
    extra = ("--storage", storage, "--study-name", "shared")
    procs = [subprocess.Popen(_tune_cmd(model, tmp_path / f"p{i}.json", 10, extra), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    for p in procs:
        _out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
    study = optuna.load_study(study_name="shared", storage=storage)
    finished = [t for t in study.trials if t.state.is_finished()]
    assert len(finished) >= 10
    # measured in full once; a graph the screening cut stopped is measured again only where the
    # cut, asked again, would not stop it (tests/search/test_screen_cut.py)
    measured = [t for t in finished if not {ATTR + "reused_from", ATTR + "cut"} & set(t.user_attrs)]
    fps = [t.user_attrs.get(ATTR + "fingerprint") for t in measured]
    assert len(fps) == len(set(fps)), "a graph was measured twice"
    # Each worker re-measures its pick beside all-fp32, so the two may differ within noise; both
    # must be feasible, and a lowered pick must come from the study they share.
    def form(d):
        return json.dumps({k: v for k, v in d.items() if k not in ("measured", "provenance")}, sort_keys=True)

    feasible = {form(t.user_attrs[ATTR + "policy"]) for t in finished if t.user_attrs.get(ATTR + "constraint",
                                                                                          1.0) <= 0}
    for p in (tmp_path / "p0.json", tmp_path / "p1.json"):
        pol = Policy.load(p)
        # feasible by the drift rule (search/drift_budget.py: a paired test against torch.autocast, so the
        # mean grad_rel_l2 may be a little above the budget's value, torch.autocast's mean)
        assert pol.dtypes_used() == {"fp32"} or form(pol.to_dict()) in feasible


def test_region_sensitivity_ranks_the_overflowing_matmul_first(overflow_spec):
    from autoprec.search.trials import region_sensitivity

    h = Harness(overflow_spec, torch.device("cpu"), warmup=1, steps=2)
    blocks = find_blocks(h.graph_module)
    space = SearchSpace(["fp16"], blocks, outside_matmuls(h.graph_module, blocks))
    sens = region_sensitivity(h, space)
    assert set(sens) == {"node:up/linear#0", "node:out/linear#0"}
    # Lowering `up` alone overflows fp16 (C01): non-finite drift, ranked most sensitive.
    assert sens["node:up/linear#0"] == 1e30
    assert sens["node:out/linear#0"] < 1e-2
    # the mean over the first SENSITIVITY_BATCHES drift batches of that region's lowering, no more
    from autoprec.passes import run_pipeline
    from autoprec.search.trials import SENSITIVITY_BATCHES
    from autoprec.training.train import make_scaler

    base = {"matmul": "fp32", "sensitive": "fp32", "follow": "auto", "node:up/linear#0": "inherit"}
    pol = space.to_policy(base | {"node:out/linear#0": "fp16"})
    full = h.drift(run_pipeline(h.graph_module, pol).graph_module, make_scaler(pol))
    assert SENSITIVITY_BATCHES < len(full.grad_rel_l2_batches)
    first = full.grad_rel_l2_batches[:SENSITIVITY_BATCHES]
    assert sens["node:out/linear#0"] == pytest.approx(sum(first) / len(first), rel=1e-12)
    assert region_sensitivity(h, SearchSpace([])) == {}


@pytest.mark.slow  # two tunes (15 s)
def test_study_of_another_measurement_version_is_not_resumed(tmp_path):
    """Trials measured by an older autoprec (no measurement-version stamp) are not mixed with
    new ones: naming that study is refused and leaves it as it was; the default study name
    carries the version, so the same command without --study-name starts a new study beside it."""
    model = str(MODELS / "micro_lm.py")
    out, db = tmp_path / "p.json", tmp_path / "p.optuna.db"
    storage = f"sqlite:///{db}"
    old = open_study(storage, "old")
    old.enqueue_trial({})
    t = old.ask()
    old.tell(t, [1.0, 0.0, 0.0])
    r = subprocess.run(_tune_cmd(model, out, 2, ("--study-name", "old")), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode != 0 and not out.exists()
    assert "study 'old'" in r.stderr and "measurement version 1, this one 3" in r.stderr, r.stderr[-2000:]
    assert len(optuna.load_study(study_name="old", storage=storage).trials) == 1
    r = subprocess.run(_tune_cmd(model, out, 2), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    new = Policy.load(out).provenance["study"]
    assert new.endswith("-m3") and len(optuna.load_study(study_name="old", storage=storage).trials) == 1
    assert optuna.load_study(study_name=new, storage=storage).user_attrs[ATTR + "measure_version"] == 3


def test_a_running_trial_that_names_no_worker_is_orphaned_after_a_minute():
    """A worker killed between Optuna creating its trial and the objective naming the worker
    leaves a RUNNING trial nobody could identify; a resumed tune must not wait 900 s for it."""
    import datetime

    from autoprec.search.workers import ORPHAN_AFTER_S, is_dead_worker

    def running(age_s: float, **user_attrs) -> optuna.trial.FrozenTrial:
        return optuna.trial.FrozenTrial(
            number=0, state=optuna.trial.TrialState.RUNNING, value=None,
            datetime_start=datetime.datetime.now() - datetime.timedelta(seconds=age_s),
            datetime_complete=None, params={}, distributions={}, user_attrs=user_attrs, system_attrs={},
            intermediate_values={}, trial_id=0)

    assert is_dead_worker(running(ORPHAN_AFTER_S + 5))
    assert not is_dead_worker(running(1.0))  # just created: its objective names the worker next
    import socket

    from autoprec.search.attrs import WORKER

    alive = {WORKER: f"{socket.gethostname()}:{os.getpid()}"}
    assert not is_dead_worker(running(ORPHAN_AFTER_S + 5, **alive))
