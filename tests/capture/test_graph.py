"""Expected-graph tests for cast placement (TVM ToMixedPrecision style).

Each test captures a tiny module, lowers it with the default policy (matmul bf16, sensitive
fp32) in every placement mode and compares the exact set of inserted casts, written as
``(source node key, target dtype)``, with the hand-derived expected set.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoprec.capture import capture
from autoprec.graph import PLACEMENT_MODES, place_follow, to_networkx
from autoprec.nodemeta import read_meta
from autoprec.passes import run_pipeline
from autoprec.policy import Policy


def cast_set(gm) -> set[tuple[str, str]]:
    """``{(source key, dtype)}`` of every cast the passes inserted."""
    out = set()
    for n in gm.graph.nodes:
        m = read_meta(n)
        if m.inserted_cast:
            src = n.args[0]
            out.add((read_meta(src).key or src.name, m.dtype))
    return out


class ResidualBlock(nn.Module):
    """linear(bf16) -> relu -> +x -> layer_norm(fp32) -> linear(bf16)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)

    def forward(self, x):
        h = torch.relu(self.a(x)) + x
        return self.b(self.ln(h))


class Broadcast(nn.Module):
    """A small bf16 matmul output broadcast against a large fp32 input, then softmax (fp32)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 4)

    def forward(self, x, big):
        return torch.softmax(self.a(x).unsqueeze(-1) * big, -1)


PARAM_CASTS = {("a_weight", "bf16"), ("a_bias", "bf16")}

EXPECTED_RESIDUAL = {
    # naive: follow nodes stay fp32; the linear's output is cast up, the norm's output down.
    "naive": {("x", "bf16"), ("a/linear#0", "fp32"), ("ln/layer_norm#0", "bf16"),
              ("b/linear#0", "fp32")},
    # paint and mincut: relu/add run in bf16 (x is already cast for the linear, cast shared),
    # add's output goes up for the norm: same bytes as naive, fewer fp32 follow ops.
    "paint": {("x", "bf16"), ("add#0", "fp32"), ("ln/layer_norm#0", "bf16"), ("b/linear#0", "fp32")},
    "mincut": {("x", "bf16"), ("add#0", "fp32"), ("ln/layer_norm#0", "bf16"), ("b/linear#0", "fp32")},
    # promote (torch.autocast's rule): relu of the bf16 linear stays bf16, the add with fp32 x is fp32.
    "promote": {("x", "bf16"), ("relu#0", "fp32"), ("ln/layer_norm#0", "bf16"), ("b/linear#0", "fp32")},
}

EXPECTED_BROADCAST = {
    "naive": {("x", "bf16"), ("a/linear#0", "fp32")},
    # painting follows the bf16 linear forward: the large `big` is cast down and the mul's large
    # output cast back up for the softmax.
    "paint": {("x", "bf16"), ("big", "bf16"), ("mul#0", "fp32")},
    # min-cut casts only the small [2, 4, 1] tensor up.
    "mincut": {("x", "bf16"), ("unsqueeze#0", "fp32")},
    # promote: the mul of bf16 and fp32 is fp32, so the small tensor is cast up, as min-cut does.
    "promote": {("x", "bf16"), ("unsqueeze#0", "fp32")},
}


@pytest.fixture(scope="module")
def residual():
    torch.manual_seed(0)
    m = ResidualBlock()
    return m, capture(m, (torch.randn(2, 8),))


@pytest.fixture(scope="module")
def broadcast():
    torch.manual_seed(0)
    m = Broadcast()
    return m, capture(m, (torch.randn(2, 16), torch.randn(2, 4, 512)))


@pytest.mark.parametrize("mode", PLACEMENT_MODES)
def test_residual_block_exact_casts(residual, mode):
    _m, gm = residual
    r = run_pipeline(gm, Policy.default(), mode)
    b_params = {("b_weight", "bf16"), ("b_bias", "bf16")}
    assert cast_set(r.graph_module) == EXPECTED_RESIDUAL[mode] | PARAM_CASTS | b_params
    r.graph_module.graph.lint()


@pytest.mark.parametrize("mode", PLACEMENT_MODES)
def test_broadcast_exact_casts(broadcast, mode):
    _m, gm = broadcast
    r = run_pipeline(gm, Policy.default(), mode)
    assert cast_set(r.graph_module) == EXPECTED_BROADCAST[mode] | PARAM_CASTS


def test_mincut_beats_paint_on_bytes(broadcast):
    m, gm = broadcast
    stats = {mode: run_pipeline(gm, Policy.default(), mode).stats for mode in PLACEMENT_MODES}
    assert stats["mincut"]["cast_bytes"] < stats["paint"]["cast_bytes"]
    assert stats["mincut"]["cast_bytes"] <= stats["naive"]["cast_bytes"]
    params = 16 * 4 * 4 + 4 * 4  # a.weight + a.bias, fp32 bytes
    x_bytes, big_bytes, small = 2 * 16 * 4, 2 * 4 * 512 * 4, 2 * 4 * 1 * 4
    assert stats["mincut"]["cast_bytes"] == params + x_bytes + small
    assert stats["paint"]["cast_bytes"] == params + x_bytes + 2 * big_bytes
    # and every mode computes the same function
    x, big = torch.randn(2, 16), torch.randn(2, 4, 512)
    ref = m(x, big)
    for mode in PLACEMENT_MODES:
        out = run_pipeline(gm, Policy.default(), mode).graph_module(x, big)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-3)  # bf16 matmuls against fp32


def test_mincut_cast_bytes_are_what_the_casts_convert(broadcast):
    _m, gm = broadcast
    r = run_pipeline(gm, Policy.default(), "mincut")
    # cast bytes are counted at fp32 size (4 bytes per element of the source tensor)
    total = sum(4 * n.args[0].meta["val"].numel() for n in r.graph_module.graph.nodes
                if read_meta(n).inserted_cast)
    assert r.stats["cast_bytes"] == total
    assert r.stats["casts"] == len(cast_set(r.graph_module))


def test_fp32_policy_inserts_no_casts(residual):
    _m, gm = residual
    for mode in PLACEMENT_MODES:
        r = run_pipeline(gm, Policy.fp32(), mode)
        assert cast_set(r.graph_module) == set()


def test_place_follow_rejects_unknown_mode(residual):
    _m, gm = residual
    with pytest.raises(ValueError, match="mincut"):
        place_follow(list(gm.graph.nodes), {}, set(), mode="greedy")


def test_to_networkx_edge_bytes(broadcast):
    _m, gm = broadcast
    g = to_networkx(gm)
    assert g.edges["big", "mul"]["bytes"] == 2 * 4 * 512 * 4
    assert g.nodes["linear"]["key"] == "a/linear#0"


@pytest.fixture(scope="module")
def qwen_small():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=96, use_cache=False,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    m = Qwen2ForCausalLM(cfg).train()
    ids = torch.randint(0, 128, (2, 16))
    return capture(m, {"input_ids": ids, "labels": ids})


def test_qwen_mincut_le_paint_le_naive(qwen_small):
    s = {mode: run_pipeline(qwen_small, Policy.default(), mode).stats for mode in PLACEMENT_MODES}
    assert s["mincut"]["cast_bytes"] <= s["paint"]["cast_bytes"] <= s["naive"]["cast_bytes"]
    assert s["mincut"]["cast_bytes"] < s["naive"]["cast_bytes"]
