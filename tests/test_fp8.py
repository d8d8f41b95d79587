"""autoprec.kernels.fp8: the fp8 linear's forward and backward against float64 products on the same
fp8-quantised operands (issue 14, Done-when 4), tracing (Inductor, torch.export), scale edge cases
and argument errors.

Tolerances: with the same quantised operands the only error left is the kernel's own: fp32
accumulation over K terms and one rounding to the output dtype. fp32 outputs: within 1e-5 of the
largest reference value (K * 2^-24 ~ 2e-6 for K = 40 at worst, observed ~2e-7); bf16 outputs: two
roundings (product, bias add) of 2^-9 each, so 2^-8 of the largest value.
"""

from __future__ import annotations

import pytest
import torch

from autoprec.kernels.fp8 import (
    E4M3,
    E5M2,
    SCALINGS,
    amax_scale,
    dequantize,
    fp8_linear,
    fp8_supported,
    quantize,
    reference_linear,
)

FP32_TOL = 1e-5
BF16_TOL = 2.0**-8


def _close(got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """``got`` within ``tol`` of float64 ``ref``, relative to ref's largest magnitude."""
    err = (got.double() - ref).abs().max().item()
    assert err <= tol * ref.abs().max().item(), (err, ref.abs().max().item())


def _problem(dtype=torch.float32, shape=(2, 7, 40), n=24, seed=0):
    """x [B, T, K] with K = 40 and M = 14 not multiples of 16 (the padded path), weight, bias."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(n, shape[-1], generator=g) / 6).to(dtype).requires_grad_()
    b = torch.randn(n, generator=g).to(dtype).requires_grad_()
    return x, w, b


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)])
def test_forward_matches_float64_on_quantised_inputs(scaling, dtype, tol):
    x, w, b = _problem(dtype)
    out = fp8_linear(x, w, b, scaling)
    assert out.shape == (2, 7, 24) and out.dtype == dtype
    _close(out, reference_linear(x.detach(), w.detach(), b.detach(), scaling), tol)
    _close(fp8_linear(x, w, None, scaling), reference_linear(x.detach(), w.detach(), None, scaling), tol)


def _reference_grads(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, scaling: str):
    """float64 grads from e5m2 g and e4m3 x, W, each quantised along its product's inner dim."""
    g2, x2 = g.reshape(-1, w.shape[0]), x.reshape(-1, w.shape[1])
    gx = dequantize(*quantize(g2, E5M2, scaling, dim=-1)) @ dequantize(*quantize(w, E4M3, scaling, dim=0))
    gw = dequantize(*quantize(g2, E5M2, scaling, dim=0)).t() @ dequantize(*quantize(x2, E4M3, scaling, dim=0))
    return gx.reshape(x.shape), gw, g2.double().sum(0)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_backward_matches_float64_on_quantised_grad_output(scaling):
    x, w, b = _problem()
    g = torch.randn(2, 7, 24, generator=torch.Generator().manual_seed(1)) * 1e-3
    fp8_linear(x, w, b, scaling).backward(g)
    gx, gw, gb = _reference_grads(g, x.detach(), w.detach(), scaling)
    assert x.grad.dtype == w.grad.dtype == b.grad.dtype == torch.float32
    _close(x.grad, gx, FP32_TOL)
    _close(w.grad, gw, FP32_TOL)
    _close(b.grad, gb, FP32_TOL)


def test_backward_skips_frozen_weight_and_keeps_input_dtypes():
    x, w, _ = _problem(torch.bfloat16)
    w.requires_grad_(False)
    fp8_linear(x, w, None, "rowwise").float().sum().backward()
    assert w.grad is None and x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("scaling", SCALINGS)
def test_fp8_error_vs_fp32_is_of_fp8_scale(scaling):
    """An nn.Linear-sized random problem: e4m3 has 3 mantissa bits, so a few percent error."""
    lin = torch.nn.Linear(512, 512)
    x = torch.randn(64, 512)
    ref = lin(x).detach()
    rel = ((fp8_linear(x, lin.weight, lin.bias, scaling) - ref).norm() / ref.norm()).item()
    assert 3e-3 < rel < 6e-2, rel


def test_rowwise_keeps_small_rows_that_tensorwise_flushes():
    """One row 1e5x larger than the rest: a tensorwise scale pushes the small rows below e4m3's
    smallest subnormal (2^-9); rowwise scales each row to itself."""
    x, w = torch.randn(16, 32), torch.randn(16, 32)
    x[0] *= 1e5
    ref = (x @ w.t())[1:]
    errs = {s: ((fp8_linear(x, w, None, s)[1:] - ref).norm() / ref.norm()).item() for s in SCALINGS}
    assert errs["rowwise"] < 0.1 < errs["tensorwise"], errs


def test_scale_of_zeros_is_finite_and_amax_maps_to_fp8_max():
    z = torch.zeros(4, 8)
    for dim in (None, -1):
        s = amax_scale(z, E4M3, dim)
        assert s.dtype == torch.float32 and torch.isfinite(s).all()
    q, s = quantize(z, E4M3, "rowwise")
    assert s.shape == (4, 1) and not torch.isnan(q.float()).any() and (q.float() == 0).all()
    out = fp8_linear(z.requires_grad_(), torch.randn(8, 8), None, "tensorwise")
    out.sum().backward()
    assert (out == 0).all() and torch.isfinite(z.grad).all()
    t = torch.randn(5, 9)
    for dtype in (E4M3, E5M2):
        q, _ = quantize(t, dtype, "tensorwise")
        assert q.float().abs().max().item() == torch.finfo(dtype).max


def test_compiled_with_inductor_equals_eager():
    """fullgraph torch.compile (no graph break); the backward's quantisation runs in Inductor code."""
    torch._dynamo.reset()

    def step(x, w, b):
        return (fp8_linear(x, w, b, "tensorwise") + fp8_linear(x, w, b, "rowwise")).square().sum()

    eager = _problem()
    step(*eager).backward()
    comp = _problem()
    torch.compile(step, fullgraph=True, backend="inductor")(*comp).backward()
    for a, b in zip(eager, comp):
        _close(b.grad, a.grad.double(), FP32_TOL)


class _Fp8Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(40, 24)

    def forward(self, x):
        return fp8_linear(x, self.lin.weight, self.lin.bias, "rowwise").relu()


def test_torch_export_keeps_the_op_and_trains():
    m = _Fp8Linear()
    x = torch.randn(2, 7, 40)
    ep = torch.export.export(m, (x,))
    assert any(n.target is torch.ops.autoprec.fp8_linear.default for n in ep.graph.nodes)
    em = ep.module()
    torch.testing.assert_close(em(x), m(x), rtol=0, atol=0)
    em(x).sum().backward()
    grads = {k: p.grad for k, p in em.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values()), grads


def test_errors_name_the_argument():
    x, w, b = _problem()
    with pytest.raises(ValueError, match="scaling 'blockwise'"):
        fp8_linear(x, w, b, "blockwise")
    with pytest.raises(ValueError, match="weight of shape"):
        fp8_linear(x, w[:, :16], b)
    with pytest.raises(ValueError, match="bias of shape"):
        fp8_linear(x, w, b[:3])
    with pytest.raises(ValueError, match="x has dtype torch.int64"):
        fp8_linear(torch.ones(2, 40, dtype=torch.long), w, b)
    with pytest.raises(ValueError, match="scaling"):
        fp8_supported("cpu", "blockwise")


def test_fp8_supported_on_cpu():
    for scaling in SCALINGS:
        ok, reason = fp8_supported("cpu", scaling)
        assert ok and "cpu" in reason and scaling in reason, reason


@pytest.mark.parametrize("scaling", SCALINGS)
def test_opcheck_fake_kernel_schema_and_autograd(scaling):
    """torch.library.opcheck: the fake kernel matches the real one (sizes and strides, here with N =
    24 padded to 32 inside), the schema holds, autograd is registered, AOT dispatch (dynamic) works."""
    x, w, b = _problem()
    torch.library.opcheck(torch.ops.autoprec.fp8_linear.default, (x, w, b, scaling))
    torch.library.opcheck(torch.ops.autoprec.fp8_linear.default, (x[0].detach(), w, None, scaling))
