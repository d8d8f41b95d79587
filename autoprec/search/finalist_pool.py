"""The finalists' pool (docs/architecture.md#search): the feasible trials of a study, fastest
first. The selector takes its finalists from the head of it, and the screening cut
(:mod:`autoprec.search.screen_cut`) reads the k-th of it, so both follow one rule."""

from __future__ import annotations

import optuna

from autoprec.search import attrs

__all__ = ["feasible", "is_feasible"]


def is_feasible(t: optuna.trial.FrozenTrial) -> bool:
    """Whether one trial counts as feasible: COMPLETE, within the drift budget (constraint ≤ 0),
    and not stopped by the screening cut (:mod:`autoprec.search.screen_cut`: measured in part)."""
    return (t.state == optuna.trial.TrialState.COMPLETE and attrs.CUT not in t.user_attrs
            and t.user_attrs.get(attrs.CONSTRAINT, attrs.INFEASIBLE) <= 0)


def feasible(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The trials :func:`is_feasible` accepts, fastest first (ties: lower number), one per per-node
    dtype assignment (fingerprint)."""
    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    ok = [t for t in done if is_feasible(t)]
    seen, out = set(), []
    for t in sorted(ok, key=lambda t: (-t.values[0], t.number)):
        fp = t.user_attrs.get(attrs.FINGERPRINT)
        if fp not in seen:
            seen.add(fp)
            out.append(t)
    return out
