"""C11: token ids [70000, 5, 2049] into Embedding(80000, 8): integer tensors are never cast."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoprec.capture import capture
from autoprec.errors import PassError
from autoprec.nodemeta import read_meta
from autoprec.passes import run_pipeline
from autoprec.policy import Policy, Rule

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Emb(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(80000, 8)
        self.fc = nn.Linear(8, 8)

    def forward(self, ids):
        keep = ids > 4  # a bool mask derived from the ids
        return self.fc(self.emb(ids) * keep.unsqueeze(-1))


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    m = Emb()
    ids = torch.tensor([70000, 5, 2049])
    return m, ids, capture(m, (ids,))


@pytest.mark.parametrize("low", ["bf16", "fp16"])
@pytest.mark.parametrize("follow", [None, "low"])
def test_c11_integer_inputs_never_cast(setup, low, follow):
    m, ids, gm = setup
    rules = (Rule(op_class="follow", dtype=low),) if follow else ()
    r = run_pipeline(gm, Policy(default_dtype=low, rules=rules))
    for n in r.graph_module.graph.nodes:
        if read_meta(n).inserted_cast:
            assert n.args[0].meta["val"].dtype.is_floating_point, n.format_node()
    emb = next(n for n in r.graph_module.graph.nodes if read_meta(n).op == "embedding")
    ids_arg = emb.args[1]
    assert ids_arg.op == "placeholder"  # the ids reach the embedding uncast
    # the right rows: compare the lowered embedding lookup with the fp32 rows rounded once
    rows = {}
    assert read_meta(emb).op_class == "follow"
    from torch.fx import Interpreter

    class Grab(Interpreter):
        def run_node(self, node):
            out = super().run_node(node)
            if node is emb:
                rows["emb"] = out
            return out

    Grab(r.graph_module).run(ids)
    expect = m.emb.weight[ids].detach().to(rows["emb"].dtype)
    assert torch.equal(rows["emb"], expect)
    torch.testing.assert_close(r.graph_module(ids), m(ids), rtol=5e-2, atol=5e-2)  # low-precision floats


def test_c11_rule_on_non_float_node_rejected(setup):
    _m, _ids, gm = setup
    with pytest.raises(PassError, match=r"gt#0.*non-float") as err:
        run_pipeline(gm, Policy(default_dtype="bf16", rules=(Rule(node="gt#0", dtype="bf16"),)))
    # the model's line that made the node, not torch's
    assert f"(from {__file__}:25 (forward): keep = ids > 4" in str(err.value)
