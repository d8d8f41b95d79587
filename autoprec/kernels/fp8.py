"""A training-capable fp8 linear on ``torch._scaled_mm``: the op ``autoprec::fp8_linear``.

Recipe (torchao.float8 is the reference: ``torchao/float8/float8_utils.py`` ``amax_to_scale``,
``to_fp8_saturated``; ``float8_linear.py`` ``matmul_with_hp_or_float8_args``):

- forward operands ``x`` and ``weight`` in ``float8_e4m3fn``, the gradient ``grad_output`` in
  ``float8_e5m2`` (more range, less precision, as gradients need);
- scale = ``finfo(fp8).max / clamp(amax, min=1e-12)``, the division in float64 then rounded to
  float32 (torchao does so that eager and Inductor agree), quantised value
  ``clamp(t.float() * scale, -max, max).to(fp8)`` (saturating; torch's plain cast is not);
- ``tensorwise``: one amax per tensor; ``rowwise``: one amax per row over the inner (reduced)
  dimension of each product, so each operand of the backward products is re-quantised along its
  own inner dimension from the saved high-precision tensor (``x`` and ``weight`` are saved for
  backward as given, as torchao does; the casts are recomputed);
- the product ``torch._scaled_mm(a, b, scale_a=1/scale_a, scale_b=1/scale_b, out_dtype=...)``
  accumulates in fp32 and rounds once to the output dtype; a bias is added after, in ``x``'s dtype
  (torchao's ``Float8Linear`` adds it outside the fp8 product too).

What ``torch._scaled_mm`` accepts (checked on torch 2.13): the CPU kernel (a reference kernel, slow)
takes every combination used here: tensorwise and rowwise fp32 scales, fp32/bf16/fp16 outputs,
e4m3 x e4m3 and e5m2 x e4m3 operands, any K, M and N, either layout; it refuses only mixed
tensorwise/rowwise scales and non-fp32 scales, neither of which this module passes, so there is no
dequantise-and-matmul fallback. The CUDA kernel (cuBLASLt, SM 8.9+) needs the first operand
row-major and the second column-major (done here always), K and N multiples of 16 (done here by
zero padding, exact since zeros add nothing, for every device and only when a size is not a
multiple), no e5m2 x e5m2 (not used), and for ``rowwise`` with a float32 output SM 9.0 with
cuBLAS >= 12.9 (older GPUs take bf16/fp16 outputs only): :func:`fp8_supported` tries the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autoprec.dtypes import FP8_DTYPES

__all__ = ["E4M3", "E5M2", "SCALINGS", "amax_scale", "dequantize", "fp8_linear", "fp8_supported",
           "quantize", "reference_linear"]

#: Forward operands (``x``, ``weight``) and the gradient's fp8 dtypes (torchao.float8's defaults).
E4M3: torch.dtype = FP8_DTYPES["fp8_e4m3"]
E5M2: torch.dtype = FP8_DTYPES["fp8_e5m2"]
#: The scaling granularities ``fp8_linear`` accepts.
SCALINGS: tuple[str, ...] = ("tensorwise", "rowwise")
#: Floor of amax before the division, so an all-zero tensor gets a finite scale (torchao's ``EPS``).
EPS = 1e-12
#: cuBLASLt's fp8 rule: the inner size K and the output width N a multiple of 16 (padded to it).
ALIGN = 16
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def amax_scale(t: torch.Tensor, dtype: torch.dtype, dim: int | None = None) -> torch.Tensor:
    """The fp8 quantisation scale of ``t``: ``finfo(dtype).max / clamp(amax(|t|), min=EPS)``.

    Source: torchao.float8 ``amax_to_scale`` (float64 division, float32 result, ``EPS = 1e-12``).

    Args:
        t: float tensor of any shape (fp32/bf16/fp16).
        dtype: the fp8 dtype the scale maps into (``float8_e4m3fn``: max 448; ``float8_e5m2``: 57344).
        dim: ``None`` for one amax over the whole tensor (tensorwise, a 0-d result); else the
            dimension reduced (rowwise), kept with size 1.

    Returns:
        float32 scale, 0-d or ``t``'s shape with ``dim`` of size 1; multiply by it to quantise,
        divide to dequantise. Finite for an all-zero ``t`` (``max / 1e-12``).
    """
    a = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    return (torch.finfo(dtype).max / a.to(torch.float64).clamp(min=EPS)).to(torch.float32)


def _check_scaling(scaling: str) -> None:
    if scaling not in SCALINGS:
        raise ValueError(f"fp8_linear: unknown scaling {scaling!r}; valid: {', '.join(SCALINGS)}")


def quantize(t: torch.Tensor, dtype: torch.dtype, scaling: str,
             dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``t`` to fp8 with a saturating cast (torchao.float8 ``to_fp8_saturated``).

    Args:
        t: float tensor (fp32/bf16/fp16).
        dtype: ``float8_e4m3fn`` or ``float8_e5m2``.
        scaling: ``"tensorwise"`` (one scale) or ``"rowwise"`` (one scale per slice along ``dim``).
        dim: the dimension reduced by ``rowwise`` (the product's inner dimension); unused by
            ``tensorwise``.

    Returns:
        ``(q, scale)``: ``q`` of ``t``'s shape in ``dtype``, ``q ~= t * scale``; ``scale`` from
        :func:`amax_scale` (float32, 0-d or keepdim-shaped).

    Raises:
        ValueError: ``scaling`` is not in :data:`SCALINGS`.
    """
    _check_scaling(scaling)
    scale = amax_scale(t, dtype, None if scaling == "tensorwise" else dim)
    fmax = torch.finfo(dtype).max
    return (t.to(torch.float32) * scale).clamp(-fmax, fmax).to(dtype), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float64 values an fp8 tensor stands for: ``q / scale`` (exact for fp8 in float64 up to
    the division's rounding). ``q``: any fp8 tensor; ``scale`` broadcastable to it."""
    return q.to(torch.float64) / scale.to(torch.float64)


def reference_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     scaling: str) -> torch.Tensor:
    """The float64 product ``fp8_linear`` approximates, on the same e4m3-quantised operands:
    ``dequantize(x_q) @ dequantize(w_q).T + bias``. Shapes as :func:`fp8_linear`; returns float64
    ``[..., N]``. Raises ValueError for an unknown ``scaling``. A test reference (pure python)."""
    xq, sx = quantize(x, E4M3, scaling)
    wq, sw = quantize(weight, E4M3, scaling)
    out = dequantize(xq, sx) @ dequantize(wq, sw).t()
    return out if bias is None else out + bias.to(torch.float64)


def _pad_to(t: torch.Tensor, dim: int, value: float = 0.0) -> torch.Tensor:
    """``t`` (2-D) zero-padded at the end of ``dim`` to a multiple of :data:`ALIGN`."""
    extra = -t.shape[dim] % ALIGN
    if not extra:
        return t
    return F.pad(t, (0, extra) if dim in (1, -1) else (0, 0, 0, extra), value=value)


def _mm(a: torch.Tensor, sa: torch.Tensor, bt: torch.Tensor, sbt: torch.Tensor,
        out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ bt.T`` on ``torch._scaled_mm`` for fp8 ``a [M, K]`` and ``bt [N, K]`` (both with rows
    over the inner dimension K, any layout) and their quantisation scales: 0-d each (tensorwise) or
    ``[M, 1]`` and ``[N, 1]`` (rowwise). Returns ``[M, N]`` contiguous in ``out_dtype``. K and N are
    padded to :data:`ALIGN` (zeros in the operands, ones in a rowwise scale), the padding sliced off."""
    n = bt.shape[0]
    a, bt = _pad_to(a, 1), _pad_to(_pad_to(bt, 1), 0)
    if sbt.dim():
        sbt = _pad_to(sbt, 0, value=1.0)
    out = torch._scaled_mm(a.contiguous(), bt.contiguous().t(), scale_a=sa.reciprocal(),
                           scale_b=sbt.reciprocal().t(), out_dtype=out_dtype)
    return out if out.shape[1] == n else out[:, :n].contiguous()


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scaling: str) -> None:
    """Refuse what ``fp8_linear`` cannot compute, naming the argument at fault (ValueError)."""
    _check_scaling(scaling)
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and t.dtype not in _FLOATS:
            raise ValueError(f"fp8_linear: {name} has dtype {t.dtype}; valid: float32, bfloat16, float16")
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: weight of shape {tuple(weight.shape)} must be [N, K] with K = "
                         f"x.shape[-1] = {x.shape[-1] if x.dim() else None}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"fp8_linear: bias of shape {tuple(bias.shape)} must be [N] = [{weight.shape[0]}]")


@torch.library.custom_op("autoprec::fp8_linear", mutates_args=(),
                         schema="(Tensor x, Tensor weight, Tensor? bias, str scaling) -> Tensor")
def _fp8_linear_op(x, weight, bias, scaling):
    """The eager kernel of ``autoprec::fp8_linear`` (arguments as :func:`fp8_linear`)."""
    _check(x, weight, bias, scaling)
    xq, sx = quantize(x.reshape(-1, x.shape[-1]), E4M3, scaling)
    wq, sw = quantize(weight, E4M3, scaling)
    out = _mm(xq, sx, wq, sw, x.dtype)
    if bias is not None:
        out = out + bias.to(x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


@_fp8_linear_op.register_fake
def _fp8_linear_fake(x, weight, bias, scaling):
    """The fake (meta) kernel: same checks, an empty ``[..., N]`` output in ``x``'s dtype."""
    _check(x, weight, bias, scaling)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _grads(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, scaling: str,
           need: tuple[bool, bool]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``grad_x = g @ W`` and ``grad_W = g^T @ x`` in fp8: ``g`` (``grad [..., N]``) in e5m2, ``x``
    and ``W [N, K]`` in e4m3, each quantised along the product's inner dimension (rowwise) or whole
    (tensorwise). Returns grads in ``x``'s and ``weight``'s dtypes (None where ``need`` says so)."""
    n, k = weight.shape
    g2, x2 = grad.reshape(-1, n), x.reshape(-1, k)
    gx = gw = None
    g_rows = quantize(g2, E5M2, scaling, dim=-1)  # inner N for grad_x
    if need[0]:
        wq, sw = quantize(weight, E4M3, scaling, dim=0)  # W^T's rows run over N
        gx = _mm(g_rows[0], g_rows[1], wq.t(), sw.t(), x.dtype).reshape(x.shape)
    if need[1]:
        gq, sg = g_rows if scaling == "tensorwise" else quantize(g2, E5M2, scaling, dim=0)
        xq, sx = quantize(x2, E4M3, scaling, dim=0)  # inner M for grad_W
        gw = _mm(gq.t(), sg.t(), xq.t(), sx.t(), weight.dtype)
    return gx, gw


def _setup_context(ctx, inputs, output) -> None:
    """Save ``x`` and ``weight`` as given (high precision) for the backward's re-quantisation."""
    x, weight, bias, scaling = inputs
    ctx.save_for_backward(x, weight)
    ctx.scaling = scaling
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, grad):
    """Grads of ``(x, weight, bias, scaling)``; the bias grad sums ``grad`` in fp32 (not fp8)."""
    x, weight = ctx.saved_tensors
    gx, gw = _grads(grad, x, weight, ctx.scaling, tuple(ctx.needs_input_grad[:2]))
    gb = None
    if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
        gb = grad.reshape(-1, weight.shape[0]).sum(0, dtype=torch.float32).to(ctx.bias_dtype)
    return gx, gw, gb, None


_fp8_linear_op.register_autograd(_backward, setup_context=_setup_context)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               scaling: str = "tensorwise") -> torch.Tensor:
    """``x @ weight.T + bias`` with both operands in fp8 e4m3 (see the module docstring's recipe).

    Calls the op ``torch.ops.autoprec.fp8_linear`` (a ``torch.library`` custom op with a fake
    kernel and a registered backward), so it runs eagerly, traces under ``torch.export`` and
    ``torch.compile(fullgraph=True)`` (Inductor), and trains: the backward gives grads for ``x``,
    ``weight`` and ``bias`` from an e5m2 ``grad_output`` (fp8 products too).

    Args:
        x: ``[..., K]`` float32/bfloat16/float16 (leading dims are flattened for the product).
        weight: ``[N, K]`` float (nn.Linear's layout).
        bias: ``[N]`` float or None.
        scaling: ``"tensorwise"`` (one scale per tensor) or ``"rowwise"`` (per row of ``x`` and of
            ``weight`` over K, i.e. per output row and column).

    Returns:
        ``[..., N]`` in ``x``'s dtype (the product rounded once from fp32 accumulation). Grads come
        in each input's dtype.

    Raises:
        ValueError: unknown ``scaling``, a non-float dtype, or shapes that do not match, naming
            the argument. (Any K works: sizes not a multiple of 16 are zero padded.)
    """
    return torch.ops.autoprec.fp8_linear(x, weight, bias, scaling)


def fp8_supported(device: str | torch.device, scaling: str = "tensorwise",
                  dtype: torch.dtype = torch.float32) -> tuple[bool, str]:
    """Whether ``fp8_linear`` works on ``device``: runs one tiny forward and backward
    (``[16, 32] x [16, 32]^T`` in ``dtype``) and checks the output against :func:`reference_linear`.

    Returns:
        ``(ok, reason)``: ``reason`` names the device, scaling and dtype, and on failure the error
        torch raised (e.g. no fp8 kernel on that GPU, rowwise fp32 output before SM 9.0).

    Raises:
        ValueError: unknown ``scaling`` (a caller's mistake, not a device fact).
    """
    _check_scaling(scaling)
    what = f"fp8_linear ({scaling}, {str(dtype).removeprefix('torch.')}) on {device}"
    try:
        gen = torch.Generator().manual_seed(0)
        x, w = (torch.randn(16, 32, generator=gen).to(device=device, dtype=dtype).requires_grad_()
                for _ in range(2))
        out = fp8_linear(x, w, None, scaling)
        out.float().square().sum().backward()
        ref = reference_linear(x.detach().cpu(), w.detach().cpu(), None, scaling)
        err = ((out.detach().cpu().double() - ref).norm() / ref.norm()).item()
        finite = all(bool(torch.isfinite(t).all()) for t in (out, x.grad, w.grad))
    except Exception as e:  # a probe: any failure (CUDA absent raises AssertionError) is the answer
        first = (str(e).strip().splitlines() or [""])[0]
        return False, f"{what}: {type(e).__name__}: {first}"
    if not finite or not err < 1e-2:
        return False, f"{what}: wrong result (rel. error {err:.3g} vs float64 on the same fp8 inputs)"
    return True, f"{what}: ran forward and backward (rel. error {err:.2g})"
