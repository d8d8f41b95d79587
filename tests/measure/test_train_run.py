"""A configuration's own training run taken in turns (autoprec/measure/train_run.py): the steps the
head-to-head times are the trajectory's steps, bit for bit, however they are interleaved."""

from __future__ import annotations

import pytest
import torch

from autoprec.measure import Config, Harness, TrainRun, shareable, time_interleaved
from autoprec.metrics import traj_rel
from autoprec.modelspec import load_model_spec
from autoprec.passes import run_pipeline
from autoprec.policy import Policy
from autoprec.search.autocast_baseline import AutocastBaseline
from autoprec.search.trajectory import TrajectoryCheck
from autoprec.training.train import autocast_scaler, make_scaler

MODEL = '''
import torch
from torch import nn

def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), {extra}nn.Linear(32, 4))

def get_batch(step, device):
    g = torch.Generator().manual_seed(step)
    return (torch.randn({rows}, 16, generator=g).to(device),)

def loss_fn(out, batch):
    return (out.float() ** 2).mean()
'''
K = 6


def _harness(tmp_path, extra: str = "", rows: str = "8") -> Harness:
    f = tmp_path / "m.py"
    f.write_text(MODEL.format(extra=extra, rows=rows))
    return Harness(load_model_spec(f), torch.device("cpu"), warmup=1, steps=2)


def test_interleaved_runs_are_the_trajectories_and_leave_the_weights_as_they_were(tmp_path):
    """Three runs (fp32, a bf16 policy, an fp16 policy with its loss scaler) and torch.autocast's
    module, timed in interleaved rounds beside a configuration restored each turn, train on: their
    losses, continued untimed to K, equal ``Harness.trajectory``'s exactly."""
    h = _harness(tmp_path)
    assert shareable(h, K) and len(h.batches) >= K
    bf16 = run_pipeline(h.graph_module, Policy.default("bf16")).graph_module
    fp16_pol = Policy.default("fp16")
    fp16 = run_pipeline(h.graph_module, fp16_pol).graph_module
    ac = autocast_scaler(torch.bfloat16)
    want = [h.trajectory(h.graph_module, steps=K), h.trajectory(bf16, steps=K),
            h.trajectory(fp16, lambda: make_scaler(fp16_pol), steps=K),
            h.trajectory(h.model, ac, autocast_dtype=torch.bfloat16, steps=K)]
    runs = [TrainRun(h, h.graph_module, cycle=K), TrainRun(h, bf16, cycle=K),
            TrainRun(h, fp16, make_scaler(fp16_pol), cycle=K),
            TrainRun(h, h.model, ac(), torch.bfloat16, cycle=K)]
    configs = [Config("fp32", h.graph_module, run=runs[0]), Config("bf16", bf16, run=runs[1]),
               Config("fp16", fp16, lambda: make_scaler(fp16_pol), run=runs[2]),
               Config("autocast", h.model, ac, torch.bfloat16, run=runs[3]),
               Config("restored", bf16)]
    timings = time_interleaved(h, configs, min_rounds=1, max_rounds=1, steps_per_round=2, warmup=1)
    assert all(len(t.step_times) == 2 for t in timings.values())
    assert [len(r.losses) for r in runs] == [3, 3, 3, 3]  # one warm-up step and one round of two
    assert all(torch.equal(p, p0) for p, p0 in zip(h.params, h.initial))
    assert [r.trajectory(K) for r in runs] == want  # three more steps each, untimed
    assert want[1] != want[0] and traj_rel(want[1], want[0]) > 0  # a bf16 run is not fp32's
    assert all(torch.equal(p, p0) for p, p0 in zip(h.params, h.initial))
    with pytest.raises(ValueError, match="cycles 6 batches"):
        runs[0].trajectory(K + 1)


def test_the_check_reads_the_runs_it_shared_and_runs_only_the_missing_steps(tmp_path):
    """``TrajectoryCheck.share`` hands out the runs; after a head-to-head of 1 + 2 steps each, ``ok``
    runs no trajectory of its own, and its traj_rel is the one separate trajectories give."""
    h = _harness(tmp_path)
    pol = Policy.default("bf16")
    fn = run_pipeline(h.graph_module, pol).graph_module
    separate = TrajectoryCheck(h, AutocastBaseline(torch.bfloat16), K, lambda: None)
    assert separate.ok(pol, fn)
    check = TrajectoryCheck(h, AutocastBaseline(torch.bfloat16), K, lambda: None)
    ac = autocast_scaler(torch.bfloat16)
    configs = [Config("policy", fn, lambda: make_scaler(pol), run=check.share(fn, lambda: make_scaler(pol))),
               Config("fp32", h.graph_module, run=check.share(h.graph_module, lambda: None)),
               Config("autocast", h.model, ac, torch.bfloat16, run=check.share(h.model, ac, torch.bfloat16))]
    assert all(c.run is not None for c in configs) and len(check.runs) == 3
    time_interleaved(h, configs, min_rounds=1, max_rounds=1, steps_per_round=2, warmup=1)
    h.trajectory = lambda *a, **kw: pytest.fail("a trajectory run again")
    assert check.ok(pol, fn)
    assert check.of(pol) == separate.of(pol) > 0
    # torch.autocast's shared run had 3 steps already: the budget is over those, the separate one's
    # over the one step that decided
    assert (check.budget_steps, separate.budget_steps) == (3, 1) and check.budget >= separate.budget > 0
    check.release()
    assert check.runs == {}


def test_the_budget_stops_torch_autocasts_steps_once_they_decide_and_the_verdict_is_the_k_step_one(tmp_path):
    """On a real run the check stops torch.autocast's trajectory (its own, or the shared run's,
    continued a step at a time) once 2x its traj_rel so far reaches the policy's; the verdict is the
    one all K steps give, and the budget is torch.autocast's traj_rel over the steps run, at most its
    K-step one."""
    h = _harness(tmp_path)
    pol = Policy.default("bf16")
    fn = run_pipeline(h.graph_module, pol).graph_module
    ac = autocast_scaler(torch.bfloat16)
    ref = h.trajectory(h.graph_module, steps=K)
    full = traj_rel(h.trajectory(h.model, ac, autocast_dtype=torch.bfloat16, steps=K), ref)
    mine = traj_rel(h.trajectory(fn, lambda: make_scaler(pol), steps=K), ref)
    assert 0 < mine <= 2 * full
    separate = TrajectoryCheck(h, AutocastBaseline(torch.bfloat16), K, lambda: None)
    assert separate.ok(pol, fn) and separate.of(pol) == mine
    assert 1 <= separate.budget_steps < K and mine <= 2 * separate.budget <= 2 * full
    shared = TrajectoryCheck(h, AutocastBaseline(torch.bfloat16), K, lambda: None)
    runs = {"autocast": shared.share(h.model, ac, torch.bfloat16)}
    assert shared.ok(pol, fn) and shared.of(pol) == mine
    assert runs["autocast"].losses[:shared.budget_steps] == h.trajectory(
        h.model, ac, autocast_dtype=torch.bfloat16, steps=shared.budget_steps)
    assert shared.budget_steps == separate.budget_steps and shared.budget == separate.budget


@pytest.mark.parametrize("extra, rows", [("nn.Dropout(0.1), ", "8"), ("", "8 + step % 2")])
def test_no_run_is_shared_on_a_graph_with_random_ops_or_several_batch_shapes(tmp_path, extra, rows):
    """Dropout: a trajectory runs each step from a fixed seed (and compiled, with eager's masks),
    which timed steps must not. Two batch shapes: later timed steps would meet a shape their
    warm-up did not. Either way the check runs its trajectories on its own."""
    h = _harness(tmp_path, extra, rows)
    assert not shareable(h, K)
    check = TrajectoryCheck(h, AutocastBaseline(torch.bfloat16), K, lambda: None)
    assert check.share(h.graph_module, lambda: None) is None and check.runs == {}
