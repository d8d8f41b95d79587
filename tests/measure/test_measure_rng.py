"""Drift and trajectory measurements of models with random ops (dropout) start from one RNG state.

The Harness compares a candidate's gradients with the FP32 reference's on the same weights and
batch (docs/architecture.md#measurements, ``grad_rel_l2``): with dropout, both must see the same masks, or
even FP32 differs from itself by ``grad_rel_l2`` ~1 (a reviewer's Linear/BatchNorm/ReLU/Dropout(0.2)/Linear
model measured 1.06 and ``autoprec tune`` found no trial within the drift budget). Eager
measurements must be exactly reproducible; compiled ones are compared against the FP32 graph
compiled the same way, since Inductor draws its own random numbers (``fallback_random`` False).
"""

from __future__ import annotations

import math

import pytest
import torch

from autoprec.measure import Harness
from autoprec.metrics import traj_rel
from autoprec.modelspec import load_model_spec
from autoprec.passes import run_pipeline
from autoprec.policy import Policy
from autoprec.randomness import draws_random
from autoprec.training.train import make_scaler
from tests.conftest import RTOL

DROPOUT_MODEL = '''
import torch
from torch import nn

def build_model():
    """The reviewer's model: 32 -> 64 (BatchNorm, ReLU, Dropout(0.2)) -> 1."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 1))

def get_batch(step, device):
    g = torch.Generator().manual_seed(step)
    return (torch.randn(16, 32, generator=g).to(device),)

def loss_fn(out, batch):
    return (out - batch[0][:, :1]).pow(2).mean()

def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.05)
'''

SDPA_MODEL = '''
import torch
from torch import nn
import torch.nn.functional as F

class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 8, 3, 16).unbind(2)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=DROPOUT_P).pow(2).mean()

def build_model():
    return Attn()

def get_batch(step, device):
    return (torch.randn(2, 8, 16, device=device),)
'''


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """A CPU Harness on the dropout model (1 warm-up, 2 timed steps; timing is not used here)."""
    p = tmp_path_factory.mktemp("rng") / "dropout_model.py"
    p.write_text(DROPOUT_MODEL)
    return Harness(load_model_spec(p), torch.device("cpu"), warmup=1, steps=2)


def test_fp32_module_drift_is_exactly_zero_with_dropout(harness):
    """The FP32 module and the captured FP32 graph, measured against the FP32 reference, give
    grad_rel_l2 == 0 and loss_rel == 0 exactly (same dropout masks), with finite losses; before
    the fix the masks differed and grad_rel_l2 was ~0.5-1."""
    assert harness.random
    assert math.isfinite(harness.ref_loss)
    for fn in (harness.model, harness.graph_module):
        m = harness.drift(fn)
        assert m.error is None
        assert m.grad_rel_l2 == 0.0
        assert m.loss_rel == 0.0
        assert m.grad_sqnr_db_min == math.inf  # no parameter differs at all


def test_measurements_leave_the_global_rng_state_unchanged(harness):
    """drift() and trajectory() fork the RNG: torch.get_rng_state() (CPU generator bytes) is the
    same after a measurement as before, and the next random draw is the one the caller expected."""
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    harness.drift(harness.model)
    assert torch.equal(torch.get_rng_state(), before)
    harness.trajectory(harness.graph_module, steps=3)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.set_rng_state(before)
    harness.drift(harness.graph_module)
    assert torch.equal(torch.rand(4), expected)


def test_bf16_policy_drift_is_bf16_sized_not_mask_sized(harness):
    """A bf16 policy (Policy.default("bf16"): matmuls bf16, sensitive ops fp32) on the dropout
    model drifts by bf16 rounding only: grad_rel_l2 on batch 0 below bf16's rtol (1.6e-2,
    conftest.RTOL) and below 0.1 on every drift batch, not ~1 from different dropout masks."""
    pol = Policy.default("bf16")
    gm = run_pipeline(harness.graph_module, pol).graph_module
    m = harness.drift(gm, make_scaler(pol))
    assert m.error is None
    assert 0.0 < m.grad_rel_l2_batches[0] < RTOL[torch.bfloat16]
    # mask-sized is ~0.5-1 on every batch; batch 2 measures 6.7e-2, as much with torch.autocast
    assert max(m.grad_rel_l2_batches) < 0.1
    assert m.loss_rel < RTOL[torch.bfloat16]


def test_trajectories_see_the_same_masks(harness):
    """trajectory() reseeds each step (MEASURE_SEED + k): the FP32 module and the FP32 graph give
    the same losses bit for bit over 5 SGD steps, twice in a row; a bf16 policy's traj_rel stays
    below bf16's rtol (1.6e-2)."""
    ref = harness.trajectory(harness.graph_module, steps=5)
    assert all(math.isfinite(x) for x in ref)
    assert harness.trajectory(harness.model, steps=5) == ref
    assert harness.trajectory(harness.graph_module, steps=5) == ref
    pol = Policy.default("bf16")
    gm = run_pipeline(harness.graph_module, pol).graph_module
    assert traj_rel(harness.trajectory(gm, lambda: make_scaler(pol), steps=5), ref) < RTOL[torch.bfloat16]


@pytest.mark.parametrize(("p", "expected"), [(0.0, False), (0.1, True)])
def test_draws_random_counts_attention_dropout_only_when_nonzero(tmp_path, p, expected):
    """scaled_dot_product_attention is tagged nondeterministic_seeded in ATen whatever its
    dropout_p; draws_random counts it only with dropout_p != 0, so transformers without attention
    dropout do not pay for a compiled FP32 reference."""
    path = tmp_path / "attn.py"
    path.write_text(SDPA_MODEL.replace("DROPOUT_P", repr(p)))
    h = Harness(load_model_spec(path), torch.device("cpu"), warmup=1, steps=1)
    assert draws_random(h.graph_module) is expected
    assert h.random is expected
    assert h.drift(h.model).grad_rel_l2 == 0.0


@pytest.mark.slow  # two Inductor compiles: ~30 s on a cold cache (2-core CPU), ~5 s warm
def test_compiled_candidates_compare_against_the_compiled_fp32_graph(harness):
    """Inductor draws dropout masks from its own Philox stream (fallback_random False, as in
    training), so a compiled graph is compared against the FP32 graph compiled the same way
    (Harness.reference_fn): compiled FP32 gives grad_rel_l2 == 0 and trajectories equal to the
    reference's, and a compiled bf16 policy drifts below bf16's rtol (1.6e-2) on batch 0 (below 0.1
    on every drift batch); measured against the eager reference instead, both were ~0.5 on this model
    (different masks)."""
    from autoprec.applied.compile import compile_graph

    c32 = compile_graph(harness.graph_module)
    ref_fn = harness.reference_fn(c32)
    assert ref_fn is not harness.graph_module
    assert harness.reference_fn(harness.graph_module) is harness.graph_module
    m = harness.drift(c32)
    assert m.error is None and m.grad_rel_l2 == 0.0 and m.loss_rel == 0.0
    pol = Policy.default("bf16")
    cbf = compile_graph(run_pipeline(harness.graph_module, pol).graph_module)
    mb = harness.drift(cbf, make_scaler(pol))  # as the eager bf16 test: batch 0, then every drift batch
    assert mb.grad_rel_l2_batches[0] < RTOL[torch.bfloat16] and max(mb.grad_rel_l2_batches) < 0.1
    ref = harness.trajectory(ref_fn, steps=3)
    assert harness.trajectory(c32, steps=3) == ref
    assert traj_rel(harness.trajectory(cbf, lambda: make_scaler(pol), steps=3), ref) < RTOL[torch.bfloat16]


@pytest.mark.heavy
def test_selector_checks_a_compiled_lowered_finalist_on_a_dropout_model(harness):
    """The finalist trajectory check of a compiled bf16 policy on a graph with dropout: the
    reference is the compiled FP32 graph and the budget torch.autocast as compiled for its
    baseline (an OptimizedModule, which must not be truth-tested: its __len__ raises). Both
    trajectories are bf16-sized apart from the reference, not mask-sized (~0.2 against eager)."""
    from autoprec.search.autocast_baseline import AutocastBaseline
    from autoprec.search.contest import Contest
    from autoprec.search.drift_budget import DriftBudget
    from autoprec.search.progress import Clock
    from autoprec.search.trajectory import TrajectoryCheck

    autocast = AutocastBaseline(torch.bfloat16)
    contest = Contest(harness, DriftBudget.fixed(1.0), True, autocast, None, 2, Clock(), True)

    class NoLen(torch.nn.Module):  # a user's model class: unlike Sequential, no __len__
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, *args):
            return self.m(*args)

    ac_fn = contest.build(NoLen(harness.model))  # torch.autocast as compiled for its baseline
    check = TrajectoryCheck(harness, autocast, 2, lambda: ac_fn)
    pol = Policy.default("bf16")
    fn = contest.build(run_pipeline(harness.graph_module, pol).graph_module)
    check.ok(pol, fn)
    assert check.of(pol) < RTOL[torch.bfloat16] and check.budget < RTOL[torch.bfloat16]


def test_compiled_finalists_on_a_dropout_model_are_judged_against_compiled_autocast(harness):
    """Issue 19.2: Inductor draws its own dropout masks, so with ``--max-drift auto`` the selector
    re-bases the budget on torch.autocast as compiled (measured against the compiled FP32 graph,
    the same masks); the compiled autocast twin is then within it."""
    from autoprec.search.autocast_baseline import AutocastBaseline
    from autoprec.search.contest import Contest
    from autoprec.search.drift_budget import DriftBudget
    from autoprec.search.progress import Clock

    eager = harness.drift(harness.model, None, torch.bfloat16)
    auto = DriftBudget.auto(eager.grad_rel_l2_batches)
    contest = Contest(harness, auto, True, AutocastBaseline(torch.bfloat16), None, 0, Clock(), True)
    contest.measure_autocast()  # compiled, measured, and the budget re-based on it
    ac = contest.autocast_compiled
    assert contest.budget.reference == tuple(ac.grad_rel_l2_batches) != auto.reference
    twin = Policy.autocast("bf16")
    m = harness.drift(contest.build(run_pipeline(harness.graph_module, twin).graph_module), make_scaler(twin))
    assert contest.budget.feasible(m), contest.budget.explain(m)
    # a hard --max-drift stays as given
    assert AutocastBaseline.compiled_budget(ac, DriftBudget.fixed(0.5), harness.random) is None
