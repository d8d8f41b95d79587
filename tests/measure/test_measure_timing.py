"""Harness.measure times ``steps`` steps, or MIN_TIMED_STEPS once the timed steps took TIMED_BUDGET_S,
and its tokens/s counts the batches those steps ran on; a screening measurement (``screen=True``,
autoprec.measure.screening) times its drift passes plus the optimizer update instead, so each of
its forward/backward passes runs once."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from autoprec.measure import Harness, screening
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


SLEEP_S = 0.05


class Counting(torch.nn.Module):
    """``gm`` with a count of its forward calls and, when asked, a sleep in each forward."""

    def __init__(self, gm, sleep_s: float = 0.0) -> None:
        super().__init__()
        self.gm, self.sleep_s, self.calls = gm, sleep_s, 0

    def forward(self, *args):
        self.calls += 1
        time.sleep(self.sleep_s)
        return self.gm(*args)


def test_a_screening_trial_runs_each_drift_batch_once_and_times_those_passes(harness, monkeypatch):
    monkeypatch.setattr(measure, "TIMED_BUDGET_S", float("inf"))  # the full measurement times all 5
    fn = Counting(harness.graph_module, SLEEP_S)
    m = harness.measure(fn, screen=True)
    assert m.error is None
    assert fn.calls == harness.drift_batches  # no warm-up or timed steps beside the drift passes
    update = harness.update_seconds(scaled=False)
    assert len(m.pass_times) == harness.drift_batches
    assert m.step_times == [s + update for s in m.pass_times]  # batch 0's too (it also counts memory)
    assert min(m.pass_times) >= SLEEP_S  # each pass timed around its forward
    assert m.step_s == sorted(m.step_times)[len(m.step_times) // 2]
    assert m.tokens_per_s == pytest.approx(8 / m.step_s)
    # the same drift and memory as a measurement that times steps
    full = harness.measure(harness.graph_module)
    assert m.grad_rel_l2_batches == full.grad_rel_l2_batches and m.peak_bytes == full.peak_bytes
    assert len(full.step_times) == 5


def test_the_update_is_timed_once_per_scaler_kind_and_leaves_the_weights(harness, monkeypatch):
    before = [p.detach().clone() for p in harness.params]
    monkeypatch.setattr(harness, "update_s", {})
    made = []

    def make_optimizer(params):
        made.append(1)
        return torch.optim.AdamW(params)

    monkeypatch.setattr(harness, "spec", dataclasses.replace(harness.spec, make_optimizer=make_optimizer))
    unscaled = harness.update_seconds(scaled=False)
    assert harness.update_seconds(scaled=False) == unscaled and len(made) == 1  # cached
    scaled = harness.update_seconds(scaled=True)
    assert len(made) == 2 and unscaled > 0 and scaled > 0
    assert all(torch.equal(p, q) and p.grad is None for p, q in zip(harness.params, before, strict=True))


def test_one_drift_batch_times_real_steps(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(MODEL)
    h = Harness(load_model_spec(f), torch.device("cpu"), warmup=1, steps=3, drift_batches=1)
    fn = Counting(h.graph_module)
    m = h.measure(fn, screen=True)
    assert not screening.applies(h.device, fn, h.drift_batches)  # one pass: a single step's speed
    assert fn.calls == 1 + 1 + 3 and len(m.step_times) == 3  # the drift pass, a warm-up, timed steps
