"""The typed outcome of a measurement (autoprec/measure/outcome.py): one stage with its reason
replaces the optional strings ``error``/``cut``/``accepted`` a Measurement carried, which stay
readable as views of it."""

from __future__ import annotations

import pytest

from autoprec.measure import Measurement, Outcome, Stage


def test_an_outcome_that_stops_needs_a_reason_and_going_on_has_none():
    assert Outcome.go_on().going_on and Outcome.go_on().reason == ""
    for make in (Outcome.cut, Outcome.accepted, Outcome.failed):
        assert not make("why").going_on and make("why").reason == "why"
        with pytest.raises(ValueError, match="needs a reason"):
            make("")
    assert Outcome.cut("slow") == Outcome(Stage.CUT, "slow") != Outcome.accepted("slow")


def test_a_measurements_error_cut_and_accepted_are_views_of_its_one_outcome():
    m = Measurement()
    assert m.outcome.going_on and (m.error, m.cut, m.accepted, m.failed) == (None, None, None, False)
    m.outcome = Outcome.cut("1.3x the step time of trial 4")
    assert (m.error, m.cut, m.accepted, m.failed) == (None, "1.3x the step time of trial 4", None, False)
    m.outcome = Outcome.accepted("drift within the budget")
    assert (m.cut, m.accepted) == (None, "drift within the budget")
    m.fail("non-finite loss (drift batch 2)")  # a failure replaces a cut or an acceptance
    assert (m.error, m.cut, m.accepted, m.failed) == ("non-finite loss (drift batch 2)", None, None, True)
    with pytest.raises(AttributeError):
        m.error = "no second carrier"  # the outcome is the only one
