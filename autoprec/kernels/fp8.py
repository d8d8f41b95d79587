"""A training-capable fp8 linear on torchao.float8's building blocks: the op ``autoprec::fp8_linear``.

The op runs torchao's own fp8 matmul, ``torchao.float8.float8_linear.matmul_with_hp_or_float8_args``
(an ``autograd.Function`` that casts ``x``, ``weight`` and ``grad_output`` to ``Float8TrainingTensor``
and multiplies them with torch's ``_scaled_mm``), configured by
``torchao.float8.Float8LinearConfig.from_recipe_name(recipe)``, and adds the bias after the product,
in the output's dtype, as torchao's ``Float8Linear.forward`` does. The recipes are torchao's
(``torchao/float8/config.py``, ``Float8LinearRecipeName``); per product, its operands' fp8 dtypes:

- ``tensorwise`` (default): output = x @ W^T with x, W in e4m3; grad_x = g @ W with g in e5m2, W
  e4m3; grad_W = g^T @ x with g e5m2, x e4m3; one scale per tensor, as computed;
- ``rowwise``: every operand in e4m3 (gradients too) with one scale per row over the product's
  inner dimension, scales rounded down to powers of two;
- ``rowwise_with_gw_hp``: output as ``rowwise``; grad_x from g e4m3 per row and W e4m3 per tensor;
  grad_W in high precision (no fp8); power-of-two scales.

"per row" is one scale per row over the product's inner dimension (torchao's ``AXISWISE``); scale =
``finfo(fp8).max / clamp(amax, min=1e-12)`` in float64 rounded to float32, rounded down to a power
of two (``2^k``) in the rowwise recipes; the cast saturates (``torchao/float8/float8_utils.py``:
``amax_to_scale``, ``_round_scale_down_to_power_of_2``, ``to_fp8_saturated``). A rowwise product
with an fp32 or fp16 output is computed to bf16 by torch's ``_scaled_mm`` and cast up
(``torchao/float8/float8_ops.py``, ``addmm_float8_unwrapped``), so its results carry bf16 rounding
(2^-9 relative); tensorwise fp32 outputs are fp32.

Measured (CPU, torch 2.13, torchao 0.18, ``tests/kernels/test_fp8_torchao.py``): ``fp8_linear`` is
bit-identical to torchao's ``Float8Linear`` in the output, grad_x and grad_W for all three recipes
at 64x128x96 and 256x512x1376; against an fp32 ``nn.Linear`` the output's relative L2 error is
3.6e-2 (tensorwise), 3.8e-2 (rowwise, rowwise_with_gw_hp). autoprec's earlier ``rowwise`` (e5m2
gradients, unrounded scales) differed from torchao's by 5.3e-2 (output), 6.8e-2 (grad_x), 7.0e-2
(grad_W) relative L2 at 64x128x96: a policy file's ``"rowwise"`` now means torchao's recipe.

Why an op at all: the pass ``lower_fp8`` swaps an ATen node of the captured graph for one node, and
the graph must still ``torch.export`` and be fake-tensor propagated. The op is registered
``CompositeImplicitAutograd`` (as ``autoprec::sdpa_math``): ``torch.export`` keeps it as one node,
while eager autograd, fake tensors and AOTAutograd run its body, so Inductor sees torchao's amax,
scale, cast and torch's ``_scaled_mm`` and fuses them (checked by the tests), and the backward is
torchao's. torchao is imported on the op's first call (it takes ~2 s); without it the op raises
``ImportError`` naming ``pip install torchao``.

Sizes: torch's CPU ``_scaled_mm`` (a reference kernel, slow) takes any M, K, N. The CUDA kernel
(cuBLASLt, SM 8.9+) needs the inner and output sizes of each product multiples of 16 (K and N;
M too, the inner size of grad_W). On a non-CPU device x and W are zero padded to that in high
precision before torchao's casts and the result sliced; exact, since zero rows and columns leave
every amax unchanged and add nothing to a product (tested by forcing the padding on the CPU).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from autoprec.dtypes import FP8_DTYPES

__all__ = ["E4M3", "E5M2", "RECIPES", "SCALINGS", "amax_scale", "dequantize", "fp8_linear",
           "fp8_supported", "quantize", "reference_linear", "torchao_config"]

#: Forward operands' (``x``, ``weight``) and, in the tensorwise recipe, the gradient's fp8 dtypes.
E4M3: torch.dtype = FP8_DTYPES["fp8_e4m3"]
E5M2: torch.dtype = FP8_DTYPES["fp8_e5m2"]
#: torchao.float8's training recipes (``Float8LinearRecipeName`` values), the names ``fp8_linear``
#: and a policy's ``fp8_scaling`` take (``autoprec.policy.checks.FP8_SCALINGS`` lists the same).
RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
#: The former name of :data:`RECIPES` (``fp8_linear``'s argument was ``scaling``).
SCALINGS = RECIPES
#: Scale granularities of :func:`quantize` (torchao's ``TENSORWISE`` and ``AXISWISE``).
GRANULARITIES: tuple[str, ...] = ("tensorwise", "rowwise")
#: Floor of amax before the division, so an all-zero tensor gets a finite scale (torchao's ``EPS``).
EPS = 1e-12
#: cuBLASLt's fp8 rule: inner and output sizes of a product a multiple of 16 (padded to it).
ALIGN = 16
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_INSTALL = "pip install torchao (or pip install 'autoprec[fp8]')"


def amax_scale(t: torch.Tensor, dtype: torch.dtype, dim: int | None = None,
               round_pow2: bool = False) -> torch.Tensor:
    """The fp8 quantisation scale of ``t``: ``finfo(dtype).max / clamp(amax(|t|), min=EPS)``.

    Source: torchao.float8 ``float8_utils.amax_to_scale`` (float64 division, float32 result,
    ``EPS = 1e-12``; ``round_pow2``: ``_round_scale_down_to_power_of_2``, ``2^floor(log2 s)``).
    Pure torch (``autoprec.applied.saved`` uses it without torchao); a test checks it against
    torchao's ``tensor_to_scale``.

    Args:
        t: float tensor of any shape (fp32/bf16/fp16).
        dtype: the fp8 dtype the scale maps into (``float8_e4m3fn``: max 448; ``float8_e5m2``: 57344).
        dim: ``None`` for one amax over the whole tensor (tensorwise, a 0-d result); else the
            dimension reduced (rowwise), kept with size 1.
        round_pow2: round the scale down to a power of two (torchao's rowwise recipes).

    Returns:
        float32 scale, 0-d or ``t``'s shape with ``dim`` of size 1; multiply by it to quantise,
        divide to dequantise. Finite for an all-zero ``t`` (``max / 1e-12``).
    """
    a = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    s = (torch.finfo(dtype).max / a.to(torch.float64).clamp(min=EPS)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(s))) if round_pow2 else s


def quantize(t: torch.Tensor, dtype: torch.dtype, granularity: str, dim: int = -1,
             round_pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``t`` to fp8 with a saturating cast (torchao.float8 ``to_fp8_saturated``).

    Args:
        t: float tensor (fp32/bf16/fp16).
        dtype: ``float8_e4m3fn`` or ``float8_e5m2``.
        granularity: ``"tensorwise"`` (one scale) or ``"rowwise"`` (one scale per slice along ``dim``).
        dim: the dimension reduced by ``rowwise`` (the product's inner dimension); unused by
            ``tensorwise``.
        round_pow2: power-of-two scales (:func:`amax_scale`).

    Returns:
        ``(q, scale)``: ``q`` of ``t``'s shape in ``dtype``, ``q ~= t * scale``; ``scale`` from
        :func:`amax_scale` (float32, 0-d or keepdim-shaped).

    Raises:
        ValueError: ``granularity`` is not in :data:`GRANULARITIES`.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"quantize: unknown granularity {granularity!r}; valid: {', '.join(GRANULARITIES)}")
    scale = amax_scale(t, dtype, None if granularity == "tensorwise" else dim, round_pow2)
    fmax = torch.finfo(dtype).max
    return (t.to(torch.float32) * scale).clamp(-fmax, fmax).to(dtype), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float64 values an fp8 tensor stands for: ``q / scale`` (exact for fp8 in float64 up to
    the division's rounding). ``q``: any fp8 tensor; ``scale`` broadcastable to it."""
    return q.to(torch.float64) / scale.to(torch.float64)


def _check_recipe(recipe: str) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"fp8_linear: unknown recipe {recipe!r}; valid: {', '.join(RECIPES)}")


def reference_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     recipe: str) -> torch.Tensor:
    """The float64 product ``fp8_linear`` approximates, on the same e4m3-quantised operands:
    ``dequantize(x_q) @ dequantize(w_q).T + bias``, both quantised per ``recipe``'s forward (per
    tensor, or per row over K with power-of-two scales). Shapes as :func:`fp8_linear`; returns
    float64 ``[..., N]``. Raises ValueError for an unknown ``recipe``. A reference (pure torch)."""
    _check_recipe(recipe)
    gran, pow2 = ("tensorwise", False) if recipe == "tensorwise" else ("rowwise", True)
    xq, sx = quantize(x, E4M3, gran, round_pow2=pow2)
    wq, sw = quantize(weight, E4M3, gran, round_pow2=pow2)
    out = dequantize(xq, sx) @ dequantize(wq, sw).t()
    return out if bias is None else out + bias.to(torch.float64)


@functools.cache
def _torchao() -> Any:
    """``torchao.float8.float8_linear.matmul_with_hp_or_float8_args`` (imported once).

    torchao's import logs a warning for each CUDA extension a CPU-only torch cannot load (its fp8
    training path does not use them; dropped where CUDA is absent) and torch logs a deprecation of
    torchao's ``register_constant`` on an Enum (dropped always): noise, not a fault of the user's.

    Raises:
        ImportError: torchao (>= 0.18) is not installed, with the command that installs it.
    """
    try:
        with quiet_torchao_import():
            from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
    except ImportError as e:
        raise ImportError(f"fp8 matmuls (compute 'fp8_e4m3') run on torchao.float8, which is not "
                          f"installed or too old ({e}); {_INSTALL}") from e
    return matmul_with_hp_or_float8_args


@contextlib.contextmanager
def quiet_torchao_import() -> Iterator[None]:
    """Hold torchao's import-time noise while the body runs: its "Failed to load <.so>" warnings
    for CUDA kernels (dropped where CUDA is absent, as the CPU path does not use them) and torch's
    deprecation of torchao's ``register_constant`` on an Enum (``torch.utils._pytree`` logger,
    dropped always). torchao is imported by the fp8 path and also by ``transformers`` whenever it
    is installed (its torchao quantizer), so the model file loader runs under this too."""
    quiet = [logging.getLogger("torch.utils._pytree")]
    if not torch.cuda.is_available():
        quiet.append(logging.getLogger("torchao"))
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)


@functools.cache
def torchao_config(recipe: str) -> tuple[Any, Any]:
    """torchao's configuration of ``recipe``: ``(Float8LinearConfig, LinearMMConfig)``.

    The first is ``Float8LinearConfig.from_recipe_name(recipe)``; the second the per-product
    ``ScaledMMConfig``s (emulate, fast accumulation, padding) as ``Float8Linear.__init__`` builds
    them (``torchao/float8/float8_linear.py``). Cached per recipe (both are immutable).

    Raises:
        ValueError: unknown ``recipe``. ImportError: torchao missing (:func:`_torchao`).
    """
    _check_recipe(recipe)
    _torchao()
    from torchao.float8 import Float8LinearConfig, LinearMMConfig, ScaledMMConfig

    c = Float8LinearConfig.from_recipe_name(recipe)
    gemms = (c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight)
    mm = LinearMMConfig(*(ScaledMMConfig(c.emulate, g.use_fast_accum, False, c.pad_inner_dim) for g in gemms))
    return c, mm


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: str) -> None:
    """Refuse what ``fp8_linear`` cannot compute, naming the argument at fault (ValueError)."""
    _check_recipe(recipe)
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and t.dtype not in _FLOATS:
            raise ValueError(f"fp8_linear: {name} has dtype {t.dtype}; valid: float32, bfloat16, float16")
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: weight of shape {tuple(weight.shape)} must be [N, K] with K = "
                         f"x.shape[-1] = {x.shape[-1] if x.dim() else None}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"fp8_linear: bias of shape {tuple(bias.shape)} must be [N] = [{weight.shape[0]}]")


def _pad(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """2-D ``t`` zero padded at the end to ``rows`` x ``cols`` (no copy when already that size)."""
    extra_r, extra_c = rows - t.shape[0], cols - t.shape[1]
    return F.pad(t, (0, extra_c, 0, extra_r)) if extra_r or extra_c else t


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: str,
            pad: bool) -> torch.Tensor:
    """torchao's fp8 product of ``x [..., K]`` and ``weight [N, K]`` plus ``bias``; with ``pad``,
    M, K and N are zero padded to multiples of :data:`ALIGN` first (the CUDA kernel's rule)."""
    mm_fn = _torchao()
    config, mm_config = torchao_config(recipe)
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if pad and (m % ALIGN or k % ALIGN or n % ALIGN):
        out = mm_fn.apply(_pad(x2, _up(m), _up(k)), _pad(weight, _up(n), _up(k)).t(), mm_config, config)
        out = out[:m, :n]
    else:
        out = mm_fn.apply(x2, weight.t(), mm_config, config)
    out = out.reshape(*x.shape[:-1], n)
    return out if bias is None else out + bias.to(out.dtype)


def _fp8_linear_impl(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     recipe: str) -> torch.Tensor:
    """The ``CompositeImplicitAutograd`` kernel of ``autoprec::fp8_linear`` (as :func:`fp8_linear`)."""
    _check(x, weight, bias, recipe)
    return _linear(x, weight, bias, recipe, pad=x.device.type != "cpu")


_lib = torch.library.Library("autoprec", "FRAGMENT")
_lib.define("fp8_linear(Tensor x, Tensor weight, Tensor? bias, str recipe) -> Tensor")
_lib.impl("fp8_linear", _fp8_linear_impl, "CompositeImplicitAutograd")


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               recipe: str = "tensorwise") -> torch.Tensor:
    """``x @ weight.T + bias`` in fp8 by torchao.float8's ``recipe`` (the module docstring's table).

    Calls the op ``torch.ops.autoprec.fp8_linear`` (``CompositeImplicitAutograd``): it runs
    eagerly, stays one node under ``torch.export``, and under ``torch.compile`` (Inductor) its
    casts and scaled products are traced and fused; it trains, with torchao's backward.

    Args:
        x: ``[..., K]`` float32/bfloat16/float16 (leading dims are flattened for the product).
        weight: ``[N, K]`` float (nn.Linear's layout).
        bias: ``[N]`` float or None; added after the product in the output's dtype.
        recipe: one of :data:`RECIPES`.

    Returns:
        ``[..., N]`` in ``x``'s dtype. Grads come in each input's dtype (torchao computes grad_W
        in ``x``'s dtype; autograd casts it to ``weight``'s).

    Raises:
        ValueError: unknown ``recipe``, a non-float dtype, or shapes that do not match, naming the
            argument. ImportError: torchao is not installed (the message says how to install it).
    """
    return torch.ops.autoprec.fp8_linear(x, weight, bias, recipe)


def fp8_supported(device: str | torch.device, recipe: str = "tensorwise",
                  dtype: torch.dtype = torch.float32) -> tuple[bool, str]:
    """Whether ``fp8_linear`` works on ``device``: runs one tiny forward and backward
    (``[16, 32] x [16, 32]^T`` in ``dtype``) and checks the output against :func:`reference_linear`
    (relative error below 1e-2; the rowwise recipes' bf16 output rounding is 4e-3 at most).

    Returns:
        ``(ok, reason)``: ``reason`` names the device, recipe and dtype, and on failure the error
        (torchao not installed, no fp8 kernel on that GPU, ...).

    Raises:
        ValueError: unknown ``recipe`` (a caller's mistake, not a device fact).
    """
    _check_recipe(recipe)
    what = f"fp8_linear ({recipe}, {str(dtype).removeprefix('torch.')}) on {device}"
    try:
        gen = torch.Generator().manual_seed(0)
        x, w = (torch.randn(16, 32, generator=gen).to(device=device, dtype=dtype).requires_grad_()
                for _ in range(2))
        out = fp8_linear(x, w, None, recipe)
        out.float().square().sum().backward()
        ref = reference_linear(x.detach().cpu(), w.detach().cpu(), None, recipe)
        err = ((out.detach().cpu().double() - ref).norm() / ref.norm()).item()
        finite = all(bool(torch.isfinite(t).all()) for t in (out, x.grad, w.grad))
    except Exception as e:  # a probe: any failure (CUDA absent raises AssertionError) is the answer
        first = (str(e).strip().splitlines() or [""])[0]
        return False, f"{what}: {type(e).__name__}: {first}"
    if not finite or not err < 1e-2:
        return False, f"{what}: wrong result (rel. error {err:.3g} vs float64 on the same fp8 inputs)"
    return True, f"{what}: ran forward and backward (rel. error {err:.2g})"
