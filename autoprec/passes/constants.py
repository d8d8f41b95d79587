"""Scalar constants that feed a lowered node, checked against the target dtype's range (case C03).

``x.masked_fill(mask, -1e9)`` is fine in fp32 and bf16 but ``-1e9`` is not representable in
fp16 (max 65504): PyTorch raises, or the value becomes ``-inf`` and a fully masked softmax row
becomes NaN. Likewise ``x + 1e5`` or ``x * 1e5`` overflows fp16. For every node whose dtype is
lowered, the scalar arguments are compared with ``torch.finfo(dtype).max``:

- mode ``"fix"`` (default): a fill value of a mask-fill op (:data:`autoprec.ops.MASK_FILL_OPS`)
  at or beyond the range becomes ``finfo(dtype).min`` (``.max`` for positive values), which is
  what HF models use for masks; any other out-of-range constant keeps its node in fp32
  (``decided_by="constant out of range"``), and, when the node adds or multiplies it into its
  output, the ``follow`` nodes reading that output (``autoprec.passes.assign``).
- mode ``"strict"``: any out-of-range constant raises :class:`~autoprec.errors.PassError` naming
  the node and the constant.

``±inf`` and NaN constants are representable in every float dtype and are left alone: a
fully masked row filled with ``-inf`` gives NaN after softmax in fp32 as in low precision, so
the drift check (NaN counts as infinite drift) reports it rather than the pass hiding it.
"""

from __future__ import annotations

import math

import torch
from torch import fx

from autoprec.dtypes import to_torch
from autoprec.nodemeta import read_meta
from autoprec.ops import MASK_FILL_OPS

__all__ = [
    "CONSTANT_MODES",
    "check_constants_mode",
    "clamp_to_range",
    "fill_limit",
    "is_mask_fill",
    "out_of_range_constants",
]

CONSTANT_MODES = ("fix", "strict")


def check_constants_mode(mode: str) -> None:
    """Check a constants mode name.

    Raises:
        ValueError: ``mode`` is not in :data:`CONSTANT_MODES`; the message lists the valid modes.
    """
    if mode not in CONSTANT_MODES:
        raise ValueError(f"unknown constants mode {mode!r}; valid: {', '.join(CONSTANT_MODES)}")

#: Ops whose scalar arguments are *values* combined with tensor elements (not sizes, dims or
#: indices: ``slice(x, 1, 0, 2**63 - 1)`` must not trip the check).
VALUE_SCALAR_OPS = MASK_FILL_OPS | {
    "add", "sub", "rsub", "mul", "div", "clamp", "clamp_min", "clamp_max", "maximum", "minimum",
    "lerp", "addcmul", "addcdiv", "threshold", "hardtanh", "remainder", "fmod", "add_", "sub_",
    "mul_", "div_", "clamp_",
}


def _scalars(node: fx.Node) -> list[tuple[int | str, float]]:
    """``(position or kwarg name, value)`` of every plain float/int scalar argument."""
    out: list[tuple[int | str, float]] = []
    for i, a in enumerate(node.args):
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            out.append((i, float(a)))
    for k, a in node.kwargs.items():
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            out.append((k, float(a)))
    return out


def fill_limit(dtype: str) -> float:
    """``torch.finfo(dtype).max`` for a policy dtype name."""
    return float(torch.finfo(to_torch(dtype)).max)


def out_of_range_constants(node: fx.Node, dtype: str) -> list[tuple[int | str, float]]:
    """Scalar arguments of ``node`` that are finite but beyond ``dtype``'s range.

    Args:
        node: A ``call_function`` node.
        dtype: Policy dtype name (``"fp16"``...).

    Returns:
        ``[(argument position or keyword, value), ...]``; empty when all fit.
    """
    if read_meta(node).op not in VALUE_SCALAR_OPS:
        return []
    limit = fill_limit(dtype)
    return [(i, v) for i, v in _scalars(node) if math.isfinite(v) and abs(v) > limit]


def is_mask_fill(node: fx.Node) -> bool:
    """True for ops that write a scalar fill value (``masked_fill``, ``full``, ``where``...)."""
    return read_meta(node).op in MASK_FILL_OPS


def clamp_to_range(node: fx.Node, dtype: str) -> list[tuple[int | str, float, float]]:
    """Replace out-of-range fill values of ``node`` by ``±finfo(dtype).max`` (``min`` for < 0).

    Returns:
        ``[(position or keyword, old value, new value), ...]`` of the rewritten arguments.
    """
    fi = torch.finfo(to_torch(dtype))
    changed = []
    args = list(node.args)
    kwargs = dict(node.kwargs)
    for i, v in out_of_range_constants(node, dtype):
        new = float(fi.min) if v < 0 else float(fi.max)
        if isinstance(i, int):
            args[i] = new
        else:
            kwargs[i] = new
        changed.append((i, v, new))
    node.args = tuple(args)
    node.kwargs = kwargs
    return changed
