"""The op table: every ATen op autoprec knows, its class and the numerical reason
(docs/architecture.md#node-keys-and-op-classes).

Classes (TVM ``ToMixedPrecision`` ALWAYS/FOLLOW/NEVER, TensorFlow AMP allow/infer/deny lists):

- ``matmul``: compute-bound contractions; Tensor Core / AMX / AVX512-BF16 candidates.
- ``sensitive``: fp32 by default. Seeded from PyTorch autocast's fp32 op lists (CUDA and CPU,
  https://pytorch.org/docs/stable/amp.html#autocast-op-reference): exponentials, logs, powers,
  norms, losses and large reductions lose range or accumulate error in 8-bit-mantissa types.
- ``follow``: elementwise and data movement; exact or ≤ 0.5 ulp in any float type, so they
  take whichever dtype makes the fewest bytes of casts.
- ``nonfloat``: any node whose output is not a floating tensor (indices, masks, shapes); never
  cast, whatever the op.

Ops that set their output dtype themselves (``.to(dtype)``, factories such as ``full`` or
``arange``, and any op called with a ``dtype`` argument, e.g. Hugging Face eager attention's
``softmax(x, dim=-1, dtype=torch.float32)``: :func:`sets_own_dtype`) are ``fixed``: the pass keeps
their dtype and never casts their inputs.

An op missing from the table is treated as ``follow`` with one warning per op name.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import fx

from autoprec._torch_compat import overload_schema
from autoprec.dtypes import NAMES

__all__ = [
    "FIXED_DTYPE_OPS",
    "MASK_FILL_OPS",
    "OP_TABLE",
    "REDUCTION_OPS",
    "REGION_OPS",
    "RMSNORM_REASON",
    "classify",
    "is_float_value",
    "op_argument",
    "reason",
    "rmsnorm_regions",
    "sets_own_dtype",
]

_M = "matmul"
_S = "sensitive"
_F = "follow"

#: ATen op name (``OpOverloadPacket`` name) -> (class, numerical reason).
OP_TABLE: dict[str, tuple[str, str]] = {
    # --- matmul: compute-bound; low-precision inputs with fp32 accumulation in the kernel.
    "linear": (_M, "GEMM; BLAS/Tensor Core kernels accumulate in fp32"),
    "mm": (_M, "GEMM; fp32 accumulation in the kernel"),
    "bmm": (_M, "batched GEMM; fp32 accumulation in the kernel"),
    "addmm": (_M, "GEMM + bias; fp32 accumulation in the kernel"),
    "baddbmm": (_M, "batched GEMM + bias; fp32 accumulation in the kernel"),
    "addbmm": (_M, "batched GEMM reduced; fp32 accumulation in the kernel"),
    "matmul": (_M, "GEMM; fp32 accumulation in the kernel"),
    "einsum": (_M, "contraction lowered to bmm"),
    "mv": (_M, "matrix-vector product (GEMV); in autocast's lower-precision list"),
    "addmv": (_M, "GEMV + bias; in autocast's lower-precision list"),
    "addr": (_M, "outer product + matrix; in autocast's lower-precision list"),
    "_grouped_mm": (_M, "grouped GEMM (mixture-of-experts); fp32 accumulation in the kernel"),
    "grouped_mm_fallback": (_M, "grouped GEMM (transformers' MoE fallback): per-group matmuls"),
    "conv1d": (_M, "convolution; fp32 accumulation in the kernel"),
    "conv2d": (_M, "convolution; fp32 accumulation in the kernel"),
    "conv3d": (_M, "convolution; fp32 accumulation in the kernel"),
    "convolution": (_M, "convolution; fp32 accumulation in the kernel"),
    "scaled_dot_product_attention": (_M, "fused attention; softmax inside runs in fp32"),
    "sdpa_math": (_M, "attention as two GEMMs (policy attention=math); softmax runs in fp32"),
    # --- sensitive: range or accumulation problems in 8-bit (bf16) / 5-bit-exponent (fp16) types.
    "softmax": (_S, "exp overflows fp16 past 11.1; normaliser sums many terms"),
    "_softmax": (_S, "exp overflows fp16 past 11.1; normaliser sums many terms"),
    "log_softmax": (_S, "log-sum-exp; catastrophic cancellation in low precision"),
    "_log_softmax": (_S, "log-sum-exp; catastrophic cancellation in low precision"),
    "layer_norm": (_S, "mean/variance over the hidden size; variance underflows/overflows"),
    "native_layer_norm": (_S, "mean/variance over the hidden size"),
    "group_norm": (_S, "mean/variance reduction"),
    "native_group_norm": (_S, "mean/variance reduction"),
    "batch_norm": (_S, "running statistics need fp32"),
    "rms_norm": (_S, "mean of squares overflows fp16 for |x| > 256 (case C04)"),
    "_fused_rms_norm": (_S, "mean of squares overflows fp16 for |x| > 256 (case C04)"),
    "cross_entropy_loss": (_S, "loss: log-sum-exp over the vocabulary"),
    "nll_loss": (_S, "loss: mean over many tokens"),
    "nll_loss_forward": (_S, "loss: mean over many tokens"),
    "nll_loss_nd": (_S, "loss: mean over many tokens"),
    "mse_loss": (_S, "loss: squares and a large mean"),
    "l1_loss": (_S, "loss: large mean"),
    "smooth_l1_loss": (_S, "loss: large mean"),
    "binary_cross_entropy_with_logits": (_S, "loss: log/exp"),
    "kl_div": (_S, "loss: log of ratios"),
    "exp": (_S, "overflows fp16 past 11.1, bf16 keeps 8 bits of mantissa"),
    "exp2": (_S, "overflow, as exp"),
    "expm1": (_S, "cancellation near 0"),
    "log": (_S, "large relative error near 1 with 8-bit mantissa"),
    "log2": (_S, "as log"),
    "log10": (_S, "as log"),
    "log1p": (_S, "cancellation near 0"),
    "pow": (_S, "x**2 overflows fp16 for |x| > 256 (case C04)"),
    "rsqrt": (_S, "inf/0 from overflowed inputs; part of the RMSNorm pattern"),
    "reciprocal": (_S, "overflow for small inputs"),
    "sum": (_S, "large reduction: accumulation error grows with length (case C06)"),
    "mean": (_S, "large reduction: accumulation error grows with length"),
    "var": (_S, "variance: cancellation"),
    "var_mean": (_S, "variance: cancellation"),
    "std": (_S, "variance: cancellation"),
    "std_mean": (_S, "variance: cancellation"),
    "norm": (_S, "sum of squares overflows"),
    "linalg_vector_norm": (_S, "sum of squares overflows"),
    "_weight_norm": (_S, "weight normalisation: a norm, sum of squares overflows"),
    "_weight_norm_interface": (_S, "weight normalisation: a norm, sum of squares overflows"),
    "dot": (_S, "a reduction of products: accumulation error; not in autocast's lower-precision list"),
    "vdot": (_S, "a reduction of products: accumulation error; not in autocast's lower-precision list"),
    "cumsum": (_S, "running sum: error grows with length"),
    "histc": (_S, "bin counts: bf16 counts exactly only to 256, fp16 to 2048"),
    "cumprod": (_S, "running product: under/overflow"),
    "prod": (_S, "product: under/overflow"),
    "logsumexp": (_S, "log-sum-exp over many terms"),
    "softplus": (_S, "log(1+exp): overflow"),
    "erfinv": (_S, "steep near ±1"),
    "acos": (_S, "steep near ±1"),
    "asin": (_S, "steep near ±1"),
    "cosh": (_S, "overflow"),
    "sinh": (_S, "overflow"),
    "tan": (_S, "poles"),
    "dist": (_S, "sum of squares"),
    "cdist": (_S, "sum of squares"),
    "renorm": (_S, "norm of rows"),
    # --- follow: elementwise / data movement; exact or correctly rounded in any float type.
    **{
        name: (_F, "elementwise; correctly rounded in any float type")
        for name in (
            "add", "sub", "mul", "div", "neg", "abs", "relu", "gelu", "silu", "sigmoid", "tanh",
            "where", "masked_fill", "clamp", "clamp_min", "clamp_max", "maximum", "minimum",
            "sin", "cos", "sqrt", "rsub", "dropout", "native_dropout", "hardtanh", "leaky_relu",
            "elu", "mish", "erf", "square", "sign", "fill", "lerp", "addcmul", "addcdiv",
            "triu", "tril", "scalar_tensor", "zeros_like", "ones_like", "full_like", "fill_",
            "copy", "copy_", "empty_like", "bernoulli", "rand_like", "randn_like", "round",
            "floor", "ceil", "trunc", "frac", "remainder", "fmod", "max", "min", "amax", "amin",
            "glu", "gelu_", "relu_", "hardswish", "hardsigmoid", "logit", "threshold",
        )
    },
    **{
        name: (_F, "data movement; exact in any dtype")
        for name in (
            "view", "reshape", "_unsafe_view", "permute", "transpose", "t", "expand", "unsqueeze",
            "squeeze", "slice", "select", "index", "index_select", "gather", "cat", "stack",
            "split", "split_with_sizes", "chunk", "unbind", "contiguous", "clone", "alias",
            "flatten", "unflatten", "narrow", "repeat", "repeat_interleave", "roll", "flip",
            "pad", "constant_pad_nd", "embedding", "getitem", "detach", "detach_", "lift_fresh_copy",
            "movedim", "view_as", "expand_as", "diagonal", "as_strided", "index_put",
            "scatter", "scatter_add", "masked_select", "to", "new_zeros", "new_ones", "new_full",
            "broadcast_tensors", "broadcast_to", "numpy_T", "swapdims", "mH", "adjoint",
            "new_empty", "type_as", "_unsafe_index", "unfold", "tile", "swapaxes", "mT",
            "dim", "sym_size", "size", "softmax_backward_data", "diff", "masked_scatter",
            "index_copy", "index_add", "take_along_dim", "as_strided_scatter", "slice_scatter",
            "select_scatter", "view_as_real", "view_as_complex", "zero", "zero_",
            "feature_dropout", "alpha_dropout", "split_with_sizes_copy", "unsafe_split",
            "atleast_1d", "atleast_2d", "squeeze_", "unsqueeze_", "t_", "_to_copy",
            "item", "_local_scalar_dense", "topk", "sort",
        )
    },
    **{
        name: (_F, "max over a window: exact in any dtype")
        for name in ("max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices",
                     "max_pool3d_with_indices", "adaptive_max_pool1d", "adaptive_max_pool2d",
                     "adaptive_max_pool3d")
    },
    **{
        name: (_F, "mean over a window; torch's kernels accumulate low-precision inputs in fp32 "
                   "(opmath) and round once")
        for name in ("avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
                     "adaptive_avg_pool3d", "_adaptive_avg_pool2d", "_adaptive_avg_pool3d")
    },
    **{
        name: (_F, "elementwise; correctly rounded in any float type")
        for name in (
            "gelu_tanh", "tanh_", "sigmoid_", "pow_", "mul_", "add_", "sub_", "div_", "neg_",
            "masked_fill_", "clamp_", "erfc", "exp_", "softsign", "silu_", "selu", "celu",
            "logical_not", "bitwise_not", "isnan", "isinf", "isfinite", "nan_to_num",
            "heaviside", "hypot", "atan", "atan2", "cos_", "sin_", "xlogy", "float_power",
        )
    },
}

#: Higher-order ops torch.export records for ``with torch.autocast(...)`` and ``torch.no_grad()``
#: blocks. autoprec keeps them whole (an opaque region computing in fp32): the user asked for a
#: numerics/autograd context there, and inlining them would silently drop it (case C13).
REGION_OPS: dict[str, str] = {
    "wrap_with_autocast": "user's torch.autocast region (enabled=False: fp32 by request)",
    "wrap_with_set_grad_enabled": "user's torch.no_grad()/enable_grad() region; kept whole, fp32",
}

#: Reductions that accumulate many terms; with ``policy.accumulate == "fp32"`` a lowered one
#: accumulates in fp32 (``dtype=torch.float32`` where the op has that argument, else fp32 inputs)
#: and casts its (small) result back (case C06).
REDUCTION_OPS: frozenset[str] = frozenset(
    {"sum", "mean", "var", "std", "var_mean", "std_mean", "cumsum", "cumprod", "prod", "norm",
     "linalg_vector_norm", "logsumexp", "nansum", "nanmean"}
)
#: Reductions whose ATen schema has a ``dtype`` (accumulation dtype) keyword.
REDUCTIONS_WITH_DTYPE: frozenset[str] = frozenset(
    {"sum", "mean", "cumsum", "cumprod", "prod", "linalg_vector_norm", "nansum", "nanmean"}
)
#: Ops that write a scalar fill value into a tensor (attention masks); an out-of-range fill value
#: such as ``-1e9`` in fp16 is replaced by ``finfo(dtype).min`` rather than keeping fp32 (C03).
MASK_FILL_OPS: frozenset[str] = frozenset(
    {"masked_fill", "masked_fill_", "fill", "fill_", "full", "full_like", "new_full", "where",
     "scalar_tensor"}
)

RMSNORM_REASON = (
    "decomposed RMSNorm (pow->mean->rsqrt->mul): x**2 overflows fp16 for |x| > 256 and rsqrt(inf)=0 "
    "zeroes the output silently (case C04)"
)

#: Ops whose output dtype is set by an argument; the pass keeps their dtype as captured.
FIXED_DTYPE_OPS: frozenset[str] = frozenset(
    {
        "_to_copy", "to", "full", "arange", "ones", "zeros", "empty", "scalar_tensor", "rand",
        "randn", "randint", "linspace", "new_ones", "new_zeros", "new_full", "new_empty",
        "empty_like", "zeros_like", "ones_like", "full_like", "type_as", "lift_fresh_copy",
        "tensor", "eye", "_assert_tensor_metadata",
    }
)

for _name in FIXED_DTYPE_OPS:  # factories / explicit casts: in the table so they never warn
    OP_TABLE.setdefault(_name, (_F, "sets its own dtype (argument); kept as captured, inputs never cast"))

_warned: set[str] = set()


def sets_own_dtype(node: fx.Node) -> bool:
    """Whether ``node``'s output dtype is set by the op itself: a :data:`FIXED_DTYPE_OPS` op, or an
    op overload called with a ``dtype`` argument that is not None (``softmax.int(x, -1,
    torch.float32)``, ``sum.dim_IntList(..., dtype=torch.float32)``: the model asked for that
    dtype, so a policy cannot change it; a rule lowering it made the lowered graph fail its
    verification)."""
    return op_name(node) in FIXED_DTYPE_OPS or isinstance(op_argument(node, "dtype"), torch.dtype)


def _first_alias(node: fx.Node) -> tuple[Any, Any] | None:
    """``(alias_info of the op's first argument, of its first return)`` for an op overload node
    with a tensor first argument, else None (``Tensor(a!) self`` is written in place; a view op's
    ``Tensor(a) self -> Tensor(a)`` returns an alias of it)."""
    schema = overload_schema(node.target) if node.op == "call_function" else None
    if schema is None or not schema.arguments or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    return schema.arguments[0].alias_info, (schema.returns[0].alias_info if schema.returns else None)


def written_in_place(nodes: Iterable[fx.Node]) -> dict[fx.Node, fx.Node]:
    """``{node: base}`` for each tensor changed in place, directly or through views, and each op on
    the way: the in-place op (its schema writes its first argument, ``Tensor(a!) self``), the views
    it writes through (``z[:, :8] = x``: ``slice`` then ``copy_``; a view returns an alias of its
    first argument, ``Tensor(a) self -> Tensor(a)``), and the base they alias, mapped to itself: a
    graph input (a batch tensor the caller sees change) or a node (``torch.zeros(...)`` filled
    slice by slice).

    These nodes compute in the base's dtype, and the base's casts are placed where it is read
    (:mod:`autoprec.passes.assign`, :mod:`autoprec.passes.casts`). A cast in front of the write
    gave the op a copy to change; a cast placed right after the base read its values before the
    write: the caller's ``x`` kept its values, and a zero-padded input computed on zeros."""
    out: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        alias = _first_alias(node)
        if alias is None or alias[0] is None or not alias[0].is_write:
            continue
        chain, cur = [node], node.args[0]
        while isinstance(cur, fx.Node):
            view = _first_alias(cur)
            if view is None or view[0] is None or view[0].is_write or view[1] is None:
                break  # not a view of its first argument: the base
            chain.append(cur)
            cur = cur.args[0]
        if isinstance(cur, fx.Node):
            out.update(dict.fromkeys([*chain, cur], cur))
    return out


def op_argument(node: fx.Node, name: str) -> Any:
    """The value of the argument ``name`` of ``node``'s op, read through the op's schema: given by
    keyword, by position, or the schema's default; None when the target is not an op overload
    (:func:`autoprec._torch_compat.overload_schema`) or has no such argument."""
    schema = overload_schema(node.target) if node.op == "call_function" else None
    for i, a in enumerate(schema.arguments if schema is not None else ()):
        if a.name == name:
            if name in node.kwargs:
                return node.kwargs[name]
            return node.args[i] if i < len(node.args) and not a.kwarg_only else a.default_value
    return None


def is_float_value(val: object) -> bool:
    """True if ``val`` (a ``node.meta["val"]``) is a floating-point tensor."""
    return isinstance(val, torch.Tensor) and val.dtype.is_floating_point


def produces_float(node: fx.Node) -> bool:
    """True if ``node`` outputs a floating tensor (or a tuple holding one), per ``meta["val"]``."""
    return captured_dtype(node) is not None


def captured_dtype(node: fx.Node) -> str | None:
    """Policy name of the dtype ``node`` had when captured: its first floating output's dtype
    from ``node.meta["val"]`` (``str(dtype)`` for dtypes without a policy name, e.g. float64),
    or ``None`` when it produces no floating tensor."""
    val = node.meta.get("val")
    for v in val if isinstance(val, (tuple, list)) else [val]:
        if is_float_value(v):
            return NAMES.get(v.dtype, str(v.dtype))
    return None


def classify(node: fx.Node) -> str:
    """The op class of a ``call_function`` node: matmul / sensitive / follow / nonfloat / region.

    A region op (:data:`REGION_OPS`: a user's ``torch.autocast`` or ``torch.no_grad()`` block) is
    ``region``, kept whole in fp32 by the assign pass. Any other node whose output is not a floating
    tensor is ``nonfloat`` whatever its op. An op missing from :data:`OP_TABLE` is ``follow``, with
    a one-time ``UserWarning`` naming it.
    """
    name = op_name(node)
    if name in REGION_OPS:
        return "region"
    if not produces_float(node):
        return "nonfloat"
    entry = OP_TABLE.get(name)
    if entry is None:
        if name not in _warned:
            _warned.add(name)
            warnings.warn(
                f"autoprec: op {name!r} is not in the op table; treating it as 'follow'",
                stacklevel=2,
            )
        return "follow"
    return entry[0]


def reason(op: str) -> str:
    """The one-line numerical reason recorded for ``op`` (``""`` if the op is unknown)."""
    if op in REGION_OPS:
        return REGION_OPS[op]
    return OP_TABLE.get(op, ("", ""))[1]


def op_name(node: object) -> str:
    """The ATen op name of a ``call_function`` node without namespace or overload (``""`` for
    anything else): ``aten.linear.default`` -> ``"linear"``; ``operator.getitem`` -> ``"getitem"``.

    The one rule for an op's name: the op table, node keys and the passes all use it.
    """
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return ""
    t = node.target
    return str(getattr(t, "_opname", None) or getattr(t, "__name__", None) or t)


_PASS_THROUGH = {"to", "_to_copy", "contiguous", "clone", "alias", "type_as"}


def _base(node: object) -> object:
    """``node`` with dtype conversions / copies stripped (``x.to(float32)`` -> ``x``)."""
    while isinstance(node, fx.Node) and op_name(node) in _PASS_THROUGH and node.args:
        node = node.args[0]
    return node


def _is_square_of(node: fx.Node) -> object | None:
    """If ``node`` computes ``x**2`` (pow 2, square, or x*x), return ``x``'s base."""
    op = op_name(node)
    if op == "pow" and len(node.args) >= 2 and node.args[1] == 2:
        return _base(node.args[0])
    if op == "square":
        return _base(node.args[0])
    if op == "mul" and len(node.args) == 2 and _base(node.args[0]) is _base(node.args[1]):
        return _base(node.args[0])
    return None


def rmsnorm_regions(nodes: list[fx.Node]) -> list[list[fx.Node]]:
    """Find decomposed RMSNorms: ``x * rsqrt(mean(x**2) + eps)`` (or ``x / sqrt(...)``).

    Matches what HF Llama/Qwen2/Mistral/Gemma/T5 RMSNorm modules export to: ``pow(x, 2)``
    (or ``x * x``, ``square``) -> ``mean`` (or ``sum`` divided by a number, case C04's
    ``x.pow(2).sum(-1) / d``) -> optional ``add(eps)`` -> ``rsqrt`` -> ``mul`` by ``x``
    (``sqrt`` -> ``div`` also), where ``x`` may pass through ``.to``/copies.

    Args:
        nodes: Graph nodes.

    Returns:
        One list per match: the square, mean (or sum and its division), optional add, rsqrt/sqrt
        and the applying mul/div nodes (the scale by the weight is not included: it is an
        ordinary ``follow``).
    """
    regions = []
    for r in nodes:
        rop = op_name(r)
        if rop not in ("rsqrt", "sqrt"):
            continue
        chain = [r]
        m = r.args[0]
        if op_name(m) == "add":
            chain.append(m)
            m = next((a for a in m.args if isinstance(a, fx.Node)), None)
        reduce = _mean_of(m)
        if reduce is None:
            continue
        sq = reduce[-1].args[0]
        x = _is_square_of(sq)
        if x is None:
            continue
        chain += [*reduce, sq]
        apply_op = "mul" if rop == "rsqrt" else "div"
        for u in r.users:
            if op_name(u) == apply_op and any(a is not r and _base(a) is x for a in u.args):
                chain.append(u)
        if len(chain) > 3 and chain[-1] not in chain[:-1] and op_name(chain[-1]) == apply_op:
            regions.append(list(reversed(chain)))
    return regions


def _mean_of(m: Any) -> list[fx.Node] | None:
    """The nodes of a mean over the last dims as RMSNorm spellings write it: ``mean(sq)``, or
    ``sum(sq)`` divided by (or multiplied with) a number (``x.pow(2).sum(-1) / d``); the
    ``sum``/``mean`` node last. None for anything else."""
    if op_name(m) == "mean" and isinstance(m.args[0], fx.Node):
        return [m]
    if op_name(m) in ("div", "mul") and len(m.args) == 2:
        total, scale = (m.args if op_name(m) == "div" or isinstance(m.args[0], fx.Node)
                        else reversed(m.args))
        if (op_name(total) == "sum" and isinstance(total.args[0], fx.Node)
                and isinstance(scale, (int, float)) and not isinstance(scale, bool)):
            return [m, total]
    return None
