"""Ops called with a ``dtype`` argument keep the dtype the model asked for, whatever the policy
(Hugging Face eager attention's ``softmax(x, dim=-1, dtype=torch.float32)``: a policy lowering
``sensitive`` ops, which the tuner samples, failed verification on every such model)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoprec.capture import capture
from autoprec.nodemeta import read_meta
from autoprec.ops import op_name, sets_own_dtype
from autoprec.passes import run_pipeline
from autoprec.policy import Policy, Rule


class EagerAttention(nn.Module):
    """Scores in the low dtype, softmax upcast by its dtype argument, a reduction with dtype=."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        s = self.q(x) @ self.k(x).transpose(-1, -2)
        p = nn.functional.softmax(s, dim=-1, dtype=torch.float32).to(s.dtype)
        return (p @ x).sum(dtype=torch.float32)


def test_softmax_and_sum_with_a_dtype_argument_keep_it_under_a_sensitive_bf16_rule():
    torch.manual_seed(0)
    model, x = EagerAttention(), torch.randn(2, 8, 16)
    gm = capture(model, (x,))
    pol = Policy(default_dtype="bf16", rules=[Rule(op_class="sensitive", dtype="bf16")])
    lowered = run_pipeline(gm, pol).graph_module  # verification used to fail: assigned bf16, computes fp32
    fixed = {op_name(n): read_meta(n) for n in lowered.graph.nodes
             if n.op == "call_function" and op_name(n) in ("_softmax", "softmax", "sum")}
    assert set(fixed) >= {"sum"} and fixed.keys() & {"_softmax", "softmax"}, fixed
    for name, meta in fixed.items():
        assert (meta.dtype, meta.decided_by) == ("fp32", "fixed-dtype op"), name
    mms = [read_meta(n).dtype for n in lowered.graph.nodes if op_name(n) in ("linear", "bmm", "matmul")]
    assert mms and set(mms) == {"bf16"}  # the rest of the policy still applies
    with torch.no_grad():
        want, got = model(x).double(), lowered(x)
        got = got[0] if isinstance(got, (tuple, list)) else got
    assert got.dtype == torch.float32
    assert abs(got.double() - want) <= 2e-2 * abs(want) + 1e-2  # bf16 scores, fp32 softmax


def test_sets_own_dtype_reads_the_argument_by_schema():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    sm = g.call_function(torch.ops.aten._softmax.default, (x, -1, False))
    sm_dt = g.call_function(torch.ops.aten.softmax.int, (x, -1, torch.float32))
    sm_none = g.call_function(torch.ops.aten.softmax.int, (x, -1))
    mean_kw = g.call_function(torch.ops.aten.mean.dim, (x, [0]), {"dtype": torch.float32})
    cast = g.call_function(torch.ops.aten._to_copy.default, (x,), {"dtype": torch.bfloat16})
    nodes = (sm, sm_dt, sm_none, mean_kw, cast)
    assert [sets_own_dtype(n) for n in nodes] == [False, True, False, True, True]


def test_a_node_rule_on_an_op_that_sets_its_own_dtype_warns_it_has_no_effect():
    torch.manual_seed(0)
    gm = capture(EagerAttention(), (torch.randn(2, 8, 16),))
    softmax = next(read_meta(n).key for n in gm.graph.nodes if op_name(n) in ("softmax", "_softmax"))
    pol = Policy(default_dtype="fp32", rules=[Rule(node=softmax, dtype="fp16")])
    with pytest.warns(UserWarning, match=rf"rules\[0\] names node '{softmax}', whose op sets its own dtype"):
        lowered = run_pipeline(gm, pol).graph_module
    assert {read_meta(n).dtype for n in lowered.graph.nodes if read_meta(n).key == softmax} == {"fp32"}
