"""The screening cut (docs/architecture.md#search, "Screening cut"): a search trial stops its
drift passes as soon as they show it cannot become a finalist.

A trial's eager screening runs K drift passes (:meth:`autoprec.measure.Harness.measure` with
``screen=True``): batch 0 warms up and counts memory, batches 1..K-1 are timed. Only the k fastest
feasible trials go on (``tune --finalists k``), so a trial clearly slower than the k-th fastest
feasible one measured so far, or clearly over the drift budget, learns nothing more from its last
passes. Successive halving (Jamieson & Talwalkar 2016, "Non-stochastic Best Arm Identification
and Hyperparameter Optimization"; Li et al. 2017, Hyperband) spends the full measurement only on
candidates that can still win; this is its one-rung form with a margin for the noise of one pass.
On a deep model, where every pass is a full forward and backward, it is where trial time goes.

A cut trial is recorded COMPLETE with what its passes measured (the sampler learns it is slow or
drifts) and :data:`autoprec.search.attrs.CUT` saying why; it is never a finalist
(:func:`autoprec.search.pool.feasible`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import optuna

from autoprec.measure import Measurement
from autoprec.search import attrs
from autoprec.search.decide import DriftBudget
from autoprec.search.pool import feasible

__all__ = ["DRIFT_FACTOR", "MIN_BATCHES", "SPEED_MARGIN", "finalist_floor", "screening_cut", "summary"]

#: Drift batches a trial runs before it can be cut: batch 0 (untimed) and one timed pass.
MIN_BATCHES = 2
#: The speed rule: cut when the trial's fastest timed pass so far gives fewer tokens/s than
#: (1 - SPEED_MARGIN) x the k-th fastest feasible trial's screening tokens/s. One eager pass of a
#: 24-layer Qwen2 on a 2-core CPU varied by ±3-8% between the batches of one trial; 0.15 leaves
#: twice that, so the trials cut are those no later pass could have lifted into the k fastest.
SPEED_MARGIN = 0.15
#: The drift rule: cut when the mean ``grad_rel_l2`` over the batches so far exceeds this many
#: times the budget over the same batches (torch.autocast's mean on them, or ``--max-drift``).
#: The budget's own rule (a paired t-test over K batches at 2% margin) never passes such a trial.
DRIFT_FACTOR = 2.0


def finalist_floor(study: optuna.Study, k: int) -> float | None:
    """Screening tokens/s of the k-th fastest feasible, uncut trial of ``study`` (one per graph
    fingerprint: the finalists' own rule), None while fewer than ``k`` are known."""
    speeds = [t.values[0] for t in feasible(study)]
    return speeds[k - 1] if k >= 1 and len(speeds) >= k else None


def screening_cut(study: optuna.Study, k: int, budget: DriftBudget) -> Callable[[Measurement], str | None]:
    """The cut for the next trial of ``study``: a function of the measurement so far (at least
    :data:`MIN_BATCHES` drift batches; its step times, seconds, from the timed passes when the
    device gives screening times) that returns why to stop, or None to go on.

    Args:
        study: The study, read once now for the k-th fastest feasible trial (:func:`finalist_floor`).
        k: The finalists taken from the trials (``tune --finalists``).
        budget: The drift budget the trials are judged against.
    """
    floor = finalist_floor(study, k)

    def cut(m: Measurement) -> str | None:
        n = len(m.grad_rel_l2_batches)
        if n < MIN_BATCHES:
            return None
        limit = DRIFT_FACTOR * (statistics.fmean(budget.reference[:n]) if budget.rule == "auto"
                                else budget.max_drift)
        if m.grad_rel_l2 > limit:
            return (f"grad_rel_l2 {m.grad_rel_l2:.3g} over its first {n} batches, over {DRIFT_FACTOR:g}x "
                    f"the budget on them ({limit / DRIFT_FACTOR:.3g})")
        if floor is not None and m.step_times and m.step_s > 0:
            best = m.tokens_per_s * m.step_s / min(m.step_times)  # tokens per step / fastest step
            if best < (1 - SPEED_MARGIN) * floor:
                return (f"{best:.0f} tok/s at its fastest timed pass, under {1 - SPEED_MARGIN:g}x the "
                        f"{_ordinal(k)} fastest feasible trial's {floor:.0f}")
        return None

    return cut


def summary(study: optuna.Study, k: int) -> str:
    """One log line: how many of the study's complete trials the cut stopped, and after how many
    drift batches (``"screening cut: 9 of 20 complete trials (drift batches run after 2: 7,
    after 3: 2), slower than 0.85x the 2nd fastest feasible one or over 2x the drift budget"``)."""
    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    cut = [t for t in done if attrs.CUT in t.user_attrs]
    after: dict[int, int] = {}
    for t in cut:
        n = len(t.user_attrs.get(attrs.GRAD_REL_L2_BATCHES) or [])
        after[n] = after.get(n, 0) + 1
    where = ", ".join(f"after {n}: {c}" for n, c in sorted(after.items()))
    return (f"screening cut: {len(cut)} of {len(done)} complete trials" + (f" (drift batches run {where})"
            if cut else "") + f", slower than {1 - SPEED_MARGIN:g}x the {_ordinal(k)} fastest feasible one "
            f"or over {DRIFT_FACTOR:g}x the drift budget")


def _ordinal(k: int) -> str:
    return {1: "1st", 2: "2nd", 3: "3rd"}.get(k, f"{k}th")
