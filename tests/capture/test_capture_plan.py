"""Capture owns its shapes (issue 21): one tune-style capture over several batches makes its DimPlan
once and passes it down to the one export; the graph is the one the earlier per-batch planning gave."""

from __future__ import annotations

import logging

import pytest
import torch

from autoprec.applied import shape_cache
from autoprec.capture import (
    DIMS_META,
    PROBE_BATCHES,
    capture,
    capture_dynamic,
    capture_for,
    dims,
    largest_batch,
    largest_sizes,
    maxima,
    plan_dims,
    role_sizes,
    trace,
)
from autoprec.capture import batches as capture_batches
from autoprec.modelspec import load_model_spec, split_batch
from autoprec.nodekeys import graph_fingerprint
from tests.conftest import MODELS
from tests.nets import ParityLM, lm_batch

VARLEN = MODELS / "varlen_lm.py"


@pytest.fixture
def planned(monkeypatch) -> list[str]:
    """Counts plans: every call of the plan builder (``plan_dims``, wherever the package calls it
    from) and every ``DimPlan`` constructed, one entry each."""
    seen: list[str] = []
    builder, init = dims.plan_dims, dims.DimPlan.__init__

    def spy(*args, **kwargs):
        seen.append("plan_dims")
        return builder(*args, **kwargs)

    def counted_init(self, *args, **kwargs):
        seen.append("DimPlan")
        init(self, *args, **kwargs)

    for module in (dims, trace, capture_batches, shape_cache):
        if hasattr(module, "plan_dims"):
            monkeypatch.setattr(module, "plan_dims", spy)
    monkeypatch.setattr(dims.DimPlan, "__init__", counted_init)
    return seen


def _varlen():
    spec = load_model_spec(VARLEN)
    return spec.build_model(), [spec.get_batch(i, torch.device("cpu")) for i in range(PROBE_BATCHES)]


def test_capture_for_plans_once_and_captures_what_per_batch_planning_did(planned):
    model, batches = _varlen()  # (3, 12), (2, 8), (3, 16), (1, 10), (2, 12): the largest is (3, 16)
    gm = capture_for(model, batches)
    assert planned == ["plan_dims", "DimPlan"]  # one plan for five batches, passed to the export
    planned.clear()
    # the graph is unchanged: the ranges reach every batch, as the capture before issue 21 had them
    # (34 nodes, batch 1..3, seq 2..16, recorded on main before the package)
    assert sorted(gm.meta[DIMS_META].values()) == [("batch", 1, 3), ("seq", 2, 16)]
    assert len(gm.graph.nodes) == 34
    # ... and the same as the old composition: one plan per batch, their maxima, a second plan
    at_least = maxima([plan_dims(model, *split_batch(b)) for b in batches])
    assert at_least == largest_sizes(model, batches) == {"batch": 3, "seq": 16}
    old = capture(model, largest_batch(batches), dynamic=True, at_least=at_least)
    assert graph_fingerprint(old) == graph_fingerprint(gm)
    assert sorted(old.meta[DIMS_META].values()) == sorted(gm.meta[DIMS_META].values())


def test_batches_are_measured_not_planned(planned):
    model, batches = _varlen()
    assert role_sizes(model, *split_batch(batches[3])) == {"batch": 1, "seq": 10}
    assert largest_sizes(model, batches) == {"batch": 3, "seq": 16}
    assert planned == []


def test_same_shapes_capture_statically_without_a_plan(planned):
    spec = load_model_spec(MODELS / "micro_lm.py")
    model = spec.build_model()
    gm = capture_for(model, [spec.get_batch(i, torch.device("cpu")) for i in range(PROBE_BATCHES)])
    assert planned == [] and DIMS_META not in gm.meta


def test_a_model_that_specialises_is_planned_once_and_falls_back_to_static(planned, caplog):
    torch.manual_seed(0)
    model = ParityLM()
    with caplog.at_level(logging.INFO, logger="autoprec"):
        gm = capture_for(model, [lm_batch(4, 32, 0), lm_batch(2, 17, 1)])
    assert planned == ["plan_dims", "DimPlan"]
    assert DIMS_META not in gm.meta and "using one graph per input shape instead (at most 16)" in caplog.text
    planned.clear()
    gm = capture_dynamic(model, lm_batch(4, 32, 0))  # apply(..., dynamic=True)'s capture: one plan too
    assert planned == ["plan_dims", "DimPlan"] and DIMS_META not in gm.meta


def test_apply_dynamic_static_fallback_reuses_the_capture_plan(planned):
    """``apply(..., dynamic=True)`` on a model that specialises: the per-shape cache checks calls
    against the plan the capture made; the example batch is planned once, not twice."""
    from autoprec import Policy, apply

    torch.manual_seed(0)
    model = ParityLM()
    mp = apply(model, Policy.default("fp32"), lm_batch(4, 32, 0), compile=False, dynamic=True,
               strict_shapes=True)
    assert planned == ["plan_dims", "DimPlan"]
    with pytest.raises(ValueError, match="batch"):
        mp(**lm_batch(8, 32, 1))  # batch 8 is outside the plan's range of 1..4
