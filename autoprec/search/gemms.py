"""The GEMM shapes ``(M, K, N)`` of a captured graph's matmuls, and how often each runs: what the
kernel probe (:mod:`autoprec.search.probe`) times (docs/architecture.md#search)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import fx

from autoprec.dtypes import LOW_DTYPES
from autoprec.nodekeys import op_name
from autoprec.nodemeta import read_meta
from autoprec.ops import classify

__all__ = ["Shape", "matmul_shape_counts", "matmul_shapes", "native_low_counts"]

#: A GEMM ``[M, K] @ [K, N]`` as ``(M, K, N)``.
Shape = tuple[int, int, int]


def _size(v: Any) -> int | None:
    """A concrete size (the hint of a symbolic one), or None."""
    if isinstance(v, int):
        return v
    hint = getattr(getattr(v, "node", None), "hint", None)
    return int(hint) if hint is not None else None


def _gemm(node: fx.Node) -> Shape | None:
    """``(M, K, N)`` of a plain GEMM node from its inputs' ``meta["val"]`` (batch dims folded into
    M), or None for other matmul-class ops (convolutions, attention, einsum, grouped GEMMs)."""
    name = op_name(node)
    first = {"linear": 0, "mm": 0, "bmm": 0, "matmul": 0, "addmm": 1, "baddbmm": 1, "addbmm": 1}.get(name)
    if first is None or len(node.args) < first + 2:
        return None
    vals = [getattr(a, "meta", {}).get("val") for a in node.args[first:first + 2]]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return None
    a, b = ([_size(s) for s in v.shape] for v in vals)
    if None in a or None in b or not a or not b:
        return None
    if name == "linear":  # x[..., K] @ W[N, K]^T
        return math.prod(a[:-1]), a[-1], b[0]
    a = [1, *a] if len(a) == 1 else a  # torch.matmul's 1-D rules: a row vector, a column vector
    b = [*b, 1] if len(b) == 1 else b
    try:
        batch = torch.broadcast_shapes(torch.Size(a[:-2]), torch.Size(b[:-2]))
    except RuntimeError:
        return None
    return math.prod(batch) * a[-2], a[-1], b[-1]  # addbmm: the batch is summed, the work is the same


def matmul_shape_counts(gm: fx.GraphModule) -> dict[Shape, int]:
    """How many matmul-class nodes of ``gm`` run each distinct GEMM shape ``(M, K, N)``
    (:func:`autoprec.ops.classify` ``== "matmul"``; ``linear``: ``x[..., K] @ W[N, K]^T``;
    ``mm``/``addmm``/``bmm``/``baddbmm``/``matmul``: batch dims folded into M), in graph order.
    Shapes come from the inputs' ``node.meta["val"]`` (symbolic sizes: their hints); matmul-class
    ops that are not a plain GEMM (convolutions, attention, einsum) are left out."""
    counts: dict[Shape, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and classify(node) == "matmul":
            shape = _gemm(node)
            if shape is not None and min(shape) > 0:
                counts[shape] = counts.get(shape, 0) + 1
    return counts


def native_low_counts(gm: fx.GraphModule) -> dict[str, dict[Shape, int]]:
    """``{low dtype: {(M, K, N): count}}`` of the plain GEMMs of an assigned (or lowered) graph that
    compute natively in a low dtype: a matmul-class node whose ``NodeMeta.dtype`` is ``bf16`` or
    ``fp16`` and that has no other compute dtype (the search's native kernel ``"bf16"``, not
    ``"bf16:fp32"``); shapes as :func:`matmul_shape_counts`'s. Empty for an all-fp32 graph."""
    out: dict[str, dict[Shape, int]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or classify(node) != "matmul":
            continue
        meta = read_meta(node)
        shape = _gemm(node)
        if meta.dtype in LOW_DTYPES and meta.compute is None and shape is not None and min(shape) > 0:
            counts = out.setdefault(meta.dtype, {})
            counts[shape] = counts.get(shape, 0) + 1
    return out


def matmul_shapes(gm: fx.GraphModule, top: int = 4) -> list[Shape]:
    """The ``top`` GEMM shapes ``(M, K, N)`` of ``gm`` by total FLOPs (count × 2·M·K·N, the
    forward's share of the model's matmul work), largest first (:func:`matmul_shape_counts`).
    4 keeps the probe to seconds while covering the projections, MLP and head of a transformer."""
    counts = matmul_shape_counts(gm)
    return sorted(counts, key=lambda s: -counts[s] * s[0] * s[1] * s[2])[:top]
