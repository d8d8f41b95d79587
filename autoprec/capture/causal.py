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
(every input it reads, it reads through ``sym_size`` only: no token ids, no padding mask, no
parameter; buffers are read by value, as the exported graph reads them), evaluates that function
(on ``meta`` inputs: no data is read) and, where the mask equals SDPA's own causal mask
(``ones(L, S).tril()``, top-left aligned, broadcast over batch and heads) at every size
evaluated, passes ``is_causal=True`` instead. A static capture runs at its captured sizes only, so
they are the only ones evaluated. A dynamic capture is evaluated at its captured sizes, at each
size + 1 alone (a bottom-right-aligned mask differs when the query and key lengths part), at a
sequence length past the largest number in the mask's code and the tensors it reads (a sliding
window or a chunk of 4096 looks causal at every length up to 4096; written ``triu(-4095)``,
``j - i > -4096``, as a float or in a buffer), and at the top of the capture's sequence range:
where the length past the largest number is within that range but its mask would exceed
:data:`MAX_CELLS` cells, the mask stays (the range's top is skipped when too large). Masks that
depend on data (a padding ``attention_mask``), sliding windows, chunked and bidirectional masks
stay.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import fx

from autoprec._torch_compat import optimization_hint, pytree

__all__ = ["MAX_CELLS", "causal_attention"]

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_SHAPE_OPS = {torch.ops.aten.sym_size.int}
_MASK, _IS_CAUSAL = 3, 5  # positions in aten.scaled_dot_product_attention's schema
#: Most cells (batch x heads x query x key, as the mask is shaped) a mask is evaluated at past the
#: captured sizes (2**26: one 8192 x 8192 mask).
MAX_CELLS = 1 << 26


def causal_attention(gm: fx.GraphModule) -> int:
    """Replace shape-only causal masks of ``gm``'s SDPA nodes with ``is_causal=True``, in place.

    Args:
        gm: A freshly exported graph (``node.meta["val"]`` fake tensors on every node).

    Returns:
        The number of SDPA nodes rewritten (the mask nodes no longer read are erased).
    """
    done, judged = 0, {}  # (mask node, query and key shapes) -> causal? (one mask serves every layer)
    for node in [n for n in gm.graph.nodes if n.target is _SDPA]:
        positional = len(node.args) > _MASK
        mask = node.args[_MASK] if positional else node.kwargs.get("attn_mask")
        if not isinstance(mask, fx.Node) or _flag(node):
            continue
        key = (mask, *(str(a.meta["val"].shape) for a in node.args[:2]))  # the lengths it is judged at
        if key not in judged:
            judged[key] = _is_causal_mask(gm, node, mask)
        if not judged[key]:
            continue
        args, kwargs = list(node.args), dict(node.kwargs)
        if positional:
            args[_MASK] = None
        else:
            kwargs.pop("attn_mask")
        if len(args) > _IS_CAUSAL:
            args[_IS_CAUSAL] = True
        else:
            kwargs["is_causal"] = True
        node.args, node.kwargs = tuple(args), kwargs
        done += 1
    if done:
        for mask in {key[0] for key in judged}:
            _erase_unused(gm, mask)
        gm.graph.lint()
        gm.recompile()
    return done


def _erase_unused(gm: fx.GraphModule, mask: fx.Node) -> None:
    """Erase ``mask`` and the nodes it was computed from that nothing reads any more (only those:
    the rest of the graph is left as exported)."""
    for n in reversed(_ancestors(mask, data=True) or []):
        if n.op == "call_function" and not n.users:
            gm.graph.erase_node(n)


def _flag(node: fx.Node) -> bool:
    """Whether ``node`` already passes ``is_causal=True`` (then it has no mask to replace)."""
    v = node.args[_IS_CAUSAL] if len(node.args) > _IS_CAUSAL else node.kwargs.get("is_causal", False)
    return bool(v)


def _ancestors(mask: fx.Node, data: bool = False) -> list[fx.Node] | None:
    """The nodes ``mask`` is computed from, in graph order; None when it reads an input's values
    (not only its sizes) and ``data`` is False."""
    seen: dict[fx.Node, None] = {}
    todo = [mask]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen[n] = None
        if n.op == "placeholder":
            continue
        if n.op not in ("call_function", "get_attr") and not data:
            return None
        for a in n.all_input_nodes:
            if a.op == "placeholder" and n.target not in _SHAPE_OPS and not data:
                return None  # reads an input's data
            todo.append(a)
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _is_causal_mask(gm: fx.GraphModule, sdpa: fx.Node, mask: fx.Node) -> bool:
    """Whether ``mask``, computed from shapes only, equals SDPA's causal mask at every size the
    module docstring names."""
    nodes = _ancestors(mask)
    if nodes is None or any(n.op == "get_attr" and isinstance(_attr(gm, n), torch.nn.Parameter)
                            for n in nodes):
        return False
    sub, inputs = _subgraph(gm, nodes, mask)
    q, k = sdpa.args[0], sdpa.args[1]
    symbols = _symbols(inputs + [q, k])
    trials = _sizes(gm, symbols, nodes, mask, q, k) if symbols is not None else None
    if trials is None:
        return False
    for sizes in trials:
        try:
            shapes = [_concrete(p.meta["val"].shape, sizes) for p in inputs]
            value = sub(*[torch.empty(s, device="meta") for s in shapes])
            q_len = _concrete(q.meta["val"].shape, sizes)[-2]
            k_len = _concrete(k.meta["val"].shape, sizes)[-2]
        except Exception:  # noqa: BLE001 - code that fails at another size is not rewritten
            return False
        if not _equals_causal(value, q_len, k_len):
            return False
    return True


def _sizes(gm: fx.GraphModule, symbols: dict[Any, tuple[int, int | None]], nodes: list[fx.Node],
           mask: fx.Node, q: fx.Node, k: fx.Node) -> list[dict[Any, int]] | None:
    """The symbol values to evaluate a mask at (the module docstring's); None when a length past
    the mask's largest number is within the capture's range but too large to evaluate."""
    hints = {s: h for s, (h, _hi) in symbols.items()}
    trials = [hints] + [hints | {s: h + 1} for s, (h, hi) in symbols.items() if hi is None or h < hi]
    seq = [s for s in _free(q) | _free(k) if s in symbols]
    past = int(min(max(_numbers(gm, nodes), default=0.0), 2**31)) + 2
    uppers = {hi for s in seq if (hi := symbols[s][1]) is not None}
    for length, required in [(past, True)] + [(hi, False) for hi in sorted(uppers)]:
        need = [s for s in seq if hints[s] < length <= (symbols[s][1] or length)]
        if not need:
            continue
        sizes = hints | {s: length for s in need}
        try:
            cells = math.prod(_concrete(mask.meta["val"].shape, sizes))
        except Exception:  # noqa: BLE001 - a shape that cannot be evaluated: do not rewrite
            return None
        if cells <= MAX_CELLS:
            trials.append(sizes)
        elif required:
            return None
    return trials


def _free(node: fx.Node) -> set[Any]:
    """The size symbols of ``node``'s second-to-last dimension (a query's or key's length)."""
    d = node.meta["val"].shape[-2]
    return set(d.node.expr.free_symbols) if isinstance(d, torch.SymInt) else set()


def _numbers(gm: fx.GraphModule, nodes: list[fx.Node]) -> list[float]:
    """Every magnitude a window or chunk size could hide in: the finite numbers written in
    ``nodes``' arguments (``triu(-(W - 1))``, ``j - i > -W``, a float ``W``), and for the
    tensors they read (a buffer, a lifted constant) their sizes and, when small, their values."""
    found: list[float] = []
    for n in nodes:
        for x in pytree.tree_leaves((n.args, n.kwargs)):
            if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x):
                found.append(abs(float(x)))
        if n.op == "get_attr" and isinstance(t := _attr(gm, n), torch.Tensor):
            found.extend(float(d) for d in t.shape)
            if 0 < t.numel() <= 64 and not t.is_complex():
                values = t.detach().double().abs()
                found.extend(float(v) for v in values[torch.isfinite(values)].flatten())
    return found


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


def _symbols(nodes: list[fx.Node]) -> dict[Any, tuple[int, int | None]] | None:
    """The size symbols of ``nodes``' recorded shapes (dimensions that are a bare symbol), each with
    its captured value and the capture's upper bound (None: unbounded or unknown); None when a size
    has no captured value (unbacked). A shape of another symbolic form fails :func:`_concrete`."""
    found: dict[Any, tuple[int, int | None]] = {}
    for n in nodes:
        for d in getattr(n.meta.get("val"), "shape", ()):
            if isinstance(d, torch.SymInt) and d.node.expr.is_Symbol:
                hint = optimization_hint(d, fallback=None)
                if hint is None:
                    return None
                ranges = getattr(d.node.shape_env, "var_to_range", {}).get(d.node.expr)
                found[d.node.expr] = (int(hint), _finite(getattr(ranges, "upper", None)))
    return found


def _finite(bound: Any) -> int | None:
    """A range bound as an int; None for infinity or anything not a number."""
    try:
        return int(bound) if math.isfinite(float(bound)) else None
    except (TypeError, ValueError, OverflowError):
        return None


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
        blocked = (value == -math.inf) | (value == torch.finfo(value.dtype).min)
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
