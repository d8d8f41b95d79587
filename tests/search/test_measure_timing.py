"""Harness.measure times ``steps`` steps, or MIN_TIMED_STEPS once the timed steps took TIMED_BUDGET_S,
and its tokens/s counts the batches those steps ran on."""

from __future__ import annotations

import pytest
import torch

from autoprec.measure import Harness
from autoprec.measure import harness as measure
from autoprec.modelspec import load_model_spec

MODEL = '''
import torch
from torch import nn

def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

def get_batch(step, device):
    g = torch.Generator().manual_seed(step)
    return (torch.randn(8, 16, generator=g).to(device),)

def loss_fn(out, batch):
    return out.square().mean()

def tokens_per_batch(batch):
    return 8
'''


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    f = tmp_path_factory.mktemp("m") / "m.py"
    f.write_text(MODEL)
    return Harness(load_model_spec(f), torch.device("cpu"), warmup=1, steps=5)


@pytest.mark.parametrize("budget_s, timed", [(float("inf"), 5), (0.0, measure.MIN_TIMED_STEPS)])
def test_timing_stops_after_the_budget_but_not_before_the_minimum(harness, monkeypatch, budget_s, timed):
    monkeypatch.setattr(measure, "TIMED_BUDGET_S", budget_s)
    m = harness.measure(harness.graph_module)
    assert m.error is None and len(m.step_times) == timed
    assert m.step_s == sorted(m.step_times)[len(m.step_times) // 2]
    assert m.tokens_per_s == pytest.approx(8 / m.step_s)


def test_fewer_steps_than_the_minimum_are_all_timed(harness, monkeypatch):
    monkeypatch.setattr(measure, "TIMED_BUDGET_S", 0.0)
    monkeypatch.setattr(harness, "steps", 2)
    assert len(harness.measure(harness.graph_module).step_times) == 2
