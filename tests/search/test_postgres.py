"""Tuning workers sharing one study on a PostgreSQL server (docs/architecture.md#search): two
``autoprec tune`` processes measure no per-node dtype assignment twice and both write a policy; a
worker SIGKILLed mid-trial loses no finished trial and its running trial is re-run, whether the
dead worker ran on this host (its pid is gone) or on another machine (its heartbeat stopped).

The server is the one ``.ci/run`` starts (``bash .ci/postgres.sh start`` prints a URL for a local
run): ``AUTOPREC_TEST_POSTGRES_URL=postgresql+psycopg://...``. Without it these tests are skipped,
except under CI (``$CI`` set), where a missing server is a failure.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import optuna
import pytest

from autoprec.policy import Policy
from autoprec.search.attrs import (
    CONSTRAINT,
    CUT,
    ERROR,
    FINGERPRINT,
    INTERRUPTED,
    POLICY,
    REUSED_FROM,
    WORKER,
)
from tests.conftest import MODELS

URL = os.environ.get("AUTOPREC_TEST_POSTGRES_URL")
MODEL = MODELS / "micro_lm.py"
#: Heartbeats every second (grace: 6 s) so a silent worker's trial is given up within the test.
ENV = {**os.environ, "AUTOPREC_HEARTBEAT_S": "1"}
TIMEOUT_S = 300

needs_server = pytest.mark.skipif(not URL and not os.environ.get("CI"),
                                  reason="no PostgreSQL server: AUTOPREC_TEST_POSTGRES_URL is not set "
                                         "(bash .ci/postgres.sh start prints one)")


@functools.cache
def _db() -> optuna.storages.RDBStorage:
    """One storage (one connection pool) for the test process: a storage per poll would open a
    connection each and exhaust the server's ``max_connections``."""
    return optuna.storages.RDBStorage(URL)


@pytest.fixture(scope="module", autouse=True)
def _close_db():
    yield
    if _db.cache_info().currsize:
        _db().engine.dispose()
        _db.cache_clear()


@pytest.fixture
def study_name():
    """A study of its own per test, deleted afterwards."""
    assert URL, "CI is set but AUTOPREC_TEST_POSTGRES_URL is not: .ci/run starts the server and sets it"
    name = f"pg-test-{uuid.uuid4().hex[:12]}"
    yield name
    try:
        optuna.delete_study(study_name=name, storage=_db())
    except KeyError:
        pass


def _tune_cmd(out: Path, name: str, trials: int) -> list[str]:
    return [sys.executable, "-m", "autoprec.cli", "tune", str(MODEL), "--out", str(out), "--trials",
            str(trials), "--no-compile", "--dtypes", "bf16", "--traj-steps", "0", "--storage", URL,
            "--study-name", name]


def _trials(name: str) -> list[optuna.trial.FrozenTrial]:
    try:
        return optuna.load_study(study_name=name, storage=_db()).trials
    except KeyError:  # not created yet
        return []


def _retried(trials) -> set[int]:
    return {n for t in trials for n in t.system_attrs.get("retry_history", [])}


def _counted(trials) -> list[optuna.trial.FrozenTrial]:
    """Finished trials that count towards --trials (autoprec.search.trials.finished's rule)."""
    retried = _retried(trials)
    return [t for t in trials if t.state.is_finished() and not t.user_attrs.get(INTERRUPTED)
            and t.number not in retried]


def _assert_measured_once(trials) -> None:
    """Every assignment measured in full once: a finished trial that measured all its passes (not one
    the screening cut stopped, nor a copy). A graph whose first trial was cut is measured again by a
    later trial when the cut, asked on the study as it is then, no longer stops its recorded passes
    (autoprec.search.objective; the rule of test_search.py's SQLite workers): its one full measurement."""
    measured = [t for t in trials if REUSED_FROM not in t.user_attrs and CUT not in t.user_attrs and (
        t.state == optuna.trial.TrialState.COMPLETE
        or (t.state == optuna.trial.TrialState.FAIL and ERROR in t.user_attrs))]
    fps = [t.user_attrs.get(FINGERPRINT) for t in measured]
    assert len(fps) == len(set(fps)), f"an assignment was measured twice: {sorted(fps, key=str)}"


def _kill_mid_trial(proc: subprocess.Popen, name: str, min_done: int) -> optuna.trial.FrozenTrial:
    """SIGKILL ``proc`` while one of its trials runs, once the study holds ``min_done`` finished
    trials; the trial it was running.

    The worker is frozen (SIGSTOP) during every look at the study, so the trial seen RUNNING is the
    one the kill cuts short, and it runs only between looks: 50 ms before ``min_done``, 2 ms from
    then on. A micro model's trial takes about 0.1 s, and a look (loading the study from the
    server) can take longer on a loaded machine: a worker left running during the looks finished
    all its trials unseen (CI runs, and 2 of 22 local runs with the 2 ms pause alone)."""
    deadline = time.time() + TIMEOUT_S
    while time.time() < deadline:
        assert proc.poll() is None, "the worker finished before it could be killed"
        os.kill(proc.pid, signal.SIGSTOP)
        trials = _trials(name)
        ready = len([t for t in trials if t.state.is_finished()]) >= min_done
        mine = [t for t in trials if t.state == optuna.trial.TrialState.RUNNING
                and t.user_attrs.get(WORKER, "").endswith(f":{proc.pid}")]
        if ready and mine:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
            return mine[0]
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.002 if ready else 0.05)
    raise AssertionError(f"no running trial of worker {proc.pid} to kill within {TIMEOUT_S}s")


def _assert_rerun(name: str, killed: optuna.trial.FrozenTrial, before: dict, target: int) -> list:
    """The study after the killed worker's trial was given up: finished trials kept as they were,
    the killed one FAIL and re-run with its parameters by a retry, ``target`` (+1) trials counted."""
    trials = _trials(name)
    by_number = {t.number: t for t in trials}
    for num, (state, values) in before.items():
        assert (by_number[num].state, by_number[num].values) == (state, values)  # kept, not re-run
    assert by_number[killed.number].state == optuna.trial.TrialState.FAIL
    retries = [t for t in trials if killed.number in t.system_attrs.get("retry_history", [])]
    assert retries and retries[0].state.is_finished(), [(t.number, t.state) for t in retries]
    # the retry runs the parameters the killed trial had drawn (a trial killed while drawing them
    # draws the rest afresh)
    killed_params = by_number[killed.number].params
    assert {k: retries[0].params.get(k) for k in killed_params} == killed_params
    # A retry queued once the others already held `target` is run too (as the dead worker would
    # have finished its trial), so one more may count.
    assert target <= len(_counted(trials)) <= target + 1
    _assert_measured_once(trials)
    return trials


@pytest.mark.heavy
@needs_server
def test_two_workers_measure_each_assignment_once(tmp_path, study_name):
    outs = [tmp_path / f"p{i}.json" for i in range(2)]
    procs = [subprocess.Popen(_tune_cmd(out, study_name, 10), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=ENV) for out in outs]
    try:
        for p in procs:
            _out, err = p.communicate(timeout=TIMEOUT_S)
            assert p.returncode == 0, err[-3000:]
    finally:
        for p in procs:
            p.kill()
    trials = _trials(study_name)
    assert len(_counted(trials)) >= 10
    _assert_measured_once(trials)

    def form(d):
        return json.dumps({k: v for k, v in d.items() if k not in ("measured", "provenance")}, sort_keys=True)

    # Each worker selects from the shared study and writes its own policy file.
    feasible = {form(t.user_attrs[POLICY]) for t in trials if t.user_attrs.get(CONSTRAINT, 1.0) <= 0}
    for out in outs:
        pol = Policy.load(out)
        assert pol.provenance["study"] == study_name
        # feasible by the drift rule (search/drift_budget.py), not grad_rel_l2 <= the mean: as test_search
        assert pol.dtypes_used() == {"fp32"} or form(pol.to_dict()) in feasible


@pytest.mark.heavy
@needs_server
def test_sigkilled_worker_trial_is_rerun_by_the_next(tmp_path, study_name):
    """A worker of this host killed mid-trial: the next worker finds its pid gone, fails the
    trial (interrupted) and runs it again first (default heartbeats: the pid rule comes first)."""
    out = tmp_path / "p.json"
    proc = subprocess.Popen(_tune_cmd(out, study_name, 16), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        killed = _kill_mid_trial(proc, study_name, min_done=3)
    finally:
        proc.kill()
    before = {t.number: (t.state, t.values) for t in _trials(study_name) if t.state.is_finished()}
    assert len(before) >= 3 and not out.exists()
    r = subprocess.run(_tune_cmd(out, study_name, 16), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-3000:]
    trials = _assert_rerun(study_name, killed, before, 16)
    assert trials[killed.number].user_attrs.get(INTERRUPTED) is True  # the pid rule gave it up
    assert Policy.load(out).measured["tokens_per_s"] > 0


@pytest.mark.heavy
@needs_server
def test_trial_of_a_worker_lost_on_another_machine_is_rerun(tmp_path, study_name):
    """A worker on another machine killed mid-trial (simulated: its trial's ``host:pid`` is
    rewritten to a host that is not this one, so only its stopped heartbeat tells): a worker
    here fails the trial once its heartbeat is older than the grace period and re-runs it."""
    out = tmp_path / "p.json"
    proc = subprocess.Popen(_tune_cmd(tmp_path / "lost.json", study_name, 10), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=ENV)
    try:
        killed = _kill_mid_trial(proc, study_name, min_done=3)
    finally:
        proc.kill()
    study = optuna.load_study(study_name=study_name, storage=_db())
    study._storage.set_trial_user_attr(killed._trial_id, WORKER, "a-machine-that-is-gone:1")
    before = {t.number: (t.state, t.values) for t in study.trials if t.state.is_finished()}
    r = subprocess.run(_tune_cmd(out, study_name, 10), capture_output=True, text=True, timeout=TIMEOUT_S,
                       env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    trials = _assert_rerun(study_name, killed, before, 10)
    assert INTERRUPTED not in trials[killed.number].user_attrs  # the heartbeat, not the pid, gave it up


def test_heartbeat_setting_and_sqlite_storage(monkeypatch):
    """Heartbeats only on a database server; a bad AUTOPREC_HEARTBEAT_S is refused by name."""
    from autoprec.errors import AutoprecError
    from autoprec.search.storage import HEARTBEAT_S, heartbeat_interval, rdb_storage

    monkeypatch.delenv("AUTOPREC_HEARTBEAT_S", raising=False)
    assert heartbeat_interval() == HEARTBEAT_S
    assert rdb_storage("sqlite:///x.db") == "sqlite:///x.db"  # SQLite: as Optuna opens it (the pid rule only)
    monkeypatch.setenv("AUTOPREC_HEARTBEAT_S", "0")
    with pytest.raises(AutoprecError, match="AUTOPREC_HEARTBEAT_S='0': not a positive integer"):
        heartbeat_interval()


@needs_server
def test_plain_postgresql_url_opens_a_study_with_heartbeats(monkeypatch, study_name):
    """``postgresql://`` works with psycopg 3 alone; the study's storage sends heartbeats."""
    from autoprec.search.storage import GRACE_BEATS, check_storage_url, open_study

    monkeypatch.setenv("AUTOPREC_HEARTBEAT_S", "2")
    plain = "postgresql://" + URL.split("://", 1)[1]
    check_storage_url(plain)
    study = open_study(plain, study_name)
    try:
        assert study._storage.get_heartbeat_interval() == 2
        assert study._storage._backend.grace_period == 2 * GRACE_BEATS
    finally:
        study._storage._backend.engine.dispose()


@needs_server
def test_a_named_trial_has_a_heartbeat_so_a_lost_worker_is_found(monkeypatch, study_name):
    """The objective records a heartbeat before it names its worker: Optuna's ``fail_stale_trials``
    passes over a RUNNING trial without one, so a worker on another machine killed between starting
    a trial and its heartbeat thread's first beat left a trial nobody could give up."""
    from autoprec.search.storage import GRACE_BEATS, open_study
    from autoprec.search.workers import beat, reap_dead_trials

    monkeypatch.setenv("AUTOPREC_HEARTBEAT_S", "1")
    study = open_study(URL, study_name)
    try:
        beaten, silent = study.ask(), study.ask()  # ask() starts no heartbeat thread
        beat(beaten)
        for t in (beaten, silent):
            study._storage.set_trial_user_attr(t._trial_id, WORKER, "a-machine-that-is-gone:1")
        time.sleep(GRACE_BEATS + 1.5)
        reap_dead_trials(study)
        states = {t.number: t.state for t in study.get_trials(deepcopy=False)}
        assert states[beaten.number] == optuna.trial.TrialState.FAIL  # given up, and queued again:
        assert optuna.trial.TrialState.WAITING in states.values()
        assert states[silent.number] == optuna.trial.TrialState.RUNNING  # the hole beat closes
    finally:
        study._storage._backend.engine.dispose()


def test_messages_never_show_the_database_password(capsys):
    """``autoprec report --storage postgresql+psycopg://user:PASSWORD@host/db --study-name nope``
    printed the URL with its password; every storage message shows it as ``***``."""
    from autoprec.errors import AutoprecError
    from autoprec.search.storage import check_storage_url, shown

    url = "postgresql+psycopg://autoprec:s3cret-pw@127.0.0.1:1/autoprec"  # no server on port 1
    assert shown(url) == "postgresql+psycopg://autoprec:***@127.0.0.1:1/autoprec"
    assert shown("sqlite:///out/p.optuna.db") == "sqlite:///out/p.optuna.db"
    with pytest.raises(AutoprecError) as e:
        check_storage_url(url)
    assert "s3cret-pw" not in str(e.value) and "autoprec:***@127.0.0.1:1" in str(e.value)


@needs_server
def test_report_of_a_missing_study_does_not_print_the_servers_password(capsys):
    from sqlalchemy.engine import make_url

    from autoprec.cli import main

    password = make_url(URL).password
    assert main(["report", "--storage", URL, "--study-name", f"none-{uuid.uuid4().hex[:8]}"]) != 0
    err = capsys.readouterr().err
    assert "no study named" in err and f":{password}@" not in err and ":***@" in err, err
