"""A drift measurement with a dynamic loss scaler backs off as training's first steps do, in
log2 forward/backward passes rather than one per back-off (an exponential search from a hint)."""

from __future__ import annotations

import math

import pytest
import torch

from autoprec.measure import Harness, measure_drift
from autoprec.measure.drift import MAX_BACKOFFS
from autoprec.modelspec import load_model_spec
from autoprec.passes import run_pipeline
from autoprec.policy import Policy, Rule
from autoprec.training.scaler import DynamicLossScaler
from autoprec.training.train import make_scaler

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
    return 64 * out.sum()  # gradients ~64: times the default scale 2^16 they overflow fp16 (max 65504)
'''


def test_fp16_storage_drift_backs_off_instead_of_failing(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(MODEL)
    h = Harness(load_model_spec(f), torch.device("cpu"), warmup=0, steps=1)
    pol = Policy(default_dtype="fp32", rules=(Rule(op_class="follow", dtype="fp16", compute="fp32"),))
    gm = run_pipeline(h.graph_module, pol).graph_module
    scaler = make_scaler(pol)
    assert scaler.get_scale() == 2.0 ** 16
    m = h.drift(gm, scaler)
    assert m.error is None and 0 < m.grad_rel_l2 < 1e-2, (m.grad_rel_l2, m.error)
    assert "loss-scale backoff" in (m.note or "") and scaler.get_scale() < 2.0 ** 16
    assert 1 <= h.backoff_hint <= int(m.note.split()[0])  # batch 0's: where the next search starts
    fp32 = h.drift(run_pipeline(h.graph_module, Policy.fp32()).graph_module, None)
    assert not fp32.note


def test_a_second_policy_starts_one_back_off_short_of_the_first_ones_and_measures_the_same(
        tmp_path, monkeypatch):
    """The next fp16 policy's batch 0 runs first one back-off short of the hint (the last policy's
    back-offs), where it overflows, then at the hint: one pass fewer, the same drift and scale."""
    f = tmp_path / "m.py"
    f.write_text(MODEL)
    h = Harness(load_model_spec(f), torch.device("cpu"), warmup=0, steps=1)
    pol = Policy(default_dtype="fp32", rules=(Rule(op_class="follow", dtype="fp16", compute="fp32"),))
    gm = run_pipeline(h.graph_module, pol).graph_module
    scales: list[float] = []
    grads = h._grads
    monkeypatch.setattr(h, "_grads", lambda fn, scaler, *a: scales.append(scaler.get_scale()) or
                        grads(fn, scaler, *a))
    first = h.drift(gm, make_scaler(pol))
    j = int(first.note.split()[0])
    assert h.backoff_hint == j >= 2
    scales.clear()
    scaler = make_scaler(pol)
    s = scaler.back_off_scales(MAX_BACKOFFS)
    again = h.drift(gm, scaler)
    # batch 0 at s_{j-1} (overflows: so would s_0), then at s_j; batches 1-3 at s_j: no pass at s_0
    assert scales == [s[j - 1], s[j]] + [s[j]] * (h.drift_batches - 1)
    assert (again.grad_rel_l2_batches, again.note) == (first.grad_rel_l2_batches, first.note)
    assert scaler.get_scale() == s[j]


def _sequential_backoffs(scale: float, threshold: float, factor: float, floor: float) -> tuple[float, int]:
    """Training's rule, one step per back-off: halve until the gradients are finite or the floor."""
    j = 0
    while scale > threshold and scale > floor:
        scale, j = max(scale * factor, floor), j + 1
    return scale, j


def _fake_step(scaler, threshold: float, calls: list[float], loss: float = 1.0):
    """A forward/backward whose scaled gradients overflow above ``threshold`` (monotone in the scale)."""
    def step(k, count):
        calls.append(scaler.get_scale())
        g = torch.full((3,), float("inf") if scaler.get_scale() > threshold else 1.0)
        return loss, [g], 0
    return step


@pytest.mark.parametrize("hint", [1, 7, 16])
@pytest.mark.parametrize("threshold", [2.0 ** 16, 2.0 ** 15, 2.0 ** 9, 3.0, 1.0])
def test_backoff_search_lands_where_halving_does_in_log_steps(threshold, hint):
    scaler = DynamicLossScaler(init_scale=2.0 ** 16, min_scale=1.0)
    calls: list[float] = []
    refs = [(1.0, [torch.ones(3)])] * 2
    d = measure_drift(_fake_step(scaler, threshold, calls), refs, scaler, backoff_hint=hint)
    want_scale, want_j = _sequential_backoffs(2.0 ** 16, threshold, 0.5, 1.0)
    assert scaler.get_scale() == want_scale and d.backoffs == want_j  # whatever the hint
    assert all(b.finite for b in d.batches) and len(d.batches) == 2
    # batch 0: one run at 2^16, or, with a hint of 2 or more, one back-off short of the hint (spent
    # when that is finite: fewer back-offs than the hint), then the hint (the floor too when the
    # hint overflows) and about 2 log2(|j - hint| + 1) runs of the search; batch 1 starts at the
    # found scale
    scales = DynamicLossScaler(init_scale=2.0 ** 16, min_scale=1.0).back_off_scales(MAX_BACKOFFS)
    assert calls[0] == (scales[hint - 1] if hint >= 2 else 2.0 ** 16)
    spent = int(hint >= 2 and want_j < hint - 1)
    search = len(calls) - 2 - spent
    assert search <= (2 * math.ceil(math.log2(abs(want_j - hint) + 1)) + 2 if want_j else 0)
    if want_j and want_j == hint:
        assert len(calls) - 1 == 2  # the hint, and the scale above it (run first where hint >= 2)


@pytest.mark.parametrize("start", [1, 2, 5, 9, 15, 40, -3])
@pytest.mark.parametrize("answer", [1, 2, 6, 11, 16])
def test_first_true_finds_the_first_index_without_probing_twice(answer, start):
    from autoprec.measure.backoff import first_true

    probes: list[int] = []

    def holds(j: int) -> bool:
        probes.append(j)
        return j >= answer

    assert first_true(holds, 0, 16, start) == answer
    assert len(set(probes)) == len(probes) and all(0 < j < 16 for j in probes)
    assert len(probes) <= 2 * math.ceil(math.log2(abs(answer - min(max(start, 1), 15)) + 1)) + 2


def test_backoff_fails_after_a_run_at_the_hint_and_one_at_the_floor_and_at_once_on_a_nonfinite_loss():
    scaler = DynamicLossScaler(init_scale=2.0 ** 16, min_scale=1.0)
    calls: list[float] = []
    d = measure_drift(_fake_step(scaler, 0.5, calls), [(1.0, [torch.ones(3)])] * 4, scaler)
    assert calls == [2.0 ** 16, 2.0 ** 15, 1.0] and not d.batches[-1].finite and len(d.batches) == 1
    assert d.backoffs == 16 and scaler.get_scale() == 1.0  # what 16 skipped training steps reach
    scaler, calls = DynamicLossScaler(init_scale=2.0 ** 16), []
    nan_loss = _fake_step(scaler, 2.0 ** 20, calls, loss=float("nan"))
    d = measure_drift(nan_loss, [(1.0, [torch.ones(3)])], scaler)
    assert calls == [2.0 ** 16] and d.backoffs == 0 and not d.batches[0].finite  # a forward the scale
    # multiplies only afterwards: no back-off can fix it


def test_back_off_scales_are_updates_rule_and_the_search_changes_only_the_scale():
    """``back_off_scales`` rounds each back-off to float32 as ``update`` does (0.3 is not a power of 2),
    stops at the floor, and ``search_back_off`` leaves every other state entry as it was."""
    from autoprec.measure.backoff import search_back_off
    from autoprec.policy.loss_scaling import to_fp32

    scaler = DynamicLossScaler(init_scale=2.0 ** 10, backoff_factor=0.3, min_scale=1.0)
    scales = scaler.back_off_scales(MAX_BACKOFFS)
    assert scales[0] == 2.0 ** 10 and scales[-1] == 1.0 and all(to_fp32(s) == s for s in scales)
    assert all(b == max(to_fp32(a * 0.3), 1.0) for a, b in zip(scales, scales[1:]))
    assert len(scaler.back_off_scales(2)) == 3 and DynamicLossScaler(enabled=False).back_off_scales(5) == []
    before = scaler.state_dict()
    run, j = search_back_off(scaler, lambda: scaler.get_scale(), lambda s: s <= 5.0, 2.0 ** 10, 24)
    assert run == scales[j] == scaler.get_scale() and scales[j - 1] > 5.0 >= scales[j]
    assert {**scaler.state_dict(), "scale": before["scale"]} == before


def test_a_stop_before_the_backoff_search_spares_its_passes_and_leaves_drift_unmeasured():
    """``stop`` is asked before a back-off search with the overflowing batch's pass timed: a trial
    the screening cut stops then runs one pass, not the 5 the search takes, and its measurement
    says the drift is not measured (no error: it is a cut, not a failure)."""
    from autoprec.measure.drift import as_measurement

    refs = [(1.0, [torch.ones(3)])] * 4
    scaler = DynamicLossScaler(init_scale=2.0 ** 16, min_scale=1.0)
    full_calls: list[float] = []
    full = measure_drift(_fake_step(scaler, 2.0 ** 11, full_calls), refs, scaler)  # no stop: 5 back-offs
    assert full.backoffs == 5 and len(full_calls) > 4 and full.unmeasured is None

    asked = []

    def stop(d):
        asked.append((len(d.batches), d.unmeasured))
        return d.unmeasured is not None  # the speed rule, once the overflowing pass is timed

    scaler, calls = DynamicLossScaler(init_scale=2.0 ** 16, min_scale=1.0), []
    d = measure_drift(_fake_step(scaler, 2.0 ** 11, calls), refs, scaler, stop=stop)
    assert calls == [2.0 ** 16] and asked == [(0, 0)]  # one pass at the initial scale, no search
    assert d.stopped and d.unmeasured == 0 and d.batches == [] and d.backoffs == 0
    m = as_measurement(d, {0: 0.5}, scaler, state_bytes=10)
    assert m.error is None and m.pass_times == [0.5] and m.grad_rel_l2_batches == []
    assert math.isinf(m.grad_rel_l2) and "drift is not measured" in m.note and "65536" in m.note

    # a stop that goes on: the search runs as without one, and the stop is asked once per batch
    asked.clear()
    scaler, calls = DynamicLossScaler(init_scale=2.0 ** 16, min_scale=1.0), []
    d = measure_drift(_fake_step(scaler, 2.0 ** 11, calls), refs, scaler,
                      stop=lambda d: asked.append((len(d.batches), d.unmeasured)) and False)
    assert calls == full_calls and d.backoffs == full.backoffs and len(d.batches) == 4
    assert asked == [(0, 0), (1, None), (2, None), (3, None)] and d.unmeasured is None
