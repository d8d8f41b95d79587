"""Why ``tune`` found no finalist to time (autoprec/search/budgets.py, ``why_no_finalist``): the
message names the budget at fault and the number that would pass it."""

from __future__ import annotations

from autoprec.measure import Measurement, Outcome
from autoprec.search.budgets import why_no_finalist
from autoprec.search.drift_budget import DriftBudget


def _m(g: float, peak: int = 2**20, error: str | None = None) -> Measurement:
    return Measurement(grad_rel_l2=g, grad_rel_l2_batches=[g] * 4, peak_bytes=peak,
                       outcome=Outcome.failed(error) if error else Outcome.go_on())


def test_a_drift_budget_below_even_all_fp32_compiled_says_so_with_the_smallest_drift():
    """A fresh user's ``--max-drift 1e-9``: compiled all-fp32 measured 2.95e-7 (Inductor's fp32
    kernels sum in another order than eager's), so every finalist ran and was rejected; the message
    is about the drift budget, not "every finalist failed"."""
    why = why_no_finalist([_m(2.95e-7), _m(7.2e-3)], DriftBudget.fixed(1e-9), None, compile=True)
    assert why.startswith("no finalist is within the drift budget when re-measured compiled "
                          "(--max-drift 1.00e-09 on the mean over the drift batches)")
    assert "all-fp32 included: the smallest grad_rel_l2 was 2.95e-07" in why
    eager = why_no_finalist([_m(2.95e-7)], DriftBudget.fixed(1e-9), None, compile=False)
    assert eager.startswith("no finalist is within the drift budget when re-measured (")


def test_memory_first_then_failures():
    """Within the drift budget but over the memory budget: the memory message with the smallest
    peak; every finalist failing: that, and the log holds why."""
    budget = DriftBudget.fixed(1e-2)
    why = why_no_finalist([_m(1e-3, 300 * 2**20), _m(1e-3, 250 * 2**20)], budget, 200 * 2**20, compile=True)
    assert why == ("no feasible finalist fits the memory budget (200.0 MiB; the smallest peak was 250.0 MiB "
                   "even with full recomputation)")
    assert why_no_finalist([_m(float("inf"), error="non-finite")], budget, None, True) == (
        "every finalist failed when re-measured, all-fp32 included (see the log)")


def test_no_feasible_trial_names_why_each_kind_of_trial_was_not():
    """A tune beside other jobs: every trial, all-fp32 included, was cut for its step times, and the
    error said "no trial met the drift budget, not even all-fp32". It now counts each kind."""
    import optuna

    from autoprec.search import attrs
    from autoprec.search.finalist_pool import feasible, why_none_feasible

    study = optuna.create_study(direction="maximize")
    slow = "3 of 3 timed steps over 0.8 s (the slow-step limit of timed steps)"
    for ua in ({attrs.CUT: slow, attrs.CONSTRAINT: -1.0}, {attrs.CUT: slow, attrs.CONSTRAINT: -1.0},
               {attrs.ERROR: "non-finite loss", attrs.CONSTRAINT: 1.0}, {attrs.CONSTRAINT: 0.5}):
        study.add_trial(optuna.trial.create_trial(value=100.0, user_attrs=ua))
    assert feasible(study) == []
    why = why_none_feasible(study)
    assert why.startswith("no trial is feasible, not even all-fp32: of 4 complete trials, 2 cut in screening "
                          f"(e.g. {slow}), 1 failed (e.g. non-finite loss), 1 over the drift budget"), why
    assert why.endswith("run tune alone"), why
    drift_only = optuna.create_study(direction="maximize")
    drift_only.add_trial(optuna.trial.create_trial(value=1.0, user_attrs={attrs.CONSTRAINT: 0.5}))
    assert "1 over the drift budget" in why_none_feasible(drift_only)
    assert "run tune alone" not in why_none_feasible(drift_only)
