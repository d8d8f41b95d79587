"""Pass infrastructure: purity, decisions in node.meta, lint, outputs, fp32 accumulation, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoprec._torch_compat import materialize
from autoprec.capture import capture
from autoprec.errors import PassError
from autoprec.nodemeta import meta_of, read_meta
from autoprec.ops import op_name
from autoprec.passes import PassBase, PassManager, PassResult, lowering_passes, run_pipeline
from autoprec.passes.accumulate import AccumulateFp32, accumulate_fp32
from autoprec.passes.assign import AssignDtypes, assign_dtypes
from autoprec.passes.base import clone_graph_module
from autoprec.passes.casts import InsertCasts, insert_casts
from autoprec.passes.verify import Verify, output_dtypes
from autoprec.policy import Policy, Rule
from tests.conftest import RTOL


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 8)
        self.fc = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)

    def forward(self, ids):
        h = self.fc(self.emb(ids))
        return torch.softmax(self.ln(h), -1), ids * 2


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    m = Net()
    ids = torch.randint(0, 32, (2, 5))
    return m, ids, capture(m, (ids,))


def _meta(gm, key):
    return next(read_meta(n) for n in gm.graph.nodes if read_meta(n).key == key)


def test_passes_are_pure(net):
    _m, _ids, gm = net
    before = [(n.name, read_meta(n).copy()) for n in gm.graph.nodes]
    code = gm.code
    r = run_pipeline(gm, Policy.default())
    assert r.graph_module is not gm
    assert gm.code == code
    assert [(n.name, read_meta(n).copy()) for n in gm.graph.nodes] == before
    # same Parameter objects (training updates the user's model)
    assert {id(p) for p in r.graph_module.parameters()} == {id(p) for p in gm.parameters()}


def test_each_pass_lints_and_records_decisions(net):
    _m, _ids, gm = net
    r1 = assign_dtypes(gm, Policy.default())
    r1.graph_module.graph.lint()
    fc = _meta(r1.graph_module, "fc/linear#0")
    assert fc.op_class == "matmul" and fc.dtype == "bf16" and fc.decided_by == "default_dtype"
    assert "GEMM" in fc.reason
    sm = _meta(r1.graph_module, "softmax#0")
    assert sm.op_class == "sensitive" and sm.dtype == "fp32" and sm.decided_by == "rule"
    assert "exp" in sm.reason
    emb = _meta(r1.graph_module, "emb/embedding#0")
    assert emb.op_class == "follow" and emb.decided_by.startswith("placement:")
    mul = _meta(r1.graph_module, "mul#0")  # ids * 2: integer
    assert mul.op_class == "nonfloat" and mul.dtype is None
    r2 = insert_casts(r1.graph_module)
    r2.graph_module.graph.lint()
    r3 = accumulate_fp32(r2.graph_module, Policy.default())
    r3.graph_module.graph.lint()


def test_outputs_keep_dtype_and_ints_never_cast(net):
    _m, ids, gm = net
    for policy in (Policy.default(), Policy.default("fp16"), Policy(default_dtype="bf16")):
        low = run_pipeline(gm, policy).graph_module
        probs, ids2 = low(ids)
        assert probs.dtype == torch.float32 and ids2.dtype == torch.int64
        assert torch.equal(ids2, ids * 2)
        for n in low.graph.nodes:
            if read_meta(n).inserted_cast:
                assert n.args[0].meta["val"].dtype.is_floating_point, n.format_node()


def test_node_rule_on_nonfloat_node_is_rejected(net):
    _m, _ids, gm = net
    policy = Policy(default_dtype="bf16", rules=(Rule(node="mul#0", dtype="fp16"),))
    with pytest.raises(PassError, match=r"assign_dtypes.*mul#0.*non-float"):
        run_pipeline(gm, policy)


def test_node_rule_wins(net):
    _m, _ids, gm = net
    policy = Policy(default_dtype="bf16", rules=(Rule(op_class="sensitive", dtype="fp32"),
                                                  Rule(node="softmax#0", dtype="bf16")))
    r = run_pipeline(gm, policy)
    assert _meta(r.graph_module, "softmax#0").dtype == "bf16"
    assert _meta(r.graph_module, "ln/layer_norm#0").dtype == "fp32"


def test_unknown_op_warns_once_and_follows():
    from torch import fx

    from autoprec import ops

    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(2)
    n = g.call_function(torch.ops.aten.special_bessel_j0.default, (x,))
    n.meta["val"] = torch.empty(2)
    ops._warned.discard("special_bessel_j0")
    with pytest.warns(UserWarning, match="special_bessel_j0"):
        assert ops.classify(n) == "follow"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ops.classify(n) == "follow"


class _Transposes(nn.Module):
    def forward(self, x):
        return (x.T @ x.mT).swapdims(0, 1).broadcast_to(2, 4, 4).sum()


def test_transposes_and_broadcasts_are_known_data_movement():
    """`.T` (aten.numpy_T), `.mT`, swapdims and broadcast_to are in the op table: no unknown-op
    warning, classified as data movement (follow)."""
    import warnings

    from autoprec import ops

    gm = capture(_Transposes(), (torch.randn(4, 4),))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        classes = {op_name(n): ops.classify(n) for n in gm.graph.nodes if n.op == "call_function"}
    assert classes == {"numpy_T": "follow", "mT": "follow", "matmul": "matmul", "swapdims": "follow",
                       "broadcast_to": "follow", "sum": "sensitive"}


class _Vectors(nn.Module):
    """Weight normalisation (``nn.utils.parametrizations.weight_norm``), mv, dot and vdot: they were
    unknown ops, treated as elementwise ``follow`` with a warning."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.utils.parametrizations.weight_norm(nn.Linear(4, 4))

    def forward(self, x):
        h = self.fc(x)
        return torch.mv(h, x[0]).sum() + torch.dot(x[0], x[1]) + torch.vdot(x[1], x[2])


def test_weight_norm_and_vector_products_are_known():
    import warnings

    from autoprec import ops

    gm = capture(_Vectors(), (torch.randn(4, 4),))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        classes = {op_name(n): ops.classify(n) for n in gm.graph.nodes if n.op == "call_function"}
    assert classes["mv"] == "matmul"
    assert classes["dot"] == classes["vdot"] == "sensitive"
    assert classes.get("_weight_norm", classes.get("_weight_norm_interface")) == "sensitive", classes


class Summer(nn.Module):
    def forward(self, x):
        return (x * 1.0).sum(-1), (x * 1.0).var(-1)


@pytest.mark.parametrize("low", ["bf16", "fp16"])
def test_fp32_accumulation_of_lowered_reductions(low):
    """C06 style: summing 4096 copies of 0.01 in a low dtype stalls; fp32 accumulation does not."""
    x = torch.full((2, 4096), 0.01)
    gm = capture(Summer(), (x,))
    lowered = Policy(default_dtype=low)  # no rules: sum/var are lowered too
    r = run_pipeline(gm, lowered)
    assert r.stats["accumulate_fp32"] == 2
    s, v = r.graph_module(x)
    torch_dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[low])
    ref = torch.tensor(0.01, dtype=torch_dtype).float() * 4096
    # the result is the exact fp32 sum of the low-precision inputs, rounded once to `low`
    torch.testing.assert_close(s, ref.expand(2), rtol=RTOL[torch_dtype], atol=0)
    assert torch.all(v.abs() < 1e-6)
    # accumulate="none" leaves the reduction in the low dtype
    r_none = run_pipeline(gm, Policy(default_dtype=low, accumulate="none"))
    assert r_none.stats["accumulate_fp32"] == 0


def test_accumulate_rewrite_shape(net):
    x = torch.randn(3, 64)
    gm = capture(Summer(), (x,))
    r = run_pipeline(gm, Policy(default_dtype="bf16"))
    sums = [n for n in r.graph_module.graph.nodes if read_meta(n).op == "sum"]
    assert len(sums) == 1 and sums[0].kwargs.get("dtype") == torch.float32
    assert read_meta(sums[0]).accumulate == "fp32"
    back = list(sums[0].users)
    assert len(back) == 1 and back[0].kwargs["dtype"] == torch.bfloat16
    vars_ = [n for n in r.graph_module.graph.nodes if read_meta(n).op == "var"]
    assert vars_[0].args[0].kwargs["dtype"] == torch.float32  # var's input upcast


def test_unknown_modes_rejected(net):
    _m, _ids, gm = net
    with pytest.raises(ValueError, match="mincut"):
        run_pipeline(gm, Policy.default(), placement="best")
    with pytest.raises(ValueError, match="strict"):
        run_pipeline(gm, Policy.default(), constants="ignore")


class TwoLow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.b(h * 0.5) + h


def test_two_low_dtypes_in_one_policy():
    """fp16 for module a, bf16 elsewhere: follow nodes take a low dtype of their neighbours,
    every edge is consistent (verify) and the result matches fp32."""
    torch.manual_seed(0)
    m = TwoLow()
    x = torch.randn(4, 8)
    gm = capture(m, (x,))
    policy = Policy(default_dtype="bf16", rules=(Rule(module="a", op_class="matmul", dtype="fp16"),))
    r = run_pipeline(gm, policy)
    d = {read_meta(n).key: read_meta(n).dtype for n in r.graph_module.graph.nodes
         if read_meta(n).key is not None}
    assert d["a/linear#0"] == "fp16" and d["b/linear#0"] == "bf16"
    assert d["relu#0"] in ("fp16", "bf16")
    for n in r.graph_module.graph.nodes:
        if read_meta(n).inserted_cast:
            assert read_meta(n).decided_by == "insert_casts"
    torch.testing.assert_close(r.graph_module(x), m(x), rtol=3e-2, atol=3e-2)  # fp16 and bf16 roundings


# --- the pass list and its runner (issue 11) ---------------------------------------------------


class _Raises(PassBase):
    name = "raises"

    def __init__(self, exc: Exception, in_ensures: bool = False) -> None:
        self.exc, self.in_ensures = exc, in_ensures

    def call(self, gm):
        if not self.in_ensures:
            raise self.exc
        return PassResult(gm, False)

    def ensures(self, gm):
        raise self.exc


class _BreaksLint(PassBase):
    name = "breaks_lint"

    def call(self, gm):
        gm = clone_graph_module(gm)
        out = next(n for n in gm.graph.nodes if n.op == "output")
        first = next(n for n in gm.graph.nodes if n.op == "call_function")
        first.args = (out,) + tuple(first.args[1:])  # uses a node defined after it
        return PassResult(gm, True)


def test_runner_names_the_failing_pass_and_node(net):
    """A pass whose result breaks its post-condition: the runner raises PassError naming the
    pass and the node (here: insert_casts did nothing, so fc reads fp32 in bf16)."""
    _m, _ids, gm = net

    class NoCasts(InsertCasts):
        def call(self, gm):
            return PassResult(clone_graph_module(gm), False)

    policy = Policy(default_dtype="bf16")
    with pytest.raises(PassError, match=r"^\[insert_casts\] node fc/linear#0 \(.*\): reads input embedding "
                       r"\(fp32\) in bf16 with no cast"):
        PassManager([AssignDtypes(policy), NoCasts()])(gm)


@pytest.mark.parametrize("which", ["assign_dtypes", "accumulate_fp32", "verify"])
def test_runner_checks_each_post_condition(which):
    """Each pass's post-condition runs after it: a pass that skips its work is caught, named."""
    x = torch.randn(3, 64)
    gm = capture(Summer(), (x,))
    policy = Policy(default_dtype="bf16")

    class Unassigned(AssignDtypes):
        def call(self, gm):
            r = super().call(gm)
            first = next(n for n in r.graph_module.graph.nodes if n.op == "call_function")
            meta_of(first).dtype = None
            return r

    class NoAccumulate(AccumulateFp32):
        def call(self, gm):
            return PassResult(clone_graph_module(gm), False)

    class NoPropagation(Verify):
        def call(self, gm):
            return PassResult(gm, False)

    passes = {"assign_dtypes": [Unassigned(policy)],
              "accumulate_fp32": [AssignDtypes(policy), InsertCasts(), NoAccumulate(policy)],
              "verify": [AssignDtypes(policy), InsertCasts(), AccumulateFp32(policy),
                         NoPropagation(output_dtypes(gm))]}[which]
    message = {"assign_dtypes": r"node mul#0 .*float node left without a dtype",
               "accumulate_fp32": r"node sum#0 .*reduction still accumulates in a low dtype",
               "verify": r"node cast\(x\)->bf16 .*assigned bf16 but computes fp32"}[which]
    with pytest.raises(PassError, match=rf"^\[{which}\] {message}"):
        PassManager(passes)(gm)


@pytest.mark.parametrize("in_ensures", [False, True])
def test_runner_wraps_other_exceptions(net, in_ensures):
    """A non-PassError raised in a pass (or its post-condition) becomes a PassError naming the
    pass, chained from the original."""
    _m, _ids, gm = net
    boom = RuntimeError("boom")
    with pytest.raises(PassError, match=r"^\[raises\] .*RuntimeError: boom") as info:
        PassManager([AssignDtypes(Policy.default()), _Raises(boom, in_ensures)])(gm)
    assert info.value.__cause__ is boom


def test_runner_lints_after_each_pass_and_keeps_pass_errors(net):
    _m, _ids, gm = net
    with pytest.raises(PassError, match=r"^\[breaks_lint\] graph.lint\(\) failed after this pass"):
        PassManager([_BreaksLint()])(gm)
    own = PassError("[raises] node x: already named")
    with pytest.raises(PassError) as info:
        PassManager([_Raises(own)])(gm)
    assert info.value is own


def test_lowering_lints_once_per_pass(net, monkeypatch):
    """graph.lint() runs once after each pass (the runner's), not again inside verify."""
    _m, _ids, gm = net
    calls = []
    real = torch.fx.Graph.lint
    monkeypatch.setattr(torch.fx.Graph, "lint", lambda self: calls.append(1) or real(self))
    run_pipeline(gm, Policy.default())
    assert len(calls) == len(lowering_passes(gm, Policy.default())) == 6


@pytest.mark.parametrize("policy", [Policy.default(), Policy.default("fp16"), Policy(default_dtype="bf16"),
                                    Policy(default_dtype="bf16", accumulate="none")])
def test_prefix_then_rest_equals_whole_list(policy):
    """manager[k:].resume(manager[:k](gm)) gives the same graph code and stats as manager(gm),
    for every split point (the search runs assign_dtypes alone, then the rest)."""
    x = torch.randn(3, 64)
    gm = capture(Summer(), (x,))
    whole = run_pipeline(gm, policy)
    manager = lowering_passes(gm, policy)
    assert manager.names == ["assign_dtypes", "insert_casts", "accumulate_fp32", "lower_fp8",
                             "math_attention", "verify"]
    for k in range(len(manager) + 1):
        head = manager[:k](gm)
        part = manager[k:].resume(head)
        assert part.graph_module.code == whole.graph_module.code, k
        assert part.stats == whole.stats and part.modified == whole.modified, k
    assert set(whole.stats) == {"casts", "cast_bytes", "placed", "constants_fp32", "constants_clamped",
                                "accumulate_fp32", "accumulate_casts", "fp8_matmuls", "math_attention",
                                "saved_low"}


@pytest.mark.parametrize("policy", [Policy(default_dtype="bf16"),
                                    Policy(default_dtype="fp16", accumulate="none")])
def test_runner_copies_the_callers_graph_once_and_writes_its_own_copy(policy, monkeypatch):
    """The first transforming pass copies; the later ones write into that copy (``writable``), and
    with ``owned=True`` into the caller's graph itself. The graph is what passes that each copy
    make, and a graph the caller keeps is left as it was."""
    import autoprec.passes.base as base

    gm = capture(Summer(), (torch.randn(3, 64),))
    manager = lowering_passes(gm, policy)
    each = gm  # every pass on its own copies its input, as called outside a runner
    for p in manager.passes:
        each = p.call(each).graph_module
    clones = []
    real = base.clone_graph_module
    monkeypatch.setattr(base, "clone_graph_module", lambda g: clones.append(g) or real(g))
    code, metas = gm.code, [repr(read_meta(n)) for n in gm.graph.nodes]
    whole = manager(gm)
    assert clones == [gm] and whole.graph_module is not gm
    assert gm.code == code and [repr(read_meta(n)) for n in gm.graph.nodes] == metas
    assert whole.graph_module.code == materialize(each).code
    head = manager[:1](gm)
    kept = head.graph_module.code
    clones.clear()
    assert manager[1:].resume(head).graph_module.code == whole.graph_module.code
    assert len(clones) == 1 and head.graph_module.code == kept  # the caller's head: copied
    clones.clear()
    owned = manager[1:].resume(head, owned=True)
    assert clones == [] and owned.graph_module is head.graph_module  # given away: written in place
    assert owned.graph_module.code == whole.graph_module.code


def test_a_head_without_code_resumes_to_the_same_module(monkeypatch):
    """``code=False`` (the search's fingerprint reads the assigned graph only) generates no Python
    code; the rest of the passes, resumed from that head, generate it once and give the whole
    list's module, which computes what the whole list's computes."""
    import autoprec.passes.manager as manager_mod

    x = torch.randn(3, 64)
    gm = capture(Summer(), (x,))
    policy = Policy(default_dtype="bf16")
    whole = run_pipeline(gm, policy)
    made = []
    monkeypatch.setattr(manager_mod, "materialize", lambda g: made.append(g) or materialize(g))
    manager = lowering_passes(gm, policy)
    head = manager[:1](gm, code=False)
    assert made == []
    rest = manager[1:].resume(head, owned=True)
    assert made == [rest.graph_module]
    assert rest.graph_module.code == whole.graph_module.code
    torch.testing.assert_close(rest.graph_module(x), whole.graph_module(x), rtol=0, atol=0)


def test_bad_modes_rejected_when_the_list_is_built(net):
    """Mode errors stay ValueError (not wrapped): they are raised building the pass, before any runs."""
    _m, _ids, gm = net
    with pytest.raises(ValueError, match="mincut"):
        lowering_passes(gm, Policy.default(), placement="best")
    with pytest.raises(ValueError, match="strict"):
        AssignDtypes(Policy.default(), constants="ignore")
    with pytest.raises(TypeError):
        lowering_passes(gm, Policy.default())[0]
