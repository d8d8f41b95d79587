"""Tuning workers' liveness (docs/distributed.md, "N tuning workers"): which RUNNING trials lost
their worker, giving them up, and queueing their parameters again (at most :data:`MAX_RETRIES`
times). Several workers share one study (SQLite on one machine, a database server across
machines); a worker killed mid-trial must not leave a trial that others wait for
(:func:`autoprec.search.objective.Objective`'s reuse of already-measured graphs)."""

from __future__ import annotations

import datetime
import os
import socket

import optuna

from autoprec.search import attrs

__all__ = ["MAX_RETRIES", "ORPHAN_AFTER_S", "beat", "has_heartbeats", "is_dead_worker", "reap_dead_trials",
           "requeue_interrupted", "requeue_trial", "retried_numbers", "retry_of"]

#: How many times the parameters of a trial whose worker died are queued again (a policy that
#: kills every worker measuring it, e.g. by running out of host memory, is given up after that).
MAX_RETRIES = 2
#: Optuna's system attribute listing the trials a retry re-runs (the key Optuna's
#: ``RetryHeartbeatStaleTrialCallback`` writes, so its ``retry_history`` reads ours).
_RETRY_HISTORY = "retry_history"


#: A RUNNING trial older than this (seconds) that names no worker was orphaned: its worker was
#: killed between Optuna creating the trial and the objective's first line, which names it.
ORPHAN_AFTER_S = 60.0


def is_dead_worker(trial: optuna.trial.FrozenTrial) -> bool:
    """True if ``trial`` was started by a process of this host that no longer exists (killed), or
    is RUNNING without naming a worker for over :data:`ORPHAN_AFTER_S` seconds (a worker killed
    before it could name itself)."""
    if attrs.WORKER not in trial.user_attrs:
        start = trial.datetime_start
        return (trial.state == optuna.trial.TrialState.RUNNING and start is not None
                and (datetime.datetime.now() - start).total_seconds() > ORPHAN_AFTER_S)
    host, _, pid = str(trial.user_attrs.get(attrs.WORKER, "")).rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def reap_dead_trials(study: optuna.Study) -> None:
    """Give up the RUNNING trials whose worker is gone, so no worker waits for them.

    Two rules find them, in this order: a process of this host that no longer exists
    (:func:`is_dead_worker`; the trial is marked ``autoprec:interrupted`` and failed), and, on a
    storage with heartbeats (a database server, :func:`autoprec.search.storage.rdb_storage`), a
    trial whose heartbeat is older than the grace period, whatever machine ran it (Optuna's
    ``fail_stale_trials``, which fails it and calls :func:`requeue_trial`). On a storage with heartbeats a
    trial of a dead local process is queued again too (:func:`requeue_trial`); SQLite only fails it
    here, and :func:`requeue_interrupted` (after this, in ``open_study``) queues it again. Two
    workers reaping one trial at once is fine: only the one whose FAIL lands queues it again.
    """
    storage = study._storage
    heartbeat = has_heartbeats(storage)
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        if not is_dead_worker(t):
            continue
        try:
            storage.set_trial_user_attr(t._trial_id, attrs.INTERRUPTED, True)
            storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # another worker gave it up first
        if heartbeat:
            requeue_trial(study, t)
    if heartbeat:  # after the pid rule: a trial of this host is marked interrupted
        optuna.storages.fail_stale_trials(study)


def requeue_trial(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
    """Queue the parameters of ``trial``, failed because its worker died, as a new WAITING trial
    that the next free worker runs; at most :data:`MAX_RETRIES` times for one original trial.

    The new trial's system attributes ``failed_trial`` and ``retry_history`` (the trial numbers
    it re-runs) follow Optuna's ``RetryHeartbeatStaleTrialCallback``; no user attribute is
    copied (the retry measures afresh). Also the storage's ``heartbeat_stale_trial_callback``.
    """
    history = [*trial.system_attrs.get(_RETRY_HISTORY, []), trial.number]
    if len(history) > MAX_RETRIES:
        return
    study.add_trial(optuna.trial.create_trial(
        state=optuna.trial.TrialState.WAITING, params=trial.params, distributions=trial.distributions,
        system_attrs={"failed_trial": history[0], _RETRY_HISTORY: history}))


def requeue_interrupted(study: optuna.Study) -> list[int]:
    """Queue again (:func:`requeue_trial`) each failed trial marked ``autoprec:interrupted`` (Ctrl-C,
    a killed worker) that no trial re-runs yet, so a resumed study measures its policy: a user's
    Ctrl-C left a trial FAIL with partial numbers, and the resumed tune sampled another policy in its
    place. Returns the numbers queued again."""
    trials = study.get_trials(deepcopy=False)
    again = retried_numbers(trials)
    out = []
    for t in trials:
        if (t.state == optuna.trial.TrialState.FAIL and t.user_attrs.get(attrs.INTERRUPTED)
                and t.number not in again and t.params):
            requeue_trial(study, t)
            out.append(t.number)
    return out


def retry_of(trial: optuna.trial.FrozenTrial) -> list[int]:
    """Numbers of the trials that ``trial`` re-runs (:func:`requeue_trial`); empty if none."""
    return list(trial.system_attrs.get(_RETRY_HISTORY, []))


def retried_numbers(trials: list[optuna.trial.FrozenTrial]) -> set[int]:
    """Numbers of the trials that a later trial re-runs (:func:`requeue_trial`): they do not count."""
    return {n for t in trials for n in retry_of(t)}


def beat(trial: optuna.Trial) -> None:
    """On a storage with heartbeats, record this trial's heartbeat now, before the trial names its
    worker. Optuna's heartbeat thread records its first one concurrently with the objective, and
    ``fail_stale_trials`` passes over a RUNNING trial that has none: a worker on another machine
    killed in between left a named trial that no rule could give up (:func:`reap_dead_trials`; the
    orphan rule covers unnamed ones). So a named trial always has a heartbeat."""
    storage = trial.study._storage
    if has_heartbeats(storage):
        storage.record_heartbeat(trial._trial_id)


def has_heartbeats(storage: optuna.storages.BaseStorage) -> bool:
    """Whether ``storage`` records Optuna heartbeats (a database server: ``storage.rdb_storage``)."""
    return getattr(storage, "get_heartbeat_interval", lambda: None)() is not None
