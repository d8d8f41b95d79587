"""autoprec.nodemeta: typed node metadata, its defaults, and how it travels when graphs are copied.

Every copy is checked against a plain dict stored beside it (``node.meta["probe"]``): the typed
object must be shared, copied or dropped exactly where the dict it replaced was.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import fx, nn

from autoprec.capture import capture
from autoprec.graph import to_networkx
from autoprec.nodemeta import META_KEY, NodeMeta, Region, meta_of, read_meta, set_meta, unshare_meta
from autoprec.passes import run_pipeline
from autoprec.passes.base import clone_graph_module
from autoprec.policy import Policy, Rule


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            x = x * 2.0
        return torch.softmax(self.down(torch.relu(self.up(x))), dim=-1)


@pytest.fixture(scope="module")
def captured():
    torch.manual_seed(0)
    x = torch.randn(2, 8)
    return capture(Net(), (x,)), x


def _by_key(gm: fx.GraphModule, key: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if read_meta(n).key == key)


def test_capture_and_passes_write_typed_fields(captured):
    gm, _x = captured
    policy = Policy(default_dtype="bf16", rules=(Rule(node="up/linear#0", dtype="bf16", compute="fp32"),
                                                 Rule(op_class="follow", saved="bf16")))
    low = run_pipeline(gm, policy).graph_module
    up = read_meta(_by_key(low, "up/linear#0"))
    assert isinstance(up, NodeMeta)
    assert (up.module, up.op, up.op_class) == ("up", "linear", "matmul")
    assert (up.dtype, up.compute, up.storage, up.decided_by) == ("fp32", "fp32", "bf16", "rule")
    assert "GEMM" in up.reason and up.saved is None and up.inserted_cast is False
    casts = [read_meta(n) for n in low.graph.nodes if read_meta(n).inserted_cast]
    assert casts and all(m.op_class == "cast" and m.key and m.dtype for m in casts)
    assert any(m.key == "store(up/linear#0)->bf16" for m in casts)
    assert any(read_meta(n).saved == "bf16" for n in low.graph.nodes)  # relu, saved low
    region = next(read_meta(n) for n in gm.graph.nodes if read_meta(n).region is not None)
    assert region.region == Region(kind="autocast", enabled=False, device="cpu", dtype="torch.bfloat16")
    assert region.autocast_disabled is True


def test_absent_metadata_reads_as_defaults_and_creates_nothing(captured):
    gm, _x = captured
    ph = next(n for n in gm.graph.nodes if n.op == "placeholder")
    meta = read_meta(ph)
    assert META_KEY not in ph.meta
    assert meta.copy() == NodeMeta() and meta.key is None and meta.inserted_cast is False
    with pytest.raises(AttributeError, match="meta_of"):
        meta.dtype = "bf16"
    assert META_KEY not in ph.meta and read_meta(ph).dtype is None


def test_meta_of_creates_once_and_writes_stick():
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.relu, (x,))
    g.output(y)
    meta = meta_of(y)
    assert meta == NodeMeta() and meta_of(y) is meta and read_meta(y) is meta
    meta.dtype = "bf16"
    assert read_meta(y).dtype == "bf16"
    set_meta(x, NodeMeta(key="k", inserted_cast=True))
    assert read_meta(x).key == "k" and read_meta(x).inserted_cast
    assert read_meta(x).as_dict() == {"key": "k", "inserted_cast": True}


def test_a_dict_in_the_slot_is_refused():
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta[META_KEY] = {"key": "x"}
    with pytest.raises(TypeError, match="NodeMeta"):
        read_meta(x)


def test_copy_shares_nothing_but_the_immutable_and_applies_changes():
    m = NodeMeta(key="a", region=Region(kind="grad", enabled=False), constants_clamped=[("1", -1e9, -3e38)])
    c = m.copy(key="b", inserted_cast=True)
    assert (c.key, c.inserted_cast, m.key, m.inserted_cast) == ("b", True, "a", False)
    assert c.region is m.region and c.constants_clamped == m.constants_clamped
    with pytest.raises(TypeError):
        m.copy(dtyp="bf16")
    with pytest.raises(AttributeError):
        m.dtyp = "bf16"  # slots: a misspelt field is an error, not a new attribute
    assert m.as_dict() == {"key": "a", "region": {"kind": "grad", "enabled": False},
                           "constants_clamped": [("1", -1e9, -3e38)]}


def _probe(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with a plain dict beside every node's NodeMeta, to compare with."""
    for n in gm.graph.nodes:
        n.meta["probe"] = {"name": n.name}
    return gm


def test_clone_graph_module_unshares_like_the_dicts_it_copied(captured):
    gm, x = captured
    low = _probe(run_pipeline(gm, Policy.default("bf16")).graph_module)
    clone = clone_graph_module(low)
    for a, b in zip(low.graph.nodes, clone.graph.nodes):
        assert b.meta["probe"] is a.meta["probe"]  # FX's node_copy: node.meta copied shallowly
        assert (META_KEY in b.meta) == (META_KEY in a.meta)
        if META_KEY in a.meta:
            assert read_meta(b) == read_meta(a) and read_meta(b) is not read_meta(a)
    linear = _by_key(clone, "up/linear#0")
    meta_of(linear).dtype = "fp16"
    assert read_meta(_by_key(low, "up/linear#0")).dtype == "bf16"
    torch.testing.assert_close(clone(x), low(x))


def test_deepcopy_shares_like_a_dict_and_unshare_meta_separates(captured):
    gm, _x = captured
    low = _probe(run_pipeline(gm, Policy.default("bf16")).graph_module)
    for copied in (copy.deepcopy(low).graph, copy.deepcopy(low.graph)):
        for a, b in zip(low.graph.nodes, copied.nodes):
            assert (read_meta(b) is read_meta(a)) == (b.meta["probe"] is a.meta["probe"]) is True
        unshare_meta(copied)
        for a, b in zip(low.graph.nodes, copied.nodes):
            assert read_meta(b) == read_meta(a) and read_meta(b) is not read_meta(a)


def test_pickle_keeps_node_meta_values_and_drops_graph_meta_as_for_dicts():
    m = NodeMeta(key="k", region=Region(kind="autocast", enabled=True, device="cpu", dtype="torch.float16"),
                 constants_clamped=[("2", 1e9, 65504.0)], inserted_cast=True)
    assert pickle.loads(pickle.dumps(m)) == m
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    for n in gm.graph.nodes:
        meta_of(n).key = n.name
    gm = _probe(gm)
    back = pickle.loads(pickle.dumps(gm))  # GraphModule.__reduce__ keeps the code only
    assert [n.name for n in back.graph.nodes] == [n.name for n in gm.graph.nodes]
    assert not any(META_KEY in n.meta or "probe" in n.meta for n in back.graph.nodes)


def test_torch_export_round_trip_carries_node_meta_like_a_dict(captured):
    gm, x = captured
    low = _probe(run_pipeline(gm, Policy.default("bf16")).graph_module)
    ep = torch.export.export(low, (x,), strict=False)
    for n in ep.graph.nodes:
        assert (META_KEY in n.meta) == ("probe" in n.meta)
        meta_of(n).key, n.meta["probe"] = n.name, {}
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    loaded = torch.export.load(buf)
    assert all((META_KEY in n.meta) == ("probe" in n.meta) for n in loaded.graph.nodes)


def test_to_networkx_vertices_carry_the_set_fields(captured):
    gm, _x = captured
    low = run_pipeline(gm, Policy.default("bf16")).graph_module
    g = to_networkx(low)
    for n in low.graph.nodes:
        assert g.nodes[n.name] == {**read_meta(n).as_dict(), "fx_op": n.op}
    assert g.nodes[_by_key(low, "up/linear#0").name]["dtype"] == "bf16"
