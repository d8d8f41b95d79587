"""The Optuna objective: params -> policy -> lowered graph -> measurement (docs/architecture.md#search,
#measurements).

Objectives (multi-objective study): maximise tokens/s, minimise ``grad_rel_l2``, minimise peak
bytes. Constraint (``Trial.set_constraint``): ``DriftBudget.excess(m) ≤ 0``
(:mod:`autoprec.search.drift_budget`:
mean over the drift batches − X, or the paired t-test against torch.autocast). Trial attributes live
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
from collections.abc import Callable
from typing import Any

import optuna
import torch

from autoprec.applied.saved import saved_eager
from autoprec.measure import Harness, Measurement, Outcome, Stage, Timing
from autoprec.nodemeta import read_meta
from autoprec.passes import lowering_passes
from autoprec.search import attrs
from autoprec.search.drift_budget import DriftBudget
from autoprec.search.screen_cut import screening_cut
from autoprec.search.space import SearchSpace
from autoprec.search.workers import beat, is_dead_worker, reap_dead_trials
from autoprec.source import node_source
from autoprec.training.monitor import first_nonfinite_node
from autoprec.training.train import make_scaler

__all__ = ["DIRECTIONS", "Objective", "name_nonfinite", "policy_fingerprint", "recorded"]

#: Study directions: tokens/s (max), grad_rel_l2 (min), peak bytes (min).
DIRECTIONS = ("maximize", "minimize", "minimize")
#: The trial attribute each stopped :class:`~autoprec.measure.outcome.Outcome` is stored under: the
#: keys studies written before the typed outcome hold, so they keep loading (:func:`recorded`).
_STAGE_ATTRS = {Stage.FAILED: attrs.ERROR, Stage.CUT: attrs.CUT, Stage.ACCEPTED: attrs.ACCEPTED}


def policy_fingerprint(lowered: torch.fx.GraphModule) -> str:
    """SHA-256 (16 hex) of the effective per-node dtypes (storage, compute, saved) and kernel
    implementation (``impl``: explicit attention) of an assigned (or lowered) graph.

    Two policies with the same fingerprint run the same computation, whatever parameters
    produced them; the study measures it once.
    """
    h = hashlib.sha256()
    for n in lowered.graph.nodes:
        meta = read_meta(n)
        if meta.dtype is not None:  # compute and saved only where set: old fingerprints stay valid
            extra = "".join(f"|{k}={v}" for k, v in (("compute", meta.compute), ("saved", meta.saved),
                                                     ("impl", meta.impl)) if v is not None)
            h.update(f"{meta.key or n.name}={meta.dtype}{extra};".encode())
    return h.hexdigest()[:16]


class Objective:
    """Optuna objective: params -> policy -> lowered graph -> eager screening measurement
    (``Harness.measure(..., screen=True)``: on the CPU the step times come from the drift passes
    plus the optimizer update, :mod:`autoprec.measure.screening`).

    Returns ``(tokens/s, grad_rel_l2, peak bytes)`` (see :data:`DIRECTIONS`), or NaN on failure.

    Args:
        harness: Shared model/graph/reference.
        space: The search space.
        budget: The drift budget; a trial's constraint is ``budget.excess(m)`` (feasible ≤ 0).
        max_step_s: A timed trial step slower than this is aborted (several times the FP32
            step); a screened trial times its drift passes (all K, unless the screening cut stops
            them, this limit among its rules).
        finalists: With the screening cut (:mod:`autoprec.search.screen_cut`), the k fastest
            feasible trials that go on to the finalists: a trial's passes stop once it is clearly
            slower than the k-th of those measured so far, or far over the drift budget. None:
            every trial runs all its passes.
        cannot_win: With the screening cut, ``cannot_win(assigned graph)`` says why a trial is
            not run at all (its native GEMMs alone are over the slow-step limit by the kernel
            probe's bound, :func:`autoprec.search.kernel_choice.trial_cannot_win`), or None. Such a
            trial is recorded COMPLETE and cut, with no drift batch (``grad_rel_l2`` and peak
            bytes inf to the sampler, tokens/s 0), and is never a finalist.
    """

    def __init__(self, harness: Harness, space: SearchSpace, budget: DriftBudget, max_step_s: float,
                 finalists: int | None = None,
                 cannot_win: Callable[[torch.fx.GraphModule], str | None] | None = None) -> None:
        self.harness, self.space, self.budget, self.max_step_s = harness, space, budget, max_step_s
        self.finalists, self.cannot_win = finalists, cannot_win

    def __call__(self, trial: optuna.Trial) -> tuple[float, float, float] | float:
        try:
            return self._measure(trial)
        except KeyboardInterrupt:  # Optuna records the trial as FAIL; a resumed study re-runs it
            trial.set_user_attr(attrs.INTERRUPTED, True)
            raise

    def _measure(self, trial: optuna.Trial) -> tuple[float, float, float] | float:
        beat(trial)
        trial.set_user_attr(attrs.WORKER, f"{socket.gethostname()}:{os.getpid()}")  # see is_dead_worker
        params = self.space.suggest(trial)
        policy = self.space.to_policy(params)
        trial.set_user_attr(attrs.POLICY, policy.to_dict())
        gm = self.harness.graph_module
        try:
            assigned = lowering_passes(gm, policy)[:1](gm, code=False)  # assign_dtypes only
        except Exception as e:
            trial.set_user_attr(attrs.ERROR, f"lowering failed: {e}")
            return math.nan
        # The fingerprint needs only the assigned dtypes: a graph already measured skips the
        # remaining passes and their verification (most of a lowering's cost).
        fp = policy_fingerprint(assigned.graph_module)
        trial.set_user_attr(attrs.FINGERPRINT, fp)
        prior = _find_measured(trial.study, fp, trial.number)
        cut = (None if self.finalists is None else
               screening_cut(trial.study, self.finalists, self.budget, self.max_step_s))
        again = Outcome.go_on()
        if prior is not None and _in_part(prior):
            # measured in part: copied while the cut, asked now, stops or accepts its passes again
            # (under the budget of this run, which may differ from the one they were judged by)
            again = cut(recorded(prior)) if cut is not None else Outcome.go_on()
            prior = None if again.going_on else prior
        if prior is not None:
            return self._copy(trial, prior, again)
        why = self.cannot_win(assigned.graph_module) if cut is not None and self.cannot_win else None
        if why is not None:  # its first pass would trip the slow-step limit: not run
            _record(trial, Measurement(outcome=Outcome.cut(f"{why}: not run")), self.budget)
            trial.set_user_attr(attrs.PEAK_BYTES, None)  # not measured
            return 0.0, math.inf, math.inf
        try:
            lowered = lowering_passes(gm, policy)[1:].resume(assigned, owned=True)  # read no more
        except Exception as e:
            trial.set_user_attr(attrs.ERROR, f"lowering failed: {e}")
            return math.nan
        trial.set_user_attr(attrs.CASTS, lowered.stats.get("casts", 0))
        fn = saved_eager(lowered.graph_module)  # the policy's saved dtypes (the memory lever), eagerly
        m = self.harness.measure(fn, lambda: make_scaler(policy), max_step_s=self.max_step_s, screen=True,
                                 cut=cut)
        if m.failed:
            m.fail(name_nonfinite(m, lowered.graph_module, self.harness.batches))
        _record(trial, m, self.budget)
        if m.failed:
            return math.nan
        return m.tokens_per_s, m.grad_rel_l2, float(m.peak_bytes)

    def _copy(self, trial: optuna.Trial, prior: optuna.trial.FrozenTrial,
              again: Outcome) -> tuple[float, ...] | float:
        """Record ``prior``'s measurement of the same graph as ``trial``'s (``REUSED_FROM``) and
        return its values. For a ``prior`` measured in part (cut or accepted), ``again`` is what the
        cut says of its recorded passes now (cut or accepted; ``CONTINUE`` for a ``prior``
        measured in full); the copy is judged on those batches under the budget of this run."""
        part = {attrs.CUT, attrs.ACCEPTED} if not again.going_on else set()
        for k, v in prior.user_attrs.items():
            if k.startswith(attrs.ATTR) and k not in {attrs.POLICY, attrs.FINGERPRINT, *part}:
                trial.set_user_attr(k, v)
        constraint = float(prior.user_attrs.get(attrs.CONSTRAINT, attrs.INFEASIBLE))
        if not again.going_on:  # why, on the study as it is now
            trial.set_user_attr(_STAGE_ATTRS[again.stage], again.reason)
            m = recorded(prior)
            constraint = self.budget.on_batches(len(m.grad_rel_l2_batches)).excess(m)
        _constrain(trial, constraint)
        trial.set_user_attr(attrs.REUSED_FROM, prior.number)
        return tuple(prior.values) if prior.values else math.nan


def name_nonfinite(m: Measurement, gm: torch.fx.GraphModule, batches: list[Any]) -> str | None:
    """``m.error`` (None when ``m`` did not fail), and where its non-finite values start when that is why
    it failed (case C01: name the node): the first forward node of ``gm`` with an inf or NaN output on
    the last drift batch ``m`` ran (:func:`autoprec.training.monitor.first_nonfinite_node`, one eager
    forward) and the model's line that made it (:func:`autoprec.source.node_source`); or, the forward
    being finite, that the loss computed from its outputs is not (the model file's ``loss_fn``), or that
    the overflow is in the backward pass (a finite loss)."""
    if m.error is None or not m.error.startswith("non-finite"):
        return m.error
    try:
        node = first_nonfinite_node(gm, batches[len(m.grad_rel_l2_batches) - 1])  # the last run: inf
    except Exception as e:  # noqa: BLE001 - a diagnosis must not turn the error into another
        return f"{m.error}; its first non-finite node could not be found ({type(e).__name__}: {e})"
    if node:
        src = next((node_source(n) for n in gm.graph.nodes if (read_meta(n).key or n.name) == node), None)
        where = f"first non-finite output: node {node}" + (f" (from {src})" if src else "")
    elif m.error.startswith("non-finite loss"):
        where = "the forward's outputs are finite: the loss computed from them (loss_fn) is not"
    else:
        where = "forward finite (backward overflows)"
    return f"{m.error}; {where}"


def _record(trial: optuna.Trial, m: Measurement, budget: DriftBudget) -> None:
    """Store ``m``'s fields (:data:`attrs.MEASURED`; non-finite floats as None), the noise band of its
    tokens/s (:data:`attrs.TOKENS_PER_S_BAND`, from its step times) and its constraint."""
    finite = lambda v: v if (not isinstance(v, float) or math.isfinite(v)) else None  # noqa: E731
    for field, key in attrs.MEASURED.items():
        v = getattr(m, field)
        trial.set_user_attr(key, [finite(x) for x in v] if isinstance(v, list) else finite(v))
    if m.step_times and m.step_s > 0 and math.isfinite(m.step_s):  # the noise band of its tokens/s
        band = Timing.from_steps(m.step_times, m.tokens_per_s * m.step_s).tokens_per_s_band
        trial.set_user_attr(attrs.TOKENS_PER_S_BAND, [finite(x) for x in band])
    # a cut or accepted measurement is judged on the batches it ran, against the budget on the same batches
    part = m.outcome.stage in (Stage.CUT, Stage.ACCEPTED)
    _constrain(trial, (budget.on_batches(len(m.grad_rel_l2_batches)) if part else budget).excess(m))
    if not m.outcome.going_on:  # the storage's keys of studies written before the typed outcome
        trial.set_user_attr(_STAGE_ATTRS[m.outcome.stage], m.outcome.reason)
    if m.note is not None:
        trial.set_user_attr(attrs.NOTE, m.note)


def recorded(trial: optuna.trial.FrozenTrial) -> Measurement:
    """The :class:`Measurement` a trial recorded with :func:`_record`, as far as its attributes hold
    it: the fields of :data:`attrs.MEASURED` (a non-finite value, recorded as None, is inf in a
    list and the field's default alone: a drift value is then inf), its cut, acceptance and note."""
    ua = trial.user_attrs
    fields = {f: ([math.inf if x is None else x for x in ua[k]] if isinstance(ua[k], list) else ua[k])
              for f, k in attrs.MEASURED.items() if ua.get(k) is not None}
    stage = next((st for st, key in _STAGE_ATTRS.items() if ua.get(key) is not None), None)
    outcome = Outcome(stage, ua[_STAGE_ATTRS[stage]]) if stage is not None else Outcome.go_on()
    return Measurement(**fields, outcome=outcome, note=ua.get(attrs.NOTE))


def _find_measured(study: optuna.Study, fp: str, number: int, wait_s: float = 900.0,
                   poll_s: float = 0.5) -> optuna.trial.FrozenTrial | None:
    """A trial of the study that measured (or is measuring) the same per-node dtypes.

    A trial of another worker still RUNNING with a lower number that has the same fingerprint,
    or none yet (still lowering), is waited for (at most ``wait_s``), so two workers never
    measure one graph twice; only lower numbers are waited for, so no two workers wait for
    each other. Trial numbers are the storage's (a database server locks the study row while it
    numbers a trial), so the rule holds across machines. A trial whose worker died is given up
    while waiting (:func:`reap_dead_trials`), so nobody waits for it.

    A trial measured in full (or failed with an error) is returned first; failing that, of the
    trials of the graph that the screening cut stopped or accepted (measured in part: the caller
    copies one only while the cut, asked now, would stop or accept its recorded passes again), the
    first with the most drift batches measured.
    """
    deadline = time.monotonic() + wait_s
    while True:
        reap_dead_trials(study)
        running, part = False, None
        for t in study.get_trials(deepcopy=False):
            other = t.user_attrs.get(attrs.FINGERPRINT)
            if (t.number < number and t.state == optuna.trial.TrialState.RUNNING and other in (None, fp)
                    and not is_dead_worker(t)):
                running = True  # measuring this graph, or not yet lowered: wait and look again
            if t.number == number or other != fp:
                continue
            if t.state == optuna.trial.TrialState.COMPLETE and _in_part(t):
                if part is None or _passes(t) > _passes(part):  # the first with the most passes run
                    part = t
            elif t.state == optuna.trial.TrialState.FAIL and attrs.ERROR in t.user_attrs or (
                    t.state == optuna.trial.TrialState.COMPLETE):
                return t
        if not running or time.monotonic() > deadline:
            return part
        time.sleep(poll_s)


def _passes(t: optuna.trial.FrozenTrial) -> int:
    """Drift batches ``t`` measured."""
    return len(t.user_attrs.get(attrs.GRAD_REL_L2_BATCHES) or [])


def _in_part(t: optuna.trial.FrozenTrial) -> bool:
    """Whether ``t`` measured its graph in part: the screening cut stopped or accepted its drift
    passes before the K-th batch (:mod:`autoprec.search.screen_cut`), a verdict of the budget it ran
    under."""
    return attrs.CUT in t.user_attrs or attrs.ACCEPTED in t.user_attrs


def _constrain(trial: optuna.Trial, value: float) -> None:
    """Record the drift constraint (feasible when ≤ 0) for the sampler and for selection."""
    trial.set_user_attr(attrs.CONSTRAINT, value)
    if hasattr(trial, "set_constraint"):  # Optuna ≥ 5; older samplers take constraints_func
        trial.set_constraint("drift", value)
