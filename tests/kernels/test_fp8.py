"""autoprec.kernels.fp8 (torchao.float8's recipes): forward and backward against float64 products on
the same fp8-quantised operands, error against fp32 per recipe, tracing (Inductor, torch.export),
scale edge cases and argument errors. The side-by-side check against torchao's own Float8Linear is
``tests/kernels/test_fp8_torchao.py``.

Tolerances against float64 on the same quantised operands (what is left is the kernel's own
rounding): tensorwise fp32 outputs accumulate in fp32 over K terms and round once, within 1e-5 of
the largest reference value (K * 2^-24 ~ 2e-6 for K = 40 at worst); the rowwise recipes' fp32
products are rounded to bf16 by torchao (``addmm_float8_unwrapped``: torch's rowwise ``_scaled_mm``
has no fp32 output), and bf16 outputs round twice (product, bias add), 2^-9 each: 2^-8 of the
largest value. A high-precision grad_W (``rowwise_with_gw_hp``) is an fp32 product: 1e-5.

Against fp32 (``nn.Linear`` 256x256, 64 rows): e4m3 keeps 3 mantissa bits, a relative rounding
error uniform in +-2^-4 (RMS 3.6e-2) per operand; measured relative L2 error 3.5e-2 to 3.7e-2 (all
forwards, rowwise grads), 5.9e-2 (tensorwise grads, e5m2: 2 bits), 0 (rowwise_with_gw_hp's grad_W).
"""

from __future__ import annotations

import pytest
import torch

from autoprec.kernels.fp8 import (
    E4M3,
    E5M2,
    RECIPES,
    _linear,
    amax_scale,
    dequantize,
    fp8_linear,
    fp8_supported,
    quantize,
    reference_linear,
)

pytest.importorskip("torchao.float8")

FP32_TOL = 1e-5
BF16_TOL = 2.0**-8
#: Tolerance of the fp32 forward / grads per recipe (see the module docstring).
OUT_TOL = {"tensorwise": FP32_TOL, "rowwise": BF16_TOL, "rowwise_with_gw_hp": BF16_TOL}
#: Bands of relative L2 error against fp32 per recipe: (output, grad_x, grad_W) as (low, high).
FP32_BANDS = {
    "tensorwise": ((1e-2, 6e-2), (2e-2, 1e-1), (2e-2, 1e-1)),
    "rowwise": ((1e-2, 6e-2), (1e-2, 6e-2), (1e-2, 6e-2)),
    "rowwise_with_gw_hp": ((1e-2, 6e-2), (1e-2, 6e-2), (0.0, 1e-6)),
}


def _close(got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """``got`` within ``tol`` of float64 ``ref``, relative to ref's largest magnitude."""
    err = (got.double() - ref).abs().max().item()
    assert err <= tol * ref.abs().max().item(), (err, ref.abs().max().item())


def _problem(dtype=torch.float32, shape=(2, 7, 40), n=24, seed=0):
    """x [B, T, K] with K = 40 and M = 14 not multiples of 16, weight, bias."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(n, shape[-1], generator=g) / 6).to(dtype).requires_grad_()
    b = torch.randn(n, generator=g).to(dtype).requires_grad_()
    return x, w, b


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_matches_float64_on_quantised_inputs(recipe, dtype):
    x, w, b = _problem(dtype)
    tol = OUT_TOL[recipe] if dtype == torch.float32 else BF16_TOL
    out = fp8_linear(x, w, b, recipe)
    assert out.shape == (2, 7, 24) and out.dtype == dtype
    _close(out, reference_linear(x.detach(), w.detach(), b.detach(), recipe), tol)
    _close(fp8_linear(x, w, None, recipe), reference_linear(x.detach(), w.detach(), None, recipe), tol)


def _q(t: torch.Tensor, dtype: torch.dtype, gran: str, dim: int, pow2: bool) -> torch.Tensor:
    return dequantize(*quantize(t, dtype, gran, dim=dim, round_pow2=pow2))


def _reference_grads(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, recipe: str):
    """float64 grads from the recipe's casts (torchao/float8/config.py ``from_recipe_name``): each
    operand quantised along its product's inner dimension (rowwise) or whole (tensorwise)."""
    g2, x2 = g.reshape(-1, w.shape[0]), x.reshape(-1, w.shape[1])
    if recipe == "tensorwise":
        gx = _q(g2, E5M2, "tensorwise", -1, False) @ _q(w, E4M3, "tensorwise", 0, False)
        gw = _q(g2, E5M2, "tensorwise", 0, False).t() @ _q(x2, E4M3, "tensorwise", 0, False)
    elif recipe == "rowwise":
        gx = _q(g2, E4M3, "rowwise", -1, True) @ _q(w, E4M3, "rowwise", 0, True)
        gw = _q(g2, E4M3, "rowwise", 0, True).t() @ _q(x2, E4M3, "rowwise", 0, True)
    else:
        gx = _q(g2, E4M3, "rowwise", -1, True) @ _q(w, E4M3, "tensorwise", 0, True)
        gw = g2.double().t() @ x2.double()
    return gx.reshape(x.shape), gw, g2.double().sum(0)


@pytest.mark.parametrize("recipe", RECIPES)
def test_backward_matches_float64_on_quantised_grad_output(recipe):
    x, w, b = _problem()
    g = torch.randn(2, 7, 24, generator=torch.Generator().manual_seed(1)) * 1e-3
    fp8_linear(x, w, b, recipe).backward(g)
    gx, gw, gb = _reference_grads(g, x.detach(), w.detach(), recipe)
    assert x.grad.dtype == w.grad.dtype == b.grad.dtype == torch.float32
    _close(x.grad, gx, OUT_TOL[recipe])
    _close(w.grad, gw, FP32_TOL if recipe == "rowwise_with_gw_hp" else OUT_TOL[recipe])
    _close(b.grad, gb, FP32_TOL)


@pytest.mark.parametrize("recipe", RECIPES)
def test_error_vs_fp32_per_recipe(recipe):
    """An nn.Linear-sized random problem against fp32, forward and both grads (module docstring)."""
    lin = torch.nn.Linear(256, 256)
    x, g = torch.randn(64, 256), torch.randn(64, 256)
    xr = x.clone().requires_grad_()
    lin(xr).backward(g)
    ref = (lin(x).detach(), xr.grad, lin.weight.grad)
    xo, w = x.clone().requires_grad_(), lin.weight.detach().clone().requires_grad_()
    out = fp8_linear(xo, w, lin.bias.detach(), recipe)
    out.backward(g)
    for name, got, want, (lo, hi) in zip(("output", "grad_x", "grad_W"), (out, xo.grad, w.grad), ref,
                                          FP32_BANDS[recipe]):
        rel = ((got - want).norm() / want.norm()).item()
        assert lo <= rel < hi, (name, rel)


def test_backward_skips_frozen_weight_and_keeps_input_dtypes():
    x, w, _ = _problem(torch.bfloat16)
    w.requires_grad_(False)
    fp8_linear(x, w, None, "rowwise").float().sum().backward()
    assert w.grad is None and x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad).all()


def test_rowwise_keeps_small_rows_that_tensorwise_flushes():
    """One row 1e5x larger than the rest: a tensorwise scale pushes the small rows below e4m3's
    smallest subnormal (2^-9); rowwise scales each row to itself."""
    x, w = torch.randn(16, 32), torch.randn(16, 32)
    x[0] *= 1e5
    ref = (x @ w.t())[1:]
    errs = {r: ((fp8_linear(x, w, None, r)[1:] - ref).norm() / ref.norm()).item() for r in RECIPES}
    assert errs["rowwise"] < 0.1 < errs["tensorwise"] and errs["rowwise_with_gw_hp"] < 0.1, errs


def test_scale_of_zeros_is_finite_and_amax_maps_to_fp8_max():
    z = torch.zeros(4, 8)
    for dim in (None, -1):
        for pow2 in (False, True):
            s = amax_scale(z, E4M3, dim, pow2)
            assert s.dtype == torch.float32 and torch.isfinite(s).all()
    q, s = quantize(z, E4M3, "rowwise")
    assert s.shape == (4, 1) and not torch.isnan(q.float()).any() and (q.float() == 0).all()
    for recipe in RECIPES:
        zr = z.clone().requires_grad_()
        out = fp8_linear(zr, torch.randn(8, 8), None, recipe)
        out.sum().backward()
        assert (out == 0).all() and torch.isfinite(zr.grad).all()
    t = torch.randn(5, 9)
    for dtype in (E4M3, E5M2):
        q, _ = quantize(t, dtype, "tensorwise")
        assert q.float().abs().max().item() == torch.finfo(dtype).max
    s = amax_scale(t, E4M3, -1, round_pow2=True)
    assert torch.equal(s, torch.exp2(torch.log2(s).round()))
    assert (s * t.abs().amax(-1, keepdim=True) <= 448).all()


def test_padded_path_is_exact():
    """The CUDA path's zero padding of M, K, N to multiples of 16, forced on the CPU: bit-identical."""
    g = torch.randn(2, 7, 24)
    for recipe in RECIPES:
        runs = []
        for pad in (False, True):
            x, w, b = _problem()
            out = _linear(x, w, b, recipe, pad)
            out.backward(g)
            runs.append((out, x.grad, w.grad, b.grad))
        for a, c in zip(*runs):
            torch.testing.assert_close(a, c, rtol=0, atol=0)


def _step(x, w, b):
    return sum(fp8_linear(x, w, b, r) for r in RECIPES).square().sum()


@pytest.mark.heavy
def test_compiled_with_inductor_equals_eager():
    """fullgraph torch.compile (no graph break) of all three recipes, forward and backward."""
    torch._dynamo.reset()
    eager = _problem()
    _step(*eager).backward()
    comp = _problem()
    torch.compile(_step, fullgraph=True, backend="inductor")(*comp).backward()
    for a, b in zip(eager, comp):
        _close(b.grad, a.grad.double(), FP32_TOL)


def test_aot_graph_shows_amax_scale_and_cast_to_the_compiler():
    """What Inductor receives: AOTAutograd decomposes the op into torchao's amax, scale, saturating
    cast and scaled products (forward and backward graphs); no opaque ``autoprec.fp8_linear``."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, _inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    x, w, b = _problem()
    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)
    torch.compile(_step, fullgraph=True, backend=backend)(x, w, b).backward()
    assert len(graphs) == 2
    for targets in graphs:
        assert not any("autoprec" in t for t in targets), targets
        for op in ("aten._scaled_mm.default", "aten.amax.default", "aten.clamp.default"):
            assert op in targets, (op, sorted(targets))
    assert "aten.abs.default" in graphs[1]  # the backward computes grad_output's amax


class _Fp8Linear(torch.nn.Module):
    def __init__(self, recipe):
        super().__init__()
        self.lin, self.recipe = torch.nn.Linear(40, 24), recipe

    def forward(self, x):
        return fp8_linear(x, self.lin.weight, self.lin.bias, self.recipe).relu()


@pytest.mark.parametrize("recipe", RECIPES)
def test_torch_export_keeps_the_op_and_trains(recipe):
    m = _Fp8Linear(recipe)
    x = torch.randn(2, 7, 40)
    ep = torch.export.export(m, (x,))
    assert any(n.target is torch.ops.autoprec.fp8_linear.default for n in ep.graph.nodes)
    em = ep.module()
    torch.testing.assert_close(em(x), m(x), rtol=0, atol=0)
    em(x).sum().backward()
    m(x).sum().backward()
    for (k, p), q in zip(em.named_parameters(), m.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=k)


def test_fake_tensors_give_shape_and_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        for recipe in RECIPES:
            x, w = torch.randn(2, 7, 40, dtype=torch.bfloat16), torch.randn(24, 40, dtype=torch.bfloat16)
            out = fp8_linear(x, w, None, recipe)
            assert out.shape == (2, 7, 24) and out.dtype == torch.bfloat16


def test_errors_name_the_argument():
    x, w, b = _problem()
    with pytest.raises(ValueError, match="recipe 'blockwise'"):
        fp8_linear(x, w, b, "blockwise")
    with pytest.raises(ValueError, match="weight of shape"):
        fp8_linear(x, w[:, :16], b)
    with pytest.raises(ValueError, match="bias of shape"):
        fp8_linear(x, w, b[:3])
    with pytest.raises(ValueError, match="x has dtype torch.int64"):
        fp8_linear(torch.ones(2, 40, dtype=torch.long), w, b)
    with pytest.raises(ValueError, match="recipe"):
        fp8_supported("cpu", "blockwise")
    with pytest.raises(ValueError, match="granularity 'blockwise'"):
        quantize(x, E4M3, "blockwise")


def test_fp8_supported_on_cpu():
    for recipe in RECIPES:
        ok, reason = fp8_supported("cpu", recipe)
        assert ok and "cpu" in reason and recipe in reason, reason
