"""autoprec._torch_compat: one test per entry, each calling the private torch API for real on this torch.

A torch upgrade that moves or changes one of them fails here, by name. Compiles use the
``eager``/``aot_eager`` backends (no Inductor), so the file runs in a few seconds on one core.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import fx, nn

from autoprec import _torch_compat as tc


class _DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        y = self.lin(x.to(torch.float32)) * scale
        return {"y": y, "x2": x * 2}


@pytest.fixture(scope="module")
def exported():
    """A tiny non-strict export (training IR) with a keyword input and a dict output."""
    model = _DictOut()
    ep = torch.export.export(model, (torch.randn(4, 3),), {"scale": torch.tensor(2.0)}, strict=False)
    return model, ep


@pytest.fixture(scope="module")
def compiled_run():
    """One ``aot_eager`` compile of a function run under GraphModule saved-tensor hooks: the nodes
    the pack hook saw, and Dynamo's graph count and compile seconds before and after."""
    seen: list = []

    def pack(t):
        seen.append(tc.saved_tensor_hook_node())
        return t

    def hook(body):
        g = fx.Graph()
        g.output(g.call_function(body, (g.placeholder("t"),)))
        return fx.GraphModule(nn.Module(), g)

    def f(x, w):
        return (x @ w).sin().sum()

    graphs0, seconds0 = tc.dynamo_unique_graphs(), tc.dynamo_compile_seconds()
    x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(hook(pack), hook(lambda t: t)):
        torch.compile(f, backend="aot_eager", fullgraph=True)(x, w).backward()
    return {"seen": seen, "graphs": (graphs0, tc.dynamo_unique_graphs()),
            "seconds": (seconds0, tc.dynamo_compile_seconds()), "grad": (x.grad, w.grad)}


def test_pytree_is_the_module_export_builds_its_specs_with(exported):
    _, ep = exported
    assert isinstance(ep.call_spec.in_spec, tc.pytree.TreeSpec)
    tree = ((torch.ones(1), 3), {"b": [torch.zeros(2)], "a": None})
    leaves, spec = tc.pytree.tree_flatten(tree)
    assert [type(v) for v in leaves] == [torch.Tensor, int, torch.Tensor, type(None)]  # dict order kept
    assert tc.pytree.tree_leaves(tree) == leaves and tc.pytree.tree_unflatten([0, 1, 2, 3], spec)[1]["a"] == 3
    paths = [tc.pytree.keystr(p) for p, _ in tc.pytree.tree_flatten_with_path(tree)[0]]
    assert paths == ["[0][0]", "[0][1]", "[1]['b'][0]", "[1]['a']"]


def test_tree_flatten_spec_orders_keywords_as_the_export(exported):
    _, ep = exported
    x, scale = torch.randn(4, 3), torch.tensor(3.0)
    leaves = tc.tree_flatten_spec(((x,), {"scale": scale}), ep.call_spec.in_spec)
    assert len(leaves) == 2 and leaves[0] is x and leaves[1] is scale


def test_pytree_info_reads_an_exported_graphs_signature(exported):
    _, ep = exported
    info = tc.pytree_info(ep.module().graph)
    assert info is not None and [str(a) for a in info.orig_args] == ["x", "scale"]
    assert info.out_spec.type is dict and info.out_spec.num_leaves == 2
    assert tc.pytree_info(fx.symbolic_trace(nn.Linear(2, 2)).graph) is None


def test_set_pytree_codegen_gives_a_graph_flat_outputs(exported):
    model, ep = exported
    gm = ep.module()
    info = tc.pytree_info(gm.graph)
    graph = fx.Graph()
    tc.set_pytree_codegen(graph, info._replace(out_spec=None))
    graph.output(graph.graph_copy(gm.graph, {}))
    flat = fx.GraphModule(gm, graph)
    x, scale = torch.randn(4, 3), torch.tensor(2.0)
    out = flat(x, scale=scale)
    assert isinstance(out, (list, tuple)) and len(out) == 2
    rebuilt = tc.pytree.tree_unflatten(list(out), info.out_spec)
    torch.testing.assert_close(rebuilt["y"], model(x, scale=scale)["y"])


def test_detect_fake_mode_finds_the_mode_of_fake_values():
    mode = tc.new_fake_mode()
    fake = mode.from_tensor(torch.randn(2, 3))
    assert tc.detect_fake_mode([fake, 1]) is mode
    assert tc.detect_fake_mode([torch.randn(2)]) is None


def test_new_fake_mode_propagates_shapes_and_takes_real_tensors():
    mode = tc.new_fake_mode(allow_non_fake_inputs=True)
    real_w = torch.randn(5, 3)
    with mode:
        out = mode.from_tensor(torch.randn(4, 3, dtype=torch.bfloat16)) @ real_w.to(torch.bfloat16).t()
    assert out.shape == (4, 5) and out.dtype == torch.bfloat16 and type(out).__name__ == "FakeTensor"


def test_fake_tensor_errors_are_what_fake_tracing_raises():
    dynamic_shape, unsupported = tc.fake_tensor_errors()
    mode = tc.new_fake_mode()
    lib = torch.library.Library("autoprec_compat_test", "DEF")  # an op with no fake kernel
    lib.define("plus_one(Tensor x) -> Tensor")
    lib.impl("plus_one", lambda x: x + 1, "CPU")
    with mode:
        x = mode.from_tensor(torch.randn(4))
        with pytest.raises(dynamic_shape):
            torch.nonzero(x)
        with pytest.raises(unsupported) as e:
            torch.ops.autoprec_compat_test.plus_one(x)
    assert "plus_one" in str(e.value.func)


def test_overload_schema_names_an_ops_arguments():
    schema = tc.overload_schema(torch.ops.aten.dropout.default)
    assert schema.name == "aten::dropout" and [a.name for a in schema.arguments] == ["input", "p", "train"]
    assert tc.overload_schema(torch.ops.aten.dropout) is None  # a packet, not an overload
    assert tc.overload_schema(torch.sin) is None


def test_export_assert_ops_are_what_export_inserts_after_to(exported):
    _, ep = exported
    ops = tc.export_assert_ops()
    assert ops and all(op.name() == "aten::_assert_tensor_metadata" for op in ops)
    assert any(n.target in ops for n in ep.graph.nodes)  # from x.to(torch.float32)


def test_safe_softmax_zeroes_fully_masked_rows():
    x = torch.randn(3, 5)
    x[1] = float("-inf")
    x[2, :2] = float("-inf")
    out = tc.safe_softmax(x, -1)
    assert torch.equal(out[1], torch.zeros(5)) and not out.isnan().any()
    torch.testing.assert_close(out[[0, 2]], torch.softmax(x[[0, 2]], -1))
    torch.testing.assert_close(tc._masked_rows_zero_softmax(x, -1), out)  # the fallback agrees


def test_torch_dispatch_mode_sees_each_aten_op():
    class Count(tc.TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.name())
            return func(*args, **(kwargs or {}))

    with Count() as mode:
        (torch.ones(2) + 1).sum()
    assert "aten::add.Tensor" in mode.ops and "aten::sum" in mode.ops


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "fallback"])
def test_amp_unscale_flags_non_finite_and_scales_in_place(monkeypatch, fused):
    if not fused:
        monkeypatch.delattr(torch, "_amp_foreach_non_finite_check_and_unscale_")
    inv = torch.tensor(0.5)
    grads = [torch.tensor([2.0, 4.0]), torch.tensor([8.0])]
    found = torch.zeros(())
    tc.amp_unscale_(grads, found, inv)
    assert found.item() == 0.0 and grads[0].tolist() == [1.0, 2.0] and grads[1].tolist() == [4.0]
    grads = [torch.tensor([1.0, float("inf")])]
    tc.amp_unscale_(grads, found, inv)
    assert found.item() == 1.0


def test_sparse_values_is_a_view_of_a_coalesced_tensor():
    t = torch.sparse_coo_tensor([[0, 2]], [3.0, 5.0], (4,), check_invariants=True).coalesce()
    tc.sparse_values(t).mul_(2)
    assert t.to_dense().tolist() == [6.0, 0.0, 10.0, 0.0]


def test_top_saved_tensors_hooks_is_the_innermost_pair():
    def pack(t):
        return t

    def unpack(t):
        return t

    assert tc.top_saved_tensors_hooks() is None
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        assert tc.top_saved_tensors_hooks() == (pack, unpack)
    assert tc.top_saved_tensors_hooks() is None


def test_saved_tensor_hook_node_names_the_saved_node_while_compiling(compiled_run):
    nodes = compiled_run["seen"]
    assert nodes and all(isinstance(n, fx.Node) for n in nodes)
    assert {n.name for n in nodes} == {"mm"}  # sin's backward needs its input, the matmul
    assert tc.saved_tensor_hook_node() is None  # outside compilation


def test_child_module_finds_a_module_under_each_of_its_names():
    shared = nn.Linear(2, 2)
    model = nn.Module()
    model.a, model.b = shared, shared
    model.w = nn.Parameter(torch.ones(1))
    assert tc.child_module(model, "a") is shared and tc.child_module(model, "b") is shared
    assert tc.child_module(model, "w") is None and tc.child_module(model, "missing") is None


def test_is_dynamo_optimized_recognises_what_torch_compile_returns():
    def f(x):
        return x + 1

    model = nn.Linear(2, 2)
    assert tc.is_dynamo_optimized(torch.compile(model, backend="eager"))
    assert tc.is_dynamo_optimized(torch.compile(f, backend="eager"))
    assert not tc.is_dynamo_optimized(model) and not tc.is_dynamo_optimized(f)


def test_dynamo_unique_graphs_counts_a_compile(compiled_run):
    before, after = compiled_run["graphs"]
    assert after == before + 1


def test_dynamo_compile_seconds_rises_with_a_compile(compiled_run, monkeypatch):
    before, after = compiled_run["seconds"]
    assert after > before >= 0.0
    monkeypatch.delitem(sys.modules, "torch._dynamo.utils")  # nothing imported Dynamo: nothing compiled
    assert tc.dynamo_compile_seconds() == 0.0


def test_lazy_graph_module_generates_its_code_once_when_materialized(monkeypatch):
    import copy

    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(3, 2), nn.ReLU()))
    x = torch.randn(4, 3)
    calls = []
    real = fx.Graph.python_code
    monkeypatch.setattr(fx.Graph, "python_code", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    lazy = tc.lazy_graph_module(gm, copy.deepcopy(gm.graph))
    lazy.recompile()
    lazy.recompile()  # a pass edited the graph: only marked stale
    assert calls == []
    assert tc.materialize(lazy) is lazy and len(calls) == 1
    torch.testing.assert_close(lazy(x), gm(x))
    assert len(calls) == 1 and lazy.code == gm.code
    assert tc.materialize(gm) is gm  # a plain GraphModule: nothing to do


def test_optimization_hint_is_a_symbolic_sizes_example_value():
    batch = torch.export.Dim("batch", min=2, max=64)
    ep = torch.export.export(nn.Linear(3, 2), (torch.randn(5, 3),), dynamic_shapes=({0: batch},),
                             strict=False)
    x = next(n for n in ep.graph.nodes if n.op == "placeholder" and n.name == "input")
    size = x.meta["val"].shape[0]
    assert isinstance(size, torch.SymInt)
    assert tc.optimization_hint(size) == 5


def test_reuse_invoke_subgraph_schemas_keeps_a_schema_per_compile_and_its_mutation_flags():
    """Inside a compile's tracing context the second call with the same body, identifier and operand
    types gets the same schema; another identifier, or no compile at all, traces again; a body that
    mutates its input is still flagged (the check autograd makes with it)."""
    import importlib

    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autoprec._torch_compat import reuse_invoke_subgraph_schemas

    hop = importlib.import_module("torch._higher_order_ops.invoke_subgraph").invoke_subgraph
    assert reuse_invoke_subgraph_schemas() and reuse_invoke_subgraph_schemas()  # idempotent

    class Double(nn.Module):
        def forward(self, x):
            return (x * 2,)

    class AddInPlace(nn.Module):
        def forward(self, x):
            x.add_(1)
            return (x * 2,)

    body, x = fx.symbolic_trace(Double()), torch.randn(3)
    outside = hop.gen_schema(body, "r", x)
    assert hop.gen_schema(body, "r", x) is not outside  # no compile: nothing kept
    with tracing(TracingContext(FakeTensorMode())):
        first = hop.gen_schema(body, "r", x)
        assert hop.gen_schema(body, "r", x) is first
        assert hop.gen_schema(body, "other", x) is not first
        mutating = hop.gen_schema(fx.symbolic_trace(AddInPlace()), "m", x)
    assert str(first) == str(outside) and not any(a.is_write for a in first.arguments)
    assert [a.is_write for a in mutating.arguments] == [False, False, True]


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_calls_sees_each_implementation_and_restores_it(reentrant):
    import torch.utils.checkpoint as cp

    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    before = (cp.CheckpointFunction, cp._checkpoint_without_reentrant_generator)
    with tc.checkpoint_calls() as seen:
        y = cp.checkpoint(lin, x, use_reentrant=reentrant)
    assert seen == [lin]
    assert (cp.CheckpointFunction, cp._checkpoint_without_reentrant_generator) == before
    y.sum().backward()  # the checkpoint ran as it would: the gradient is the linear's
    torch.testing.assert_close(x.grad, lin.weight.sum(0).expand(2, 3))
