"""The Optuna objective: params -> policy -> lowered graph -> measurement (docs/architecture.md#search, #measurements).

Objectives (multi-objective study): maximise tokens/s, minimise ``grad_rel_l2``, minimise peak
bytes. Constraint (``Trial.set_constraint``): ``grad_rel_l2 − budget ≤ 0``. Trial attributes live
under ``autoprec:`` keys (optuna-integration's LightGBMTuner style). A failed trial (lowering
error, non-finite values, too slow, compile error, out of memory) returns NaN, which Optuna
records as FAIL, with the reason in ``autoprec:error``; the study goes on.
"""

from __future__ import annotations

import hashlib
import math
import os
import socket
import time

import optuna
import torch

from autoprec.passes import lowering_passes
from autoprec.runtime.train import make_scaler
from autoprec.search import attrs
from autoprec.search.measure import Harness, Measurement
from autoprec.search.space import SearchSpace

__all__ = ["Objective", "policy_fingerprint", "DIRECTIONS", "is_dead_worker"]

#: Study directions: tokens/s (max), grad_rel_l2 (min), peak bytes (min).
DIRECTIONS = ("maximize", "minimize", "minimize")


def policy_fingerprint(lowered: torch.fx.GraphModule) -> str:
    """SHA-256 (16 hex) of the effective per-node dtypes of an assigned (or lowered) graph.

    Two policies with the same fingerprint run the same computation, whatever parameters
    produced them; the study measures it once.
    """
    h = hashlib.sha256()
    for n in lowered.graph.nodes:
        meta = n.meta.get("autoprec", {})
        if meta.get("dtype") is not None:
            h.update(f"{meta.get('key', n.name)}={meta['dtype']};".encode())
    return h.hexdigest()[:16]


class Objective:
    """Optuna objective: params -> policy -> lowered graph -> eager measurement.

    Returns ``(tokens/s, grad_rel_l2, peak bytes)`` (see :data:`DIRECTIONS`), or NaN on failure.

    Args:
        harness: Shared model/graph/reference.
        space: The search space.
        budget: Maximum ``grad_rel_l2``.
        max_step_s: A trial step slower than this is aborted (several times the FP32 step).
    """

    def __init__(self, harness: Harness, space: SearchSpace, budget: float, max_step_s: float) -> None:
        self.harness, self.space, self.budget, self.max_step_s = harness, space, budget, max_step_s

    def __call__(self, trial: optuna.Trial) -> tuple[float, float, float] | float:
        try:
            return self._measure(trial)
        except KeyboardInterrupt:  # Optuna records the trial as FAIL; a resumed study re-runs it
            trial.set_user_attr(attrs.INTERRUPTED, True)
            raise

    def _measure(self, trial: optuna.Trial) -> tuple[float, float, float] | float:
        trial.set_user_attr(attrs.WORKER, f"{socket.gethostname()}:{os.getpid()}")  # see is_dead_worker
        params = self.space.suggest(trial)
        policy = self.space.to_policy(params)
        trial.set_user_attr(attrs.POLICY, policy.to_dict())
        gm = self.harness.graph_module
        try:
            assigned = lowering_passes(gm, policy)[:1](gm)  # assign_dtypes only
        except Exception as e:
            trial.set_user_attr(attrs.ERROR, f"lowering failed: {e}")
            return math.nan
        # The fingerprint needs only the assigned dtypes: a graph already measured skips the
        # remaining passes and their verification (most of a lowering's cost).
        fp = policy_fingerprint(assigned.graph_module)
        trial.set_user_attr(attrs.FINGERPRINT, fp)
        prior = _find_measured(trial.study, fp, trial.number)
        if prior is not None:
            for k, v in prior.user_attrs.items():
                if k.startswith(attrs.ATTR) and k not in (attrs.POLICY, attrs.FINGERPRINT):
                    trial.set_user_attr(k, v)
            _constrain(trial, float(prior.user_attrs.get(attrs.CONSTRAINT, attrs.INFEASIBLE)))
            trial.set_user_attr(attrs.REUSED_FROM, prior.number)
            return tuple(prior.values) if prior.values else math.nan
        try:
            lowered = lowering_passes(gm, policy)[1:].resume(assigned)
        except Exception as e:
            trial.set_user_attr(attrs.ERROR, f"lowering failed: {e}")
            return math.nan
        trial.set_user_attr(attrs.CASTS, lowered.stats.get("casts", 0))
        m = self.harness.measure(lowered.graph_module, lambda: make_scaler(policy), max_step_s=self.max_step_s)
        _record(trial, m, self.budget)
        if m.error is not None:
            return math.nan
        return m.tokens_per_s, m.grad_rel_l2, float(m.peak_bytes)


def _record(trial: optuna.Trial, m: Measurement, budget: float) -> None:
    for field, key in attrs.MEASURED.items():
        v = getattr(m, field)
        trial.set_user_attr(key, v if (not isinstance(v, float) or math.isfinite(v)) else None)
    g = m.grad_rel_l2
    _constrain(trial, (g - budget) if math.isfinite(g) else attrs.INFEASIBLE)
    if m.error is not None:
        trial.set_user_attr(attrs.ERROR, m.error)
    if m.note is not None:
        trial.set_user_attr(attrs.NOTE, m.note)


def _find_measured(study: optuna.Study, fp: str, number: int, wait_s: float = 900.0,
                   poll_s: float = 0.5) -> optuna.trial.FrozenTrial | None:
    """A trial of the study that measured (or is measuring) the same per-node dtypes.

    A trial of another worker still RUNNING with a lower number that has the same fingerprint,
    or none yet (still lowering), is waited for (at most ``wait_s``), so two workers never
    measure one graph twice; only lower numbers are waited for, so no two workers wait for
    each other.
    """
    deadline = time.monotonic() + wait_s
    while True:
        running = False
        for t in study.get_trials(deepcopy=False):
            other = t.user_attrs.get(attrs.FINGERPRINT)
            if (t.number < number and t.state == optuna.trial.TrialState.RUNNING and other in (None, fp)
                    and not is_dead_worker(t)):
                running = True  # measuring this graph, or not yet lowered: wait and look again
            if t.number == number or other != fp:
                continue
            if t.state == optuna.trial.TrialState.COMPLETE or (
                    t.state == optuna.trial.TrialState.FAIL and attrs.ERROR in t.user_attrs):
                return t
        if not running or time.monotonic() > deadline:
            return None
        time.sleep(poll_s)


def is_dead_worker(trial: optuna.trial.FrozenTrial) -> bool:
    """True if ``trial`` was started by a process of this host that no longer exists (killed)."""
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


def _constrain(trial: optuna.Trial, value: float) -> None:
    """Record the drift constraint (feasible when ≤ 0) for the sampler and for selection."""
    trial.set_user_attr(attrs.CONSTRAINT, value)
    if hasattr(trial, "set_constraint"):  # Optuna ≥ 5; older samplers take constraints_func
        trial.set_constraint("drift", value)
