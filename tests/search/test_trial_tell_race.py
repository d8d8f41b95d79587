"""Two workers on one SQLite study can pop the same queued trial; the second to finish cannot tell
it. Optuna says so as a ValueError ("Cannot tell a ...") or, from its cached storage, as
UpdateFinishedTrialError ("has already finished"): a CI run's worker ended on the second. Either
way the worker carries on with the rest of its trials."""

from __future__ import annotations

import optuna
import pytest

from autoprec.search import trials


class _Study:
    """Records optimize calls; the first raises ``error``, later ones finish a trial each."""

    def __init__(self, error: Exception) -> None:
        self.error, self.calls, self.done = error, 0, 0

    def optimize(self, objective, n_trials, **kw) -> None:
        self.calls += 1
        if self.calls == 1:
            raise self.error
        self.done += n_trials


@pytest.mark.parametrize("error", [
    ValueError("Cannot tell a COMPLETE trial."),
    optuna.exceptions.UpdateFinishedTrialError("Trial#5 has already finished and can not be updated."),
], ids=["value-error", "update-finished"])
def test_a_trial_another_worker_finished_does_not_end_the_tune(monkeypatch, error):
    study = _Study(error)
    monkeypatch.setattr(trials, "finished", lambda s: s.done)
    trials._run_trials(study, objective=None, target=3, t_end=None, progress=False)
    assert study.calls == 2 and study.done == 3


def test_another_value_error_is_raised(monkeypatch):
    study = _Study(ValueError("something else"))
    monkeypatch.setattr(trials, "finished", lambda s: s.done)
    with pytest.raises(ValueError, match="something else"):
        trials._run_trials(study, objective=None, target=3, t_end=None, progress=False)
