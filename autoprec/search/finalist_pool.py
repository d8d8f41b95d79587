"""The finalists' pool (docs/architecture.md#search): the feasible trials of a study, fastest
first. The selector takes its finalists from the head of it, and the screening cut
(:mod:`autoprec.search.screen_cut`) reads the k-th of it, so both follow one rule."""

from __future__ import annotations

import optuna

from autoprec.search import attrs

__all__ = ["feasible", "is_feasible", "why_none_feasible"]


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


def why_none_feasible(study: optuna.Study) -> str:
    """Why :func:`feasible` is empty (``tune``'s :class:`~autoprec.errors.SearchError` message): how
    many complete trials the screening cut stopped (the first reason of each kind, e.g. the slow-step
    limit on a machine another job slows), how many failed, how many were over the drift budget.
    A user on a busy machine had been told "no trial met the drift budget, not even all-fp32" when
    every trial, all-fp32 included, had been cut for its step times."""
    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if not done:
        return "no trial completed (see the log and the study's autoprec:error attributes)"
    groups: dict[str, list[str]] = {"cut in screening": [], "failed": [], "over the drift budget": []}
    for t in done:
        ua = t.user_attrs
        if attrs.CUT in ua:
            groups["cut in screening"].append(str(ua[attrs.CUT]))
        elif attrs.ERROR in ua:
            groups["failed"].append(str(ua[attrs.ERROR]))
        else:
            groups["over the drift budget"].append("")
    parts = []
    for kind, why in groups.items():
        if why:
            first = next((w for w in why if w), "")
            parts.append(f"{len(why)} {kind}" + (f" (e.g. {first[:200]})" if first else ""))
    slow = any("slow-step limit" in w for w in groups["cut in screening"])
    advice = ("; steps over the slow-step limit on a machine where other jobs run are their load's, not the "
              "policies': run tune alone" if slow else "")
    return (f"no trial is feasible, not even all-fp32: of {len(done)} complete trials, {', '.join(parts)} "
            f"(the study's autoprec:cut and autoprec:error attributes say why each){advice}")
