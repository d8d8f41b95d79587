"""Compute dtype separate from storage dtype (schema 2): cast structure, numerics, fp8 lowering."""

from __future__ import annotations

import pytest
import torch

from autoprec.capture import capture
from autoprec.errors import PassError
from autoprec.nodemeta import read_meta
from autoprec.passes import assign_dtypes, run_pipeline
from autoprec.policy import Policy, Rule
from autoprec.search.objective import policy_fingerprint

BF16_FP32 = Policy(default_dtype="bf16", rules=(Rule(op_class="sensitive", dtype="fp32"),
                                                Rule(op_class="matmul", dtype="bf16", compute="fp32")))


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 16)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def lowered(policy: Policy, model: torch.nn.Module | None = None):
    torch.manual_seed(0)
    m = model or MLP()
    x = torch.randn(4, 32)
    return m, x, run_pipeline(capture(m, (x,)), policy).graph_module


def by_key(gm, suffix: str):
    return next(n for n in gm.graph.nodes if (read_meta(n).key or "").endswith(suffix))


def test_compute_fp32_storage_bf16_cast_structure():
    """Every input of the matmul is rounded through bf16 then read in fp32; the output is stored
    back in bf16 by one cast that is its only consumer."""
    _, _, gm = lowered(BF16_FP32)
    up = by_key(gm, "up/linear#0")
    meta = read_meta(up)
    assert (meta.dtype, meta.storage, meta.compute) == ("fp32", "bf16", "fp32")
    for a in up.args:  # x, weight, bias: each an fp32 cast of a bf16 value
        assert a.target is torch.ops.aten._to_copy.default and a.kwargs["dtype"] == torch.float32
        src = a.args[0]
        assert src.meta["val"].dtype == torch.bfloat16, src.format_node()
    (store,) = up.users
    assert store.kwargs["dtype"] == torch.bfloat16 and read_meta(store).inserted_cast
    assert up.meta["val"].dtype == torch.float32


def test_compute_fp32_numerics_match_bf16_kernel_semantics():
    """The output equals float64 arithmetic on bf16-rounded inputs/weights, rounded to bf16 once
    (up to fp32 accumulation error), and agrees with the native bf16 policy within bf16 rounding."""
    m, x, gm = lowered(BF16_FP32)
    out = gm(x)
    r = lambda t: t.to(torch.bfloat16).double()  # noqa: E731
    h = (r(x) @ r(m.up.weight).T + r(m.up.bias)).to(torch.bfloat16)
    h = torch.nn.functional.gelu(h).double()  # gelu is placed in bf16 (follow)
    h = r(h)
    ref = (h @ r(m.down.weight).T + r(m.down.bias)).to(torch.bfloat16).float()
    torch.testing.assert_close(out, ref, rtol=2 ** -7, atol=1e-3)  # one bf16 ulp (eps 2^-7)
    _, _, native = lowered(Policy.default("bf16"))
    torch.testing.assert_close(out, native(x), rtol=2 ** -6, atol=2e-2)  # two bf16 ulps
    fp32 = m(x)
    rel = ((out - fp32).norm() / fp32.norm()).item()
    assert 0 < rel < 2e-2, rel  # really rounded (not fp32), and only by bf16 rounding


def test_compute_fp32_trains_with_fp32_gradients():
    m, x, gm = lowered(BF16_FP32)
    gm(x).square().mean().backward()
    ref = MLP()
    ref.load_state_dict(m.state_dict())
    ref(x).square().mean().backward()
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32
        rel = ((p.grad - q.grad).norm() / q.grad.norm()).item()
        assert rel < 3e-2, (name, rel)


def test_fingerprint_tells_compute_from_native():
    torch.manual_seed(0)
    m, x = MLP(), torch.randn(4, 32)
    gm = capture(m, (x,))
    a = policy_fingerprint(assign_dtypes(gm, Policy.default("bf16")).graph_module)
    b = policy_fingerprint(assign_dtypes(gm, BF16_FP32).graph_module)
    assert a != b


def test_fp8_rule_lowers_linears_to_the_fp8_kernel():
    pol = Policy(default_dtype="fp32", rules=(Rule(op_class="matmul", dtype="fp8_e4m3"),))
    m, x, gm = lowered(pol)
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count("autoprec.fp8_linear.default") == 2 and "aten.linear.default" not in targets
    out = gm(x)
    ref = m(x)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert 1e-4 < rel < 0.1, rel  # fp8 rounding, not fp32 and not garbage
    out.square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())


class Attn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, q):
        return torch.nn.functional.scaled_dot_product_attention(self.proj(q), q, q)


def test_fp8_class_rule_leaves_ops_without_fp8_kernel_in_storage_dtype():
    torch.manual_seed(0)
    q = torch.randn(2, 4, 8, 16)
    gm = capture(Attn(), (q,))
    pol = Policy(default_dtype="fp32", rules=(Rule(op_class="matmul", dtype="bf16", compute="fp8_e4m3"),))
    out = run_pipeline(gm, pol).graph_module
    sdpa = by_key(out, "scaled_dot_product_attention#0")
    assert read_meta(sdpa).compute is None and "no fp8 kernel" in read_meta(sdpa).reason
    assert read_meta(sdpa).dtype == "bf16"
    assert any(str(n.target) == "autoprec.fp8_linear.default" for n in out.graph.nodes)
    key = read_meta(sdpa).key
    with pytest.raises(PassError, match="no fp8 kernel"):
        run_pipeline(gm, Policy(default_dtype="fp32", rules=(Rule(node=key, dtype="fp8_e4m3"),)))


def test_saved_is_recorded_where_it_differs_from_the_stored_dtype():
    torch.manual_seed(0)
    m, x = MLP(), torch.randn(4, 32)
    pol = Policy(default_dtype="fp32", rules=(Rule(op_class="follow", saved="bf16"),
                                              Rule(node="down/linear#0", saved="fp32")))
    gm = assign_dtypes(capture(m, (x,)), pol).graph_module
    gelu = by_key(gm, "gelu#0")
    assert read_meta(gelu).saved == "bf16" and read_meta(gelu).dtype == "fp32"
    assert read_meta(by_key(gm, "down/linear#0")).saved is None  # saved as stored: nothing to do
    assert read_meta(by_key(gm, "up/linear#0")).saved is None


def test_report_labels_storage_compute_and_saved():
    from autoprec.search.report import dtype_map

    torch.manual_seed(0)
    m, x = MLP(), torch.randn(4, 32)
    gm = capture(m, (x,))
    assert dtype_map(gm, BF16_FP32)["up"] == {"matmul": "bf16:fp32"}
    fp8 = Policy(default_dtype="fp32", rules=(Rule(op_class="matmul", dtype="bf16", compute="fp8_e4m3"),
                                              Rule(op_class="follow", saved="bf16")))
    dm = dtype_map(gm, fp8)
    assert dm["up"] == {"matmul": "bf16:fp8_e4m3"} and dm[""]["follow"] == "bf16"
    saved = Policy(default_dtype="fp32", rules=(Rule(op_class="follow", saved="fp8_e5m2"),))
    assert dtype_map(gm, saved)[""]["follow"] == "fp32 saved fp8_e5m2"


class Masked(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.proj(x)
        return y.masked_fill(x > 1.0, -1e9).softmax(-1)


@pytest.mark.parametrize("storage", ["fp32", "bf16"])
def test_mask_fill_constant_is_clamped_for_a_low_compute_dtype(storage):
    """C03 with compute separate from storage: a -1e9 fill on a node computing in fp16 is clamped
    to fp16's range (eager would raise 'value cannot be converted to type c10::Half')."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    pol = Policy(default_dtype="fp32", rules=(Rule(op_class="follow", dtype=storage, compute="fp16"),))
    gm = run_pipeline(capture(Masked(), (x,)), pol).graph_module
    fill = by_key(gm, "masked_fill#0")
    assert read_meta(fill).constants_clamped and read_meta(fill).dtype == "fp16"
    out = gm(x)
    assert torch.isfinite(out).all()


def test_saved_on_a_compute_node_moves_to_its_store_cast():
    torch.manual_seed(0)
    m, x = MLP(), torch.randn(4, 32)
    pol = Policy(default_dtype="bf16", rules=(*BF16_FP32.rules, Rule(op_class="matmul", saved="fp8_e5m2")))
    gm = run_pipeline(capture(m, (x,)), pol).graph_module
    up = by_key(gm, "up/linear#0")
    (store,) = up.users
    assert read_meta(up).saved is None and read_meta(store).saved == "fp8_e5m2"


def test_gpt2_conv1d_addmm_lowers_to_fp8():
    """GPT-2's Conv1D layers are addmm(bias, x, W[K, N]): an fp8 matmul rule reaches them too."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=16,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).train()
    ids = torch.randint(0, 64, (2, 16))
    gm = capture(model, {"input_ids": ids, "labels": ids})
    pol = Policy(default_dtype="fp32", rules=(Rule(op_class="matmul", dtype="fp8_e4m3"),))
    out = run_pipeline(gm, pol).graph_module
    targets = [str(n.target) for n in out.graph.nodes if n.op == "call_function"]
    # 4 Conv1D + head
    assert targets.count("autoprec.fp8_linear.default") == 5 and "aten.addmm.default" not in targets


class SplitMSE(torch.nn.Module):
    """Ops with several outputs: ``split`` (a fused QKV projection's) and the
    ``broadcast_tensors`` of ``mse_loss``'s decomposition, each read through ``getitem``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x, y):
        q, k, v = self.qkv(x).split(16, dim=-1)
        return torch.nn.functional.mse_loss(q * k + v, y)


def test_compute_of_an_op_with_several_outputs_is_stored_back_after_each_getitem():
    """A list output is no tensor to cast: with ``follow`` computing in fp32 over bf16 storage,
    each float output of ``split``/``broadcast_tensors`` is stored back in bf16 after the getitem
    that reads it (it used to cast the list and fail verification); the loss is float64 arithmetic
    on bf16-rounded values within bf16 rounding."""
    policy = Policy(default_dtype="bf16", rules=(Rule(op_class="sensitive", dtype="fp32"),
                                                 Rule(op_class="follow", dtype="bf16", compute="fp32")))
    torch.manual_seed(0)
    m, x, y = SplitMSE(), torch.randn(4, 16), torch.randn(4, 16)
    gm = run_pipeline(capture(m, (x, y)), policy).graph_module
    multi = [n for n in gm.graph.nodes
             if n.op == "call_function" and isinstance(n.meta.get("val"), (list, tuple))]
    assert {str(n.target) for n in multi} >= {"aten.split.Tensor", "aten.broadcast_tensors.default"}
    for n in multi:
        assert read_meta(n).dtype == "fp32"
        for g in n.users:
            (store,) = g.users
            assert store.kwargs["dtype"] == torch.bfloat16 and read_meta(store).inserted_cast
            assert (read_meta(g).dtype, read_meta(g).storage) == ("fp32", "bf16")
    loss = gm(x, y)
    r = lambda t: t.to(torch.bfloat16).double()  # noqa: E731
    q, k, v = r(r(x) @ r(m.qkv.weight).T + r(m.qkv.bias)).split(16, dim=-1)
    ref = (r(r(q * k) + v) - r(y)).square().mean()
    torch.testing.assert_close(loss.double(), ref, rtol=2 ** -6, atol=1e-3)
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in m.parameters())
