"""The follow-node min-cut (``autoprec.graph.place_follow``, mode ``mincut``) is cut component by
component: its placement must still be a global optimum of the cast-bytes cost, checked here by
enumerating every placement of a small graph whose follow nodes form two components."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from autoprec.capture import capture
from autoprec.graph import _PREFER_LOW, place_follow, tensor_bytes


class TwoBlocks(nn.Module):
    """Two residual blocks (linear -> elementwise -> + residual -> layer_norm): the norm between
    them splits the follow nodes into two components."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.ln1, self.ln2 = nn.LayerNorm(8), nn.LayerNorm(8)

    def forward(self, x, gate):
        h = self.ln1(torch.relu(self.a(x)) * torch.sigmoid(gate) + x)
        return self.ln2(torch.tanh(self.b(h)) * 2.0 + h.abs())


def _labels(gm):
    """linear: bf16, layer_norm: fp32, other float ops: auto (placed), inputs and output fp32."""
    labels, casting = {}, set()
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        floating = isinstance(val, torch.Tensor) and val.dtype.is_floating_point
        if n.op in ("placeholder", "get_attr"):
            labels[n] = "fp32" if floating else None
        elif n.op == "call_function" and floating:
            name = getattr(n.target, "__name__", str(n.target))
            labels[n] = "bf16" if "linear" in name else "fp32" if "layer_norm" in name else "auto"
            casting.add(n)
        elif n.op == "output":
            labels[n] = "fp32"
            casting.add(n)
        else:
            labels[n] = None
    return labels, casting


def _cost(nodes, labels, casting, placed) -> float:
    """Bytes cast (one cast per producer whose group {u} + consumers mixes fp32 and low), plus the
    tie-break term of an auto node left in fp32 (``_PREFER_LOW`` x its bytes)."""
    dt = {**labels, **placed}
    low = lambda n: dt[n] not in ("fp32", None)  # noqa: E731
    total = 0.0
    for u in nodes:
        if dt.get(u) is None:
            continue
        group = [u] + [v for v in u.users if v in casting]
        if len({low(m) for m in group}) > 1:
            total += tensor_bytes(u)
        if labels[u] == "auto" and not low(u):
            total += _PREFER_LOW * max(tensor_bytes(u), 1)
    return total


@pytest.fixture(scope="module")
def graph():
    torch.manual_seed(0)
    return capture(TwoBlocks(), (torch.randn(4, 8), torch.randn(4, 8)))


def test_component_cut_is_a_global_optimum(graph):
    nodes = list(graph.graph.nodes)
    labels, casting = _labels(graph)
    auto = [n for n in nodes if labels[n] == "auto"]
    assert 6 <= len(auto) <= 14  # several components, few enough to enumerate
    best = min(_cost(nodes, labels, casting, dict(zip(auto, combo)))
               for combo in itertools.product(("fp32", "bf16"), repeat=len(auto)))
    placed = place_follow(nodes, labels, casting, mode="mincut")
    assert set(placed) == set(auto)
    assert _cost(nodes, labels, casting, placed) == pytest.approx(best, rel=1e-12, abs=1e-9)
