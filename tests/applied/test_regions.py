"""autoprec.applied.regions: repeated blocks outlined into shared compile regions, compiled once,
with the gradients of the flat graph."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import fx

import autoprec
from autoprec.applied.compile import compile_graph
from autoprec.applied.outputs import flat_output_graph
from autoprec.applied.regions import BlockRegion, outline_blocks
from autoprec.metrics import grad_rel_l2
from autoprec.policy import Policy
from autoprec.policy.rule import Rule
from tests.conftest import DRIFT, EXAMPLES

sys.path.insert(0, str(EXAMPLES))
from qwen2_tiny import build_qwen2, make_batch  # noqa: E402

LAYERS = 4


def _qwen(**extra):
    return build_qwen2(hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=64, **extra)


def _flat(model, policy, batch, dynamic=False) -> fx.GraphModule:
    mp = autoprec.apply(model, policy, batch, compile=False, dynamic=dynamic)
    return flat_output_graph(mp.graph_module)[0]


def _loss_and_grads(model, fn, batch):
    for p in model.parameters():
        p.grad = None
    loss = fn(**batch)[0]
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def qwen():
    return _qwen(), make_batch(0, "cpu", batch_size=2, seq_len=16)


def test_layers_of_one_structure_share_one_region_and_compute_the_same(qwen):
    model, batch = qwen
    flat = _flat(model, Policy.default("bf16"), batch)
    out, plan = outline_blocks(flat)
    # Layer 0 reads the fp32 embedding, layers 1..3 the bf16 residual: one region for three.
    assert (plan.blocks, plan.regions, plan.inline, plan.containers) == (3, 1, 1, ("model.layers",))
    assert plan.describe() == "3 of 4 blocks of model.layers in 1 region"
    assert set(plan.region_of) == {"model.layers.1", "model.layers.2", "model.layers.3"}
    regions = [m for m in out.modules() if isinstance(m, BlockRegion)]
    assert len(regions) == 1
    calls = [n for n in out.graph.nodes if n.op == "call_module" and n.target == "autoprec_region_0"]
    assert len(calls) == 3
    # Parameters are shared, not copied; the input graph is untouched.
    assert any(t is model.model.layers[0].mlp.up_proj.weight for t in out.parameters())
    assert not any(n.op == "call_module" and "region" in str(n.target) for n in flat.graph.nodes)
    ref_loss, ref_grads = _loss_and_grads(model, flat, batch)
    loss, grads = _loss_and_grads(model, out, batch)
    assert torch.equal(loss, ref_loss) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads,
                                                                                 strict=True))


def test_dynamo_traces_the_region_once(qwen):
    model, batch = qwen
    out, plan = outline_blocks(_flat(model, Policy.default("bf16"), batch))
    graphs = []

    def backend(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(out, backend=backend, dynamic=False)(**batch)
    (gm,) = graphs
    hops = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    assert len(hops) == plan.blocks == 3
    assert len({n.args[0].target for n in hops}) == 1  # one traced subgraph, called three times


def test_layers_under_other_rules_get_regions_of_their_own(qwen):
    model, batch = qwen
    policy = Policy(default_dtype="bf16",
                    rules=(Rule(module="model.layers.2.*", op_class="matmul", dtype="fp32"),))
    _, plan = outline_blocks(_flat(model, policy, batch))
    # Layer 2 (fp32 matmuls) is unlike any other; layer 1 feeds it, so its output dtype differs
    # from layer 0's; layers 0 and 3 both read an fp32 residual and share a region.
    assert plan.region_of == {"model.layers.0": "autoprec_region_0", "model.layers.3": "autoprec_region_0"}
    assert plan.inline == 2


def test_no_repeated_blocks_leaves_the_graph_as_it_is():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    gm = autoprec.apply(model, Policy.default("bf16"), torch.randn(4, 8), compile=False,
                        dynamic=False).graph_module
    out, plan = outline_blocks(gm)
    assert out is gm and plan.blocks == 0 and plan.describe() == "no repeated blocks (one flat graph)"


@pytest.mark.heavy
def test_regional_compile_has_the_gradients_of_eager_fp32(qwen):
    """Tight: in fp32 the compiled regions must match eager to rounding. torch 2.13's Inductor
    reused buffers wrongly across the calls of one region (gradients 50-80% off) until
    compile_graph set REGION_OPTIONS; this test fails without them (tests/search/test_memory.py's
    WideMLP checks the in-place half)."""
    model, batch = qwen
    flat = _flat(model, Policy.fp32(), batch)
    ref_loss, ref_grads = _loss_and_grads(model, flat, batch)
    torch._dynamo.reset()
    loss, grads = _loss_and_grads(model, compile_graph(flat), batch)
    assert torch.allclose(loss, ref_loss, rtol=DRIFT[torch.float32])
    assert grad_rel_l2(grads, ref_grads) < DRIFT[torch.float32]


@pytest.mark.slow  # two dynamic compiles (31 s)
def test_regional_compile_with_dynamic_shapes_serves_two_lengths():
    model = _qwen()
    batches = [make_batch(0, "cpu", batch_size=2, seq_len=16), make_batch(1, "cpu", batch_size=2, seq_len=12)]
    flat = _flat(model, Policy.fp32(), batches[0], dynamic=True)
    torch._dynamo.reset()
    fn = compile_graph(flat)
    for batch in batches:
        ref_loss, ref_grads = _loss_and_grads(model, flat, batch)
        loss, grads = _loss_and_grads(model, fn, batch)
        assert torch.allclose(loss, ref_loss, rtol=DRIFT[torch.float32])
        assert grad_rel_l2(grads, ref_grads) < DRIFT[torch.float32]


def test_a_graph_with_saved_dtypes_compiles_flat(qwen, caplog):
    """Saved-activation dtypes are not honoured reliably inside a region (measured: unmarked, 1.46x
    the saved bytes; marks read through the region's graph, intermittently non-finite on GPT-2),
    so such a graph is not outlined."""
    model, batch = qwen
    policy = Policy(default_dtype="bf16", rules=(Rule(op_class="matmul", saved="fp8_e5m2"),))
    flat = _flat(model, policy, batch)
    with caplog.at_level("INFO", logger="autoprec"):
        compile_graph(flat)  # lazy: nothing compiles before the first call
        compile_graph(_flat(model, Policy.default("bf16"), batch))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compile:")]
    assert lines[0].startswith("compile: one flat graph (the policy's saved-activation dtypes")
    assert lines[1] == "compile: 3 of 4 blocks of model.layers in 1 region"


def test_outlining_that_fails_falls_back_to_one_flat_graph(qwen, caplog, monkeypatch):
    import autoprec.applied.regions as regions

    def broken(*_a, **_k):
        raise RuntimeError("cycle between blocks")

    monkeypatch.setattr(regions, "fuse_by_partitions", broken)
    model, batch = qwen
    flat = _flat(model, Policy.default("bf16"), batch)
    with caplog.at_level("INFO", logger="autoprec"):
        compile_graph(flat)  # lazy: nothing compiles before the first call
    expected = ("compile: one flat graph (outlining the repeated blocks failed: RuntimeError: "
                "cycle between blocks)")
    assert expected in [r.getMessage() for r in caplog.records]


def test_a_graph_under_a_memory_budget_compiles_flat(qwen, caplog):
    """Under an activation memory budget the graph is compiled flat: the memory fit of
    ``tune --max-memory`` is measured on flat graphs only."""
    model, batch = qwen
    with caplog.at_level("INFO", logger="autoprec"):
        compile_graph(_flat(model, Policy.default("bf16"), batch), activation_memory_budget=0.5)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compile:")]
    assert line.startswith("compile: one flat graph (AOTAutograd's activation memory budget is not measured")


def test_compile_graph_returns_a_handle_that_says_what_it_compiled(qwen):
    """``compile_graph`` returns a CompiledGraph (lazy: nothing compiles here): the graph given, the
    outlined copy torch.compile got, the plan, and the settings; the harness tells it by isinstance."""
    from autoprec.applied.compile import CompiledGraph
    from autoprec.measure import is_compiled

    model, batch = qwen
    flat = _flat(model, Policy.default("bf16"), batch)
    fn = compile_graph(flat)
    assert isinstance(fn, CompiledGraph) and is_compiled(fn) and not is_compiled(flat)
    assert fn.source is flat and fn.target is not flat and fn._orig_mod is fn.target
    assert fn.regions is not None and fn.regions.blocks == 3 and fn.layout == fn.regions.describe()
    assert (fn.dynamic, fn.activation_memory_budget, fn.saved) == (False, 1.0, False)
    assert fn.compile_log.stats()["mode"] == "static" and fn.compile_log.compiles == 0
    low = compile_graph(flat, activation_memory_budget=0.5)
    assert low.target is flat and low.regions is None and low.activation_memory_budget == 0.5
    assert low.layout.startswith("one flat graph (AOTAutograd's activation memory budget")
    module = compile_graph(model, dynamic=True)
    assert module.source is model and module.regions is None and module.compile_log is not None


@pytest.mark.heavy
def test_a_region_body_is_traced_for_its_schema_once_per_compile_not_once_per_call(qwen, monkeypatch):
    """torch 2.13's ``invoke_subgraph`` traces a region's body for its schema at every call under
    autograd (two per block: 8 traces for three blocks, measured with the cache removed);
    ``reuse_invoke_subgraph_schemas`` keeps it in the compile's cache, so the traces do not grow
    with the number of blocks (3 here), and the compiled step computes what the eager graph does."""
    import torch._higher_order_ops.utils as hop_utils
    from torch._inductor.utils import fresh_cache

    from autoprec._torch_compat import reuse_invoke_subgraph_schemas

    model, batch = qwen
    flat = _flat(model, Policy.default("bf16"), batch)
    ref_loss, ref_grads = _loss_and_grads(model, flat, batch)
    traces = []
    materialize = hop_utils.materialize_as_graph
    monkeypatch.setattr(hop_utils, "materialize_as_graph",
                        lambda *a, **k: traces.append(1) or materialize(*a, **k))
    assert reuse_invoke_subgraph_schemas()  # installed (BlockRegion installs it too)
    torch._dynamo.reset()
    with fresh_cache():  # a cache hit would trace nothing
        fn = compile_graph(flat)
        loss, grads = _loss_and_grads(model, fn, batch)
    assert fn.regions.blocks == 3 and 0 < len(traces) <= 3 < 2 * fn.regions.blocks
    assert torch.allclose(loss, ref_loss, rtol=DRIFT[torch.bfloat16])
    assert grad_rel_l2(grads, ref_grads) < DRIFT[torch.bfloat16]
