"""autoprec.applied.saved: activations saved for backward in bf16 / fp8_e5m2, eager and compiled."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import autoprec
from autoprec.applied.apply import MixedPrecisionModule
from autoprec.applied.saved import apply_saved, has_saved, pack, saved_activation_context, unpack
from autoprec.errors import PassError
from autoprec.measure import SavedBytes
from autoprec.metrics import grad_rel_l2
from autoprec.nodemeta import meta_of
from autoprec.passes import run_pipeline
from autoprec.policy import Policy
from autoprec.policy.rule import Rule
from tests.nets import Block

#: Stated tolerances of grad_rel_l2 with every activation saved low. Round-to-nearest leaves a
#: relative error uniform in ±2^-p (p significant bits), RMS 2^-p/√3: bf16 (p = 8) 2.3e-3, fp8_e5m2
#: (p = 3) 7.2e-2 per element; measured on this block 2e-3 and 5.2–5.7e-2.
GRAD_TOL = {"bf16": 1e-2, "fp8_e5m2": 1e-1}


def _module(model, ids, compile: bool, saved: str | None) -> MixedPrecisionModule:
    """fp32 policy; every float call_function node hand-marked ``saved`` (None: no marks)."""
    policy = Policy.fp32()
    gm = autoprec.capture(model, ids)
    result = run_pipeline(gm, policy)
    for n in result.graph_module.graph.nodes:
        if saved is not None and n.op == "call_function":
            meta_of(n).saved = saved
    return MixedPrecisionModule(model, result.graph_module, policy, result.stats, compile)


def _step(mp, model, ids):
    """Loss, gradients and saved bytes of one forward+backward."""
    for p in model.parameters():
        p.grad = None
    counter = SavedBytes(list(model.parameters()))
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        loss = mp(ids)
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    return loss.detach(), grads, counter.total


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    return Block(), torch.randint(0, 100, (8, 32))


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)],  # compiled: 24 s
                         ids=["eager", "compiled"])
def test_saved_low_cuts_saved_bytes_keeps_forward(setup, compile):
    model, ids = setup
    torch._dynamo.reset()
    ref_loss, ref_grads, ref_bytes = _step(_module(model, ids, compile, None), model, ids)
    for kind in ("bf16", "fp8_e5m2"):
        loss, grads, nbytes = _step(_module(model, ids, compile, kind), model, ids)
        assert torch.equal(loss, ref_loss), kind  # the forward is unchanged, bit for bit
        assert nbytes < 0.9 * ref_bytes, (kind, nbytes, ref_bytes)
        rel = grad_rel_l2(grads, ref_grads)
        assert 0 < rel < GRAD_TOL[kind], (kind, rel)  # > 0: backward did read the rounded copy


def test_policy_saved_rule_reaches_runtime(setup):
    """A policy's ``saved`` rule (set by the assign pass) is what the runtime rounds."""
    model, ids = setup
    ref_loss, ref_grads, ref_bytes = _step(autoprec.apply(model, Policy.fp32(), ids, compile=False,
                                                          dynamic=False), model, ids)
    policy = Policy(default_dtype="fp32", rules=(Rule(op_class="matmul", saved="bf16"),))
    mp = autoprec.apply(model, policy, ids, compile=False, dynamic=False)
    loss, grads, nbytes = _step(mp, model, ids)
    assert torch.equal(loss, ref_loss)
    assert nbytes < ref_bytes
    assert 0 < grad_rel_l2(grads, ref_grads) < GRAD_TOL["bf16"]


def test_fp8_all_zero_activation_gives_no_nan():
    zeros = torch.zeros(4, 8)
    q, scale = pack(zeros, "fp8_e5m2")
    assert q.dtype == torch.float8_e5m2 and math.isfinite(float(scale))
    assert torch.equal(unpack((q, scale), torch.float32), zeros)
    # in a model: relu of a very negative pre-activation saves an all-zero tensor
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        model[0].bias.fill_(-1e4)
    x = torch.randn(5, 8)
    for compile in (False, True):
        torch._dynamo.reset()
        mp = _module(model, x, compile, "fp8_e5m2")
        for p in model.parameters():
            p.grad = None
        mp(x).sum().backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters()), compile


def test_pack_leaves_narrow_or_unmarked_tensors():
    t = torch.randn(3, 3)
    assert pack(t, None) is t and pack(t, "fp32") is t
    b = t.to(torch.bfloat16)
    assert pack(b, "fp16") is b  # not narrower than what is stored
    assert pack(t, "bf16").dtype == torch.bfloat16


def test_unmarked_graph_gets_null_context_and_bad_name_names_node(setup):
    model, ids = setup
    gm = autoprec.capture(model, ids)
    assert not has_saved(gm)
    assert type(saved_activation_context(gm)).__name__ == "nullcontext"
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    meta_of(node).saved = "fp4"
    with pytest.raises(PassError, match=node.name):
        apply_saved(gm, compiled=False)


def test_fp8_keeps_infinities_and_stays_finite_elsewhere():
    t = torch.tensor([[1.0, -float("inf"), 0.5], [0.0, 2.0, -3.0]])
    back = unpack(pack(t, "fp8_e5m2"), torch.float32)
    assert back[0, 1] == -float("inf")
    finite = torch.isfinite(t)
    assert torch.allclose(back[finite], t[finite], rtol=0.13)  # e5m2: 2 stored mantissa bits


@pytest.mark.heavy
def test_compile_graph_and_saved_eager_honour_marks(setup):
    """The search's paths: a lowered graph measured eagerly (saved_eager) or via compile_graph."""
    from autoprec.applied.compile import compile_graph
    from autoprec.applied.saved import saved_eager

    model, ids = setup
    policy = Policy(default_dtype="fp32", rules=(Rule(op_class="matmul", saved="bf16"),))
    ref = _step(run_pipeline(autoprec.capture(model, ids), Policy.fp32()).graph_module, model, ids)
    for make in (saved_eager, compile_graph):
        torch._dynamo.reset()
        fn = make(run_pipeline(autoprec.capture(model, ids), policy).graph_module)
        loss, grads, nbytes = _step(fn, model, ids)
        assert nbytes < 0.9 * ref[2], make.__name__
        assert 0 < grad_rel_l2(grads, ref[1]) < GRAD_TOL["bf16"], make.__name__


@pytest.mark.heavy
def test_compiled_saved_marks_hit_the_aotautograd_cache_keyed_on_the_marks(setup, tmp_path, monkeypatch):
    """A graph with saved marks is cached by AOTAutograd (``train`` after ``tune`` on a saved-bf16
    policy reuses the tuned compile) under a key that holds the marks: the same marks compiled again
    hit and give the same loss and gradients, other marks on the same graph miss and round other ways."""
    from autoprec._torch_compat import compile_cache_counts

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model, ids = setup
    runs = []
    for kind in ("bf16", "bf16", "fp8_e5m2"):
        torch._dynamo.reset()  # a new process as far as Dynamo's in-memory caches go
        before = compile_cache_counts()
        loss, grads, _ = _step(_module(model, ids, True, kind), model, ids)
        counts = {k: v - before[k] for k, v in compile_cache_counts().items()}
        runs.append((loss, grads, counts["aot_autograd_hit"], counts["aot_autograd_miss"],
                     counts["aot_autograd_bypass"]))
    (loss0, grads0, *first), (loss1, grads1, *again), (loss2, grads2, *other) = runs
    assert first == [0, 1, 0] and again == [1, 0, 0] and other == [0, 1, 0], runs
    assert torch.equal(loss1, loss0) and all(torch.equal(a, b) for a, b in zip(grads1, grads0))
    assert torch.equal(loss2, loss0)  # the forward is the same; the saved copies are not
    assert grad_rel_l2(grads2, grads0) > 1e-3  # fp8_e5m2 rounds far coarser than bf16: not a stale hit


def test_fp16_saved_saturates_instead_of_overflowing():
    """C01: an activation of 66368 saved as fp16 is kept finite (saturated to 65504)."""
    from autoprec.applied.saved import pack

    t = torch.tensor([66368.0, -1e6, 1.5, float("-inf")])
    q = pack(t, "fp16")
    assert q.dtype == torch.float16
    assert q.tolist() == [65504.0, -65504.0, 1.5, float("-inf")]


def test_eager_never_saves_a_parameter_view_low():
    """A follow node that views a Parameter (``t(w)``) is not packed eagerly (as compiled graphs
    never pack parameters): the input gradient, which reads only weights and the relu mask, stays
    that of fp32."""
    from autoprec.applied.saved import saved_eager
    from autoprec.capture import capture
    from autoprec.passes import run_pipeline
    from autoprec.policy import Policy, Rule

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(64, 32) / 8)
            self.w2 = torch.nn.Parameter(torch.randn(16, 64) / 8)

        def forward(self, x):
            return torch.relu(x @ self.w.t()) @ self.w2.t()

    torch.manual_seed(0)
    m, x = M(), torch.randn(8, 32)
    gm = run_pipeline(capture(m, (x,)), Policy(default_dtype="fp32", rules=(Rule(op_class="follow",
                                                                                   saved="fp8_e5m2"),))).graph_module
    xr = x.clone().requires_grad_()
    m(xr).square().sum().backward()
    xl = x.clone().requires_grad_()
    saved_eager(gm)(xl).square().sum().backward()
    rel = ((xl.grad - xr.grad).norm() / xr.grad.norm()).item()
    assert rel < 1e-3, rel
