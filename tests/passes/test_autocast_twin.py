"""The autocast twin (``Policy.autocast``): the captured graph lowered with torch.autocast's
numerics — matmuls low, sensitive ops fp32, every other op by type promotion (issue 18)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoprec import Policy
from autoprec.capture import capture
from autoprec.dtypes import NAMES
from autoprec.errors import PolicyError
from autoprec.metrics import grad_rel_l2
from autoprec.nodemeta import read_meta
from autoprec.passes import lower
from autoprec.passes.assign import assign_dtypes
from autoprec.search.space import SearchSpace
from tests.nets import qwen2_batch, tiny_qwen2

pytest.importorskip("transformers")




def _autocast_dtypes(gm: torch.fx.GraphModule, batch: dict) -> dict[str, str]:
    """Each float node's output dtype when the FP32 graph runs under torch.autocast (bf16, CPU)."""
    seen: dict[str, str] = {}

    class Record(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if isinstance(out, torch.Tensor) and out.is_floating_point():
                seen[n.name] = NAMES[out.dtype]
            return out

    flat, _ = torch.utils._pytree.tree_flatten(((), batch))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        Record(gm).run(*flat)
    return seen


def _differing(gm: torch.fx.GraphModule, policy: Policy, seen: dict[str, str]) -> list[str]:
    assigned = assign_dtypes(gm, policy).graph_module
    out = []
    for n in assigned.graph.nodes:
        meta = read_meta(n)
        stored = meta.dtype if meta.storage is None else meta.storage
        if n.name in seen and stored is not None and stored != seen[n.name]:
            out.append(f"{meta.key}: {stored} vs autocast {seen[n.name]}")
    return out


@pytest.fixture(scope="module")
def qwen2():
    model = tiny_qwen2()
    return model, capture(model, qwen2_batch())


def test_twin_stores_every_node_in_the_dtype_autocast_computes_it_in(qwen2):
    _model, gm = qwen2
    seen = _autocast_dtypes(gm, qwen2_batch())
    assert _differing(gm, Policy.autocast("bf16"), seen) == []
    # the older "autocast-like" default stores the residual stream low: the twin is not it
    wrong = _differing(gm, Policy.default("bf16"), seen)
    assert any("add" in w and "bf16 vs autocast fp32" in w for w in wrong), wrong


def test_twin_drift_equals_autocast_drift(qwen2):
    model, gm = qwen2
    params = [p for p in model.parameters()]

    def grads(fn, autocast: bool, batch) -> list[torch.Tensor]:
        for p in params:
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = fn(**batch).loss
        loss.float().backward()
        return [p.grad.clone() for p in params]

    # The forward is bit-identical; backward sums differ in order: the twin casts a tensor once
    # for all its consumers (its gradient summed in bf16), autocast once per consumer, and even
    # autocast on the module and on the graph differ by a few % per batch. Hence the paired
    # noise rule of autoprec.search.drift_budget, and a 5% tolerance on the mean here.
    twin = lower(gm, Policy.autocast("bf16"))
    ac, tw = [], []
    for seed in range(4):
        batch = qwen2_batch(seed)
        ref = grads(gm, False, batch)
        ac.append(grad_rel_l2(grads(model, True, batch), ref))
        tw.append(grad_rel_l2(grads(twin, False, batch), ref))
        assert 1e-4 < ac[-1] < 5e-2  # bf16-sized
        assert tw[-1] == pytest.approx(ac[-1], rel=0.1), (seed, tw, ac)
    assert sum(tw) / 4 == pytest.approx(sum(ac) / 4, rel=0.05)


def _residual_graph() -> torch.fx.GraphModule:
    class Res(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            return (x + h).relu() * h.sigmoid()

    return capture(Res(), (torch.randn(2, 8),))


def test_promotion_keeps_an_fp32_stream_fp32_and_low_only_inputs_low():
    gm = _residual_graph()
    by_op = {}
    for n in assign_dtypes(gm, Policy.autocast("bf16")).graph_module.graph.nodes:
        meta = read_meta(n)
        if n.op == "call_function":
            by_op[meta.key.split("/")[-1]] = (meta.dtype, meta.decided_by)
    assert by_op["linear#0"][0] == "bf16"
    assert by_op["add#0"] == ("fp32", "placement:promote")  # fp32 x + bf16 h
    assert by_op["relu#0"][0] == "fp32"
    assert by_op["sigmoid#0"][0] == "bf16"  # only a bf16 input
    assert by_op["mul#0"][0] == "fp32"  # fp32 relu * bf16 sigmoid
    # min-cut stores the same adds low (fewest bytes cast): the placement is the policy's
    assert any(read_meta(n).dtype == "bf16" and "add" in str(n.target)
               for n in assign_dtypes(gm, Policy.default("bf16")).graph_module.graph.nodes)


def test_follow_placement_round_trips_as_schema_2_and_is_checked(tmp_path):
    p = Policy.autocast("bf16")
    d = p.to_dict()
    assert d["schema_version"] == 2 and d["follow_placement"] == "promote"
    assert Policy.from_dict(d) == p
    assert "follow_placement" not in Policy.default("bf16").to_dict()
    with pytest.raises(PolicyError, match=r"p.json: follow_placement: 'cut' is not a valid follow placement"):
        Policy.from_dict(d | {"follow_placement": "cut"}, source="p.json")
    with pytest.raises(PolicyError, match=r"follow_placement: needs schema_version 2"):
        Policy.from_dict(d | {"schema_version": 1}, source="p.json")
    path = tmp_path / "twin.json"
    p.save(path)
    assert Policy.load(path) == p


def test_search_space_offers_promotion_and_queues_the_twin_second():
    space = SearchSpace(["bf16"], blocks=["model.layers.0"], nodes=["lm_head/linear#0"])
    names = [n for n, _ in space.baselines()]
    assert names[:2] == ["fp32", "autocast-twin"]
    assert space.to_policy(space.twin()).training_key() == Policy.autocast("bf16").training_key()
