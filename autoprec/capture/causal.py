"""Causal masks built from shapes become SDPA's ``is_causal`` (docs/architecture.md#design-choices).

A model that builds its causal mask in Python (Hugging Face's ``sdpa_mask``: ``arange`` position
ids, a packed-sequence check, ``le`` and ``and`` over broadcast indices) skips the mask and calls
``scaled_dot_product_attention(..., is_causal=True)`` when it runs eagerly, but materialises it
while it is traced, as ``torch.export`` (and ``torch.compile``) do. The captured graph then
calls SDPA with an explicit boolean mask, and on CUDA a masked SDPA cannot use the
FlashAttention kernel: torch.autocast eager (mask skipped) ran 1.2x faster than the same
computation through the captured graph on an H200; with the rewrite 1.15x
(benchmarks/results/gpu_h200_2026-12-04b).

:func:`causal_attention` finds SDPA nodes whose mask is a pure function of the input *shapes*
(every input it reads, it reads through ``sym_size`` only: no token ids, no padding mask),
evaluates that function at the captured sizes and, for a dynamic capture, at each size + 1
(on ``meta`` inputs: no data is read), and where the mask equals SDPA's own causal mask
(``ones(L, S).tril()``, top-left aligned, broadcast over batch and heads) at every size
evaluated, passes ``is_causal=True`` instead. Masks that depend on data (a padding
``attention_mask``), sliding windows and bidirectional masks are left as they are.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import fx

from autoprec._torch_compat import optimization_hint

__all__ = ["causal_attention"]

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_SHAPE_OPS = {torch.ops.aten.sym_size.int}
_MASK, _IS_CAUSAL = 3, 5  # positions in aten.scaled_dot_product_attention's schema


def causal_attention(gm: fx.GraphModule) -> int:
    """Replace shape-only causal masks of ``gm``'s SDPA nodes with ``is_causal=True``, in place.

    Args:
        gm: A freshly exported graph (``node.meta["val"]`` fake tensors on every node).

    Returns:
        The number of SDPA nodes rewritten (the mask nodes no longer read are erased).
    """
    done = 0
    for node in [n for n in gm.graph.nodes if n.target is _SDPA]:
        mask = node.args[_MASK] if len(node.args) > _MASK else node.kwargs.get("attn_mask")
        if isinstance(mask, fx.Node) and not _flag(node) and _is_causal_mask(gm, node, mask):
            args = list(node.args[:_MASK]) + [None] + list(node.args[_MASK + 1:])
            kwargs = dict(node.kwargs, attn_mask=None) if "attn_mask" in node.kwargs else dict(node.kwargs)
            if len(args) > _IS_CAUSAL:
                args[_IS_CAUSAL] = True
            else:
                kwargs["is_causal"] = True
            node.args, node.kwargs = tuple(args), kwargs
            done += 1
    if done:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return done


def _flag(node: fx.Node) -> bool:
    """Whether ``node`` already passes ``is_causal=True`` (then it has no mask to replace)."""
    v = node.args[_IS_CAUSAL] if len(node.args) > _IS_CAUSAL else node.kwargs.get("is_causal", False)
    return bool(v)


def _ancestors(mask: fx.Node) -> list[fx.Node] | None:
    """The nodes ``mask`` is computed from, in graph order; None when it reads an input's values
    (not only its sizes) or a parameter."""
    seen: dict[fx.Node, None] = {}
    todo = [mask]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen[n] = None
        if n.op == "placeholder":
            continue
        if n.op not in ("call_function", "get_attr"):
            return None
        for a in n.all_input_nodes:
            if a.op == "placeholder" and n.target not in _SHAPE_OPS:
                return None  # reads an input's data
            todo.append(a)
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _is_causal_mask(gm: fx.GraphModule, sdpa: fx.Node, mask: fx.Node) -> bool:
    """Whether ``mask``, computed from shapes only, equals SDPA's causal mask at the captured sizes
    (and at each size + 1 for a dynamic capture)."""
    nodes = _ancestors(mask)
    if nodes is None or any(n.op == "get_attr" and isinstance(_attr(gm, n), torch.nn.Parameter)
                            for n in nodes):
        return False
    sub, inputs = _subgraph(gm, nodes, mask)
    symbols = _symbols(inputs + [sdpa.args[0], sdpa.args[1]])
    trials = [symbols] + ([{s: h + 1 for s, h in symbols.items()}] if symbols else [])
    for sizes in trials:
        try:
            shapes = [_concrete(p.meta["val"].shape, sizes) for p in inputs]
            value = sub(*[torch.empty(s, device="meta") for s in shapes])
            q = _concrete(sdpa.args[0].meta["val"].shape, sizes)
            k = _concrete(sdpa.args[1].meta["val"].shape, sizes)
        except Exception:  # noqa: BLE001 - code that fails at another size is not rewritten
            return False
        if not _equals_causal(value, q[-2], k[-2]):
            return False
    return True


def _attr(gm: fx.GraphModule, n: fx.Node) -> Any:
    obj: Any = gm
    for part in str(n.target).split("."):
        obj = getattr(obj, part)
    return obj


def _subgraph(gm: fx.GraphModule, nodes: list[fx.Node], out: fx.Node) -> tuple[fx.GraphModule, list[fx.Node]]:
    """A GraphModule computing ``out`` from ``nodes``; its placeholders are those of ``nodes``."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs = [n for n in nodes if n.op == "placeholder"]
    for n in nodes:
        env[n] = g.placeholder(n.name) if n.op == "placeholder" else g.node_copy(n, env.__getitem__)
    g.output(env[out])
    return fx.GraphModule(gm, g), inputs


def _symbols(nodes: list[fx.Node]) -> dict[Any, int]:
    """The size symbols of ``nodes``' recorded shapes (dimensions that are a bare symbol), each
    with its captured value; a shape of another symbolic form fails :func:`_concrete` later."""
    found: dict[Any, int] = {}
    for n in nodes:
        for d in getattr(n.meta.get("val"), "shape", ()):
            if isinstance(d, torch.SymInt) and d.node.expr.is_Symbol:
                found[d.node.expr] = int(optimization_hint(d))
    return found


def _concrete(shape: Any, sizes: dict[Any, int]) -> tuple[int, ...]:
    """``shape`` with its symbolic sizes evaluated at ``sizes``."""
    return tuple(int(d.node.expr.subs(sizes)) if isinstance(d, torch.SymInt) else int(d) for d in shape)


def _equals_causal(value: Any, q_len: int, k_len: int) -> bool:
    """Whether the mask ``value`` (bool: True attends; float: 0 attends, -inf or the dtype's lowest
    does not) is ``ones(q_len, k_len).tril()`` for every batch and head it broadcasts over."""
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.device.type == "meta":
        return False
    if value.dtype == torch.bool:
        allowed = value
    elif value.is_floating_point():
        low = value.float()
        blocked = (low == -math.inf) | (value == torch.finfo(value.dtype).min)
        if not bool(((value == 0) | blocked).all()):
            return False
        allowed = value == 0
    else:
        return False
    causal = torch.ones(q_len, k_len, dtype=torch.bool, device=value.device).tril()
    try:
        return bool((torch.broadcast_to(allowed, torch.broadcast_shapes(allowed.shape, causal.shape))
                     == causal).all()) and allowed.shape[-2:] in ((q_len, k_len), (1, k_len), (q_len, 1))
    except RuntimeError:
        return False
