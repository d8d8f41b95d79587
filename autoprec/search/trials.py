"""The search phase of ``tune``: rank regions by sensitivity, queue the baselines, run Optuna
trials until the (possibly shared) study holds enough (docs/architecture.md#search); the feasible
ones are listed by :func:`autoprec.search.finalist_pool.feasible`."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable

import optuna
import torch

from autoprec._interrupt import check as check_interrupt
from autoprec.kernels.fp32_gemms import Fp32ComputeGemms
from autoprec.measure import Harness, Measurement, Outcome
from autoprec.passes import run_pipeline
from autoprec.search import attrs
from autoprec.search.objective import Objective
from autoprec.search.progress import failed_trial_logger, quiet_optuna_failures
from autoprec.search.space import SearchSpace
from autoprec.search.workers import is_dead_worker, reap_dead_trials, retried_numbers, retry_of
from autoprec.training.train import make_scaler

__all__ = ["SENSITIVITY_BATCHES", "enqueue_baselines", "finished", "optimize", "region_sensitivity"]

#: How long a worker waits, after its own trials, for other workers' running trials (seconds).
WAIT_FOR_OTHERS_S = 600.0
#: Drift batches a region's sensitivity is measured on (of K): a ranking, and on a deep model each
#: batch is a forward and backward of the whole model per region. On a 24-layer Qwen2 the regions'
#: values spread 4x (7.5e-3 to 1.9e-3, and 9.3e-4 to 2.0e-4) against ±5% between batches, so one
#: batch ranks them (it orders the local moves queued from the twin, ``enqueue_baselines``).
SENSITIVITY_BATCHES = 1
#: Rounds of "run trials, wait for the others": a trial given up while waiting (its worker died)
#: no longer counts, so the survivors run its retry in another round.
_ROUNDS = 4


def region_sensitivity(harness: Harness, space: SearchSpace,
                       on_region: Callable[[str], None] | None = None,
                       fp32_gemms: torch.dtype | None = None) -> dict[str, float]:
    """``grad_rel_l2`` when only one region (a layer block's matmuls, a run of blocks', or one
    outside matmul: :meth:`SearchSpace.region_params`) is lowered to the fastest low dtype and
    everything else stays fp32, the mean over the first :data:`SENSITIVITY_BATCHES` drift batches
    (a ranking: a trial's verdict needs all K, this does not), so a deep model measures as many
    regions as a 4-layer one (:mod:`autoprec.search.groups`). Empty when no low dtype is
    usable; a region that cannot be lowered or drifts to a non-finite value gets
    :data:`attrs.INFEASIBLE` (one that overflows only on a later batch ranks by its first ones; the
    trials measure all K). ``on_region(name)`` is called as each region begins (a progress bar's
    step). ``fp32_gemms``: the low kernel is native and slow here (the probe's rule,
    :func:`autoprec.search.autocast_baseline.autocast_gemms_in_fp32`), so its GEMMs in this dtype are
    computed as fp32 products rounded once to it (:class:`autoprec.kernels.fp32_gemms.Fp32ComputeGemms`:
    the same roundings; ``tune --dtypes bf16`` on an AVX2 CPU, where a native bf16 pass of a 24-layer
    Qwen2 takes ~9 s)."""
    if not space.low_dtypes:
        return {}
    low = space.low_dtypes[0]
    base = {"matmul": "fp32", "sensitive": "fp32", "follow": "auto"}
    base |= dict.fromkeys(space.region_params(), "inherit")
    out = {}
    for name in space.region_params():
        if on_region is not None:
            on_region(name)
        pol = space.to_policy(base | {name: low})
        try:
            gm = run_pipeline(harness.graph_module, pol).graph_module
            with Fp32ComputeGemms(fp32_gemms) if fp32_gemms is not None else contextlib.nullcontext():
                g = harness.drift(gm, make_scaler(pol), stop=_ranked).grad_rel_l2
        except Exception:  # a region that cannot be lowered is maximally sensitive
            g = math.inf
        out[name] = g if math.isfinite(g) else attrs.INFEASIBLE
    return out


def _ranked(m: Measurement) -> Outcome:
    """``Harness.drift``'s stop for a sensitivity: enough batches to rank a region (accepted)."""
    enough = len(m.grad_rel_l2_batches) >= SENSITIVITY_BATCHES
    return Outcome.accepted("ranked") if enough else Outcome.go_on()


def enqueue_baselines(study: optuna.Study, space: SearchSpace,
                      sensitivity: dict[str, float] | None = None) -> None:
    """Queue the baselines (the autocast twin among them), then local moves from the twin: its
    two most sensitive regions in fp32, one at a time, so the search starts inside the region the
    twin makes feasible, whatever the depth."""
    for _name, params in space.baselines():
        study.enqueue_trial(params, skip_if_exists=True)
    twin = space.twin()
    if not sensitivity or twin is None:
        return
    ranked = sorted(sensitivity, key=sensitivity.get, reverse=True)
    for region in ranked[:2]:
        study.enqueue_trial(twin | {region: "fp32"}, skip_if_exists=True)


def finished(study: optuna.Study) -> int:
    """Trials that count towards ``--trials``: complete, pruned, or failed by their measurement
    (non-finite drift, a lowering error); not those cut short by Ctrl-C or a killed worker, nor
    those a retry re-runs (:func:`autoprec.search.workers.requeue_trial`)."""
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL, optuna.trial.TrialState.PRUNED)
    trials = study.get_trials(deepcopy=False)
    retried = retried_numbers(trials)
    return sum(t.state in states and not t.user_attrs.get(attrs.INTERRUPTED) and t.number not in retried
               for t in trials)


def optimize(study: optuna.Study, objective: Objective, target: int, timeout: float | None,
             progress: bool) -> None:
    """Run trials until the study holds ``target`` finished ones (shared with other workers),
    then wait (at most :data:`WAIT_FOR_OTHERS_S`) for other live workers' running trials, so
    every worker selects from the same trials. A trial whose worker died is given up
    (:func:`autoprec.search.workers.reap_dead_trials`) and its retry run in another round, even
    once the study holds ``target``: its worker would have finished it had it lived."""
    t_end = None if timeout is None else time.monotonic() + timeout
    for _ in range(_ROUNDS):
        _run_trials(study, objective, target, t_end, progress)
        _wait_for_others(study)
        if t_end is not None and time.monotonic() >= t_end:
            break
        done = finished(study)
        if done >= target:
            queued = _queued_retries(study)
            if not queued:
                break
            target = done + queued


def _queued_retries(study: optuna.Study) -> int:
    """How many WAITING trials must run for every queued retry to run (Optuna pops the lowest
    number first): those up to the last retry; 0 when no retry waits."""
    waiting = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
    last = max((t.number for t in waiting if retry_of(t)), default=None)
    return 0 if last is None else sum(t.number <= last for t in waiting)


def _run_trials(study: optuna.Study, objective: Objective, target: int, t_end: float | None,
                progress: bool) -> None:
    """Optuna's ``study.optimize`` until the study holds ``target`` finished trials or ``t_end``."""
    def stop(study: optuna.Study, _trial) -> None:
        if finished(study) >= target:
            study.stop()

    quiet_optuna_failures()  # one autoprec line per failed trial instead of Optuna's two
    said = failed_trial_logger(progress)
    for _ in range(target + 1):
        remaining = target - finished(study)
        left = None if t_end is None else t_end - time.monotonic()
        if remaining <= 0 or (left is not None and left <= 0):
            break
        try:
            # check: a Ctrl-C swallowed during the trial (see autoprec._interrupt) stops here
            study.optimize(objective, n_trials=remaining, timeout=left, show_progress_bar=progress,
                           catch=(Exception,),
                           callbacks=[said, stop, lambda _study, _trial: check_interrupt()])
            break
        except (ValueError, optuna.exceptions.UpdateFinishedTrialError) as e:
            # SQLite has no row locks: two workers can pop the same queued trial, and the second
            # to finish cannot tell it (Optuna's ValueError "Cannot tell a ...", or, from its cached
            # storage, UpdateFinishedTrialError "has already finished": a CI run ended on it). A
            # worker that went silent past the heartbeat grace (a database server) finds its trial
            # failed by the others. Either way its result is not needed; carry on with the rest.
            if isinstance(e, ValueError) and "Cannot tell a" not in str(e):
                raise


def _wait_for_others(study: optuna.Study) -> None:
    """Wait (at most :data:`WAIT_FOR_OTHERS_S`) until no live worker's trial is RUNNING."""
    deadline = time.time() + WAIT_FOR_OTHERS_S
    while time.time() < deadline:
        reap_dead_trials(study)
        if not any(not is_dead_worker(t)
                   for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))):
            return
        time.sleep(1.0)
