"""Explicit attention (issue 18): ``autoprec::sdpa_math`` against PyTorch's SDPA in float64 and in
bf16, the ``math_attention`` pass on a captured Qwen2, the policy field's round trip, and the
search offering it."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from autoprec import Policy
from autoprec.capture import capture
from autoprec.errors import PolicyError
from autoprec.kernels.attention import sdpa_math
from autoprec.metrics import grad_rel_l2
from autoprec.nodemeta import read_meta
from autoprec.passes import run_pipeline
from tests.conftest import CLOSE, DRIFT, EXAMPLES
from tests.nets import qwen2_batch, tiny_qwen2

pytest.importorskip("transformers")
SDPA = torch.ops.aten.scaled_dot_product_attention.default
MATH = torch.ops.autoprec.sdpa_math.default


def _qkv(dtype, heads=4, kv_heads=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = lambda h: (2, h, 16, 8)  # noqa: E731
    return [torch.randn(shape(h), generator=g, dtype=torch.float64).to(dtype) for h in (heads, kv_heads,
                                                                                        kv_heads)]


@pytest.mark.parametrize("kw", [dict(is_causal=True, enable_gqa=True), dict(enable_gqa=True, scale=0.3)])
def test_float64_equals_sdpa(kw):
    q, k, v = _qkv(torch.float64)
    torch.testing.assert_close(MATH(q, k, v, **kw), F.scaled_dot_product_attention(q, k, v, **kw),
                               rtol=1e-12, atol=1e-12)


def test_masks_float64_and_fully_masked_rows_are_zero():
    q, k, v = _qkv(torch.float64, heads=2, kv_heads=2)
    keep = torch.rand(16, 16, generator=torch.Generator().manual_seed(1)) > 0.3
    keep[3] = False  # a row with nothing to attend
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    out = sdpa_math(q, k, v, keep)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert torch.isfinite(out).all() and out[:, :, 3].abs().max() == 0
    bias = torch.randn(16, 16, dtype=torch.float64)
    torch.testing.assert_close(sdpa_math(q, k, v, bias),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=bias), rtol=1e-12,
                               atol=1e-12)
    with pytest.raises(RuntimeError, match="is_causal and attn_mask"):
        sdpa_math(q, k, v, keep, is_causal=True)


def test_bf16_error_against_float64_is_bf16_sized_and_gradients_flow():
    """bf16 GEMMs, fp32 softmax: output and gradients within a few bf16 ulps (2^-8) of float64."""
    ref_in = _qkv(torch.float64)
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=True, enable_gqa=True)
    ins = [t.to(torch.bfloat16).requires_grad_() for t in ref_in]
    out = MATH(*ins, is_causal=True, enable_gqa=True)
    assert out.dtype == torch.bfloat16
    assert ((out.double() - ref).norm() / ref.norm()).item() < 4 * 2**-8
    out.float().square().sum().backward()
    ref64 = [t.clone().requires_grad_() for t in ref_in]
    F.scaled_dot_product_attention(*ref64, is_causal=True, enable_gqa=True).square().sum().backward()
    for low, hi in zip(ins, ref64):
        assert ((low.grad.double() - hi.grad).norm() / hi.grad.norm()).item() < 8 * 2**-8


def test_compiled_equals_eager():
    q, k, v = _qkv(torch.bfloat16)
    compiled = torch.compile(lambda a, b, c: MATH(a, b, c, is_causal=True, enable_gqa=True),
                             backend="inductor")
    torch.testing.assert_close(compiled(q, k, v), MATH(q, k, v, is_causal=True, enable_gqa=True), rtol=2e-2,
                               atol=2e-2)  # bf16 outputs: Inductor keeps the softmax in fp32 between ops


def _qwen2_and_batch():
    return tiny_qwen2(), qwen2_batch(0)


def _loss_and_grads(gm, batch):
    gm.zero_grad(set_to_none=True)
    flat, _ = torch.utils._pytree.tree_flatten(((), batch))
    out = gm(*flat)
    loss = torch.utils._pytree.tree_leaves(out)[0]
    loss.float().backward()
    return loss.detach().float(), [p.grad.clone() for p in gm.parameters() if p.grad is not None]


def test_pass_retargets_every_sdpa_node_and_keeps_dtypes_and_keys():
    model, batch = _qwen2_and_batch()
    gm = capture(model, batch)
    fused = run_pipeline(gm, Policy.autocast("bf16"))
    math = run_pipeline(gm, dataclasses.replace(Policy.autocast("bf16"), attention="math"))
    assert fused.stats["math_attention"] == 0 and math.stats["math_attention"] == 2
    f_nodes = [n for n in fused.graph_module.graph.nodes if n.target is SDPA]
    m_nodes = [n for n in math.graph_module.graph.nodes if n.target is MATH]
    assert len(f_nodes) == len(m_nodes) == 2
    assert not any(n.target is SDPA for n in math.graph_module.graph.nodes)
    for a, b in zip(f_nodes, m_nodes):
        assert read_meta(a).key == read_meta(b).key
        assert read_meta(a).dtype == read_meta(b).dtype == "bf16"
        assert "math_attention" in read_meta(b).decided_by
    assert fused.stats["casts"] == math.stats["casts"]

    # Numerics: fp32 math equals fp32 fused to fp32 rounding; bf16 math is within bf16 drift of fp32.
    ref_loss, ref_g = _loss_and_grads(run_pipeline(gm, Policy.fp32()).graph_module, batch)
    m32_loss, m32_g = _loss_and_grads(
        run_pipeline(gm, dataclasses.replace(Policy.fp32(), attention="math")).graph_module, batch)
    torch.testing.assert_close(m32_loss, ref_loss, rtol=DRIFT[torch.float32], atol=CLOSE[torch.float32].atol)
    # this test's own bound: the math kernel reorders the softmax and both matmuls of every head
    assert grad_rel_l2(m32_g, ref_g) < 1e-4
    lo_loss, lo_g = _loss_and_grads(math.graph_module, batch)
    tw_loss, tw_g = _loss_and_grads(fused.graph_module, batch)
    assert abs(lo_loss - ref_loss) / ref_loss < 2e-2
    assert grad_rel_l2(lo_g, ref_g) < 3 * max(grad_rel_l2(tw_g, ref_g), 1e-3)


def test_policy_field_round_trip_and_errors(tmp_path):
    p = dataclasses.replace(Policy.autocast("bf16"), attention="math")
    d = p.to_dict()
    assert d["schema_version"] == 2 and d["attention"] == "math"
    assert Policy.from_dict(json.loads(json.dumps(d))) == p
    assert "attention" not in Policy.autocast("bf16").to_dict()
    assert "attention math" in p.summary()
    with pytest.raises(PolicyError, match=r"attention.*'flash'"):
        dataclasses.replace(p, attention="flash")
    one = Policy.fp32().to_dict() | {"attention": "math"}
    with pytest.raises(PolicyError, match="attention.*schema_version 2"):
        Policy.from_dict(one, "p.json")


def test_search_offers_attention_only_with_sdpa_and_a_low_kernel():
    from autoprec.search.space import SearchSpace, has_attention

    model, batch = _qwen2_and_batch()
    assert has_attention(capture(model, batch))
    space = SearchSpace(["bf16"], attention=True)
    assert space.attention == ["fused", "math"] and space.n_params == 4
    base = dict(space.baselines())
    assert base["autocast-twin"]["attention"] == "fused"
    math = base["autocast-twin, math attention"]
    assert math == base["autocast-twin"] | {"attention": "math"}
    assert SearchSpace.to_policy(math) == dataclasses.replace(Policy.autocast("bf16"), attention="math")
    assert SearchSpace.to_policy(base["autocast-twin"]) == Policy.autocast("bf16")
    assert SearchSpace([], attention=True).attention == []  # all fp32: the fused kernel is as fast
    assert "autocast-twin, math attention" not in dict(SearchSpace(["bf16"]).baselines())


def test_search_fingerprint_tells_math_attention_from_fused():
    """Trials with equal per-node dtypes are measured once: the attention choice must count."""
    from autoprec.passes.assign import assign_dtypes
    from autoprec.search.objective import policy_fingerprint

    model, batch = _qwen2_and_batch()
    gm = capture(model, batch)
    twin = Policy.autocast("bf16")
    fused = assign_dtypes(gm, twin).graph_module
    math = assign_dtypes(gm, dataclasses.replace(twin, attention="math")).graph_module
    assert policy_fingerprint(fused) != policy_fingerprint(math)
    assert policy_fingerprint(fused) == policy_fingerprint(assign_dtypes(gm, twin).graph_module)


def test_a_graph_relying_on_the_fused_layout_lowers_and_trains_as_fused(monkeypatch):
    """nanoGPT's ``y.transpose(1, 2).contiguous().view(B, T, C)`` is captured as transpose + view,
    valid only on the fused kernel's ``[B, L, H, E]`` memory layout: the pass rebuilds that layout
    after the explicit GEMMs, so the graph verifies (on the meta device, no fake-tensor fallback)
    and its loss and gradients equal the fused graph's in fp32."""
    import sys

    from autoprec.passes import verify as verify_mod

    sys.path.insert(0, str(EXAMPLES))
    import nanogpt

    model = nanogpt.build_model()
    batch = nanogpt.get_batch(0, "cpu")
    gm = capture(model, batch)
    fallbacks = []
    real = verify_mod.FakeTensorProp
    monkeypatch.setattr(verify_mod, "FakeTensorProp", lambda *a, **k: fallbacks.append(1) or real(*a, **k))
    fused = run_pipeline(gm, Policy.fp32()).graph_module
    math = run_pipeline(gm, Policy(default_dtype="fp32", attention="math")).graph_module
    assert fallbacks == []
    sdpa = sum(n.target is torch.ops.aten.scaled_dot_product_attention.default for n in gm.graph.nodes)
    assert sdpa == nanogpt.GPTConfig.n_layer  # one attention per block
    assert sum(read_meta(n).reason == "the fused kernel's layout" for n in math.graph.nodes) == 3 * sdpa

    def loss_and_grads(f):
        model.zero_grad()
        loss = nanogpt.loss_fn(f(*batch) if isinstance(batch, tuple) else f(**batch), batch)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    torch.manual_seed(0)
    l_fused, g_fused = loss_and_grads(fused)
    torch.manual_seed(0)
    l_math, g_math = loss_and_grads(math)
    torch.testing.assert_close(l_math, l_fused, rtol=DRIFT[torch.float32], atol=1e-6)
    assert grad_rel_l2(g_math, g_fused) < 1e-4  # as in the Qwen2 test above
