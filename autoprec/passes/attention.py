"""Pass: with ``policy.attention == "math"``, SDPA nodes run as ``autoprec::sdpa_math``
(docs/architecture.md#passes).

After ``insert_casts`` an ``aten.scaled_dot_product_attention`` node reads ``query``, ``key`` and
``value`` in its storage dtype and writes its output in it. This pass swaps its target for
:func:`autoprec.kernels.attention.sdpa_math`, the same attention as two explicit GEMMs in that
dtype with an fp32 softmax, keeping arguments, keyword arguments, output dtype, node key and op
class, so cast placement, saved-activation rules and the verifier see the node they placed.
``"fused"`` (the default) leaves the graph as it is. Whether the explicit form is faster is
measured, per device, by the search (docs/architecture.md#search).
"""

from __future__ import annotations

import torch
from torch import fx

from autoprec.nodemeta import NodeMeta, meta_of, read_meta, set_meta
from autoprec.passes.base import PassBase, PassResult, pass_error, writable

__all__ = ["SDPA", "MathAttention", "has_sdpa", "math_attention"]

PASS = "math_attention"
#: PyTorch's fused attention op, as torch.export captures it.
SDPA = torch.ops.aten.scaled_dot_product_attention.default


def has_sdpa(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` runs ``aten.scaled_dot_product_attention`` (then ``Policy.attention`` applies)."""
    return any(n.target is SDPA for n in gm.graph.nodes)


def _math_op() -> object:
    import autoprec.kernels.attention  # noqa: F401  registers torch.ops.autoprec.sdpa_math

    return torch.ops.autoprec.sdpa_math.default


def _marked(n: fx.Node) -> bool:
    return n.target is SDPA and read_meta(n).impl == "math"


def math_attention(gm: fx.GraphModule) -> PassResult:
    """Retarget the SDPA nodes of a copy of ``gm`` that ``assign_dtypes`` marked
    ``impl="math"`` (all of them under ``policy.attention == "math"``) to ``autoprec::sdpa_math``.

    Args:
        gm: Output of ``insert_casts`` (or later); not modified (unless the runner owns it:
            :func:`autoprec.passes.base.writable`).

    Returns:
        ``PassResult`` with stats ``math_attention`` (nodes retargeted).
    """
    stats = {"math_attention": 0}
    if not any(_marked(n) for n in gm.graph.nodes):
        return PassResult(gm, False, stats)
    gm = writable(gm)
    op = _math_op()
    for n in list(gm.graph.nodes):
        if _marked(n):
            layout = n.meta.get("val")  # the fused kernel's output, as capture recorded it
            n.target = op
            meta = meta_of(n)
            meta.decided_by = f"{meta.decided_by}; {PASS}"
            stats["math_attention"] += 1
            if isinstance(layout, torch.Tensor):
                _keep_layout(gm, n, layout)
    gm.recompile()
    return PassResult(gm, True, stats)


def _keep_layout(gm: fx.GraphModule, node: fx.Node, fused: torch.Tensor) -> None:
    """Give ``node``'s readers its output in the fused kernel's memory layout.

    The fused CPU and CUDA kernels write ``[B, H, L, E]`` as ``[B, L, H, E]`` in memory (strides
    ``(L·H·E, E, H·E, 1)``), and a captured graph may rely on it: ``y.transpose(1, 2).contiguous()
    .view(B, L, H·E)`` (nanoGPT) is exported as transpose + view, the ``contiguous()`` a no-op there.
    :func:`~autoprec.kernels.attention.sdpa_math` returns a contiguous tensor, so a dense,
    non-contiguous recorded layout is rebuilt after it as permute → contiguous clone → permute
    (Inductor fuses the copy into its reader). Symbolic strides (a dynamic capture) are left as
    they are. The nodes read the output after its store cast when the node has one.
    """
    stride = tuple(fused.stride())
    if fused.is_contiguous() or not all(isinstance(d, int) for d in (*stride, *fused.shape)):
        return
    perm = sorted(range(fused.dim()), key=lambda d: -stride[d])
    inverse = [perm.index(d) for d in range(fused.dim())]
    if torch.empty(fused.shape, device="meta").permute(perm).contiguous().permute(inverse).stride() != stride:
        return  # not a permutation of a dense layout (e.g. expanded): nothing to rebuild
    meta = read_meta(node)
    src = node if meta.storage is None else next(iter(node.users))
    src_meta = read_meta(src)
    g = gm.graph
    with g.inserting_after(src):
        p = g.call_function(torch.ops.aten.permute.default, (src, perm))
    with g.inserting_after(p):
        c = g.call_function(torch.ops.aten.clone.default, (p,), {"memory_format": torch.contiguous_format})
    with g.inserting_after(c):
        q = g.call_function(torch.ops.aten.permute.default, (c, inverse))
    for k, new in enumerate((p, c, q)):
        set_meta(new, NodeMeta(key=f"layout({src_meta.key or src.name})#{k}", dtype=src_meta.dtype,
                               op_class="follow", decided_by=PASS, reason="the fused kernel's layout"))
    src.replace_all_uses_with(q, delete_user_cb=lambda u: u is not p)


class MathAttention(PassBase):
    """:func:`math_attention` as a :class:`~autoprec.passes.base.PassBase` (no options: the policy's
    ``attention`` field is read once, by ``assign_dtypes``, which marks the nodes)."""

    name = PASS

    def call(self, gm: fx.GraphModule) -> PassResult:
        """``math_attention(gm)``; ``gm`` is not modified
        (unless the runner owns it: ``writable``)."""
        return math_attention(gm)

    def ensures(self, gm: fx.GraphModule) -> None:
        """No node marked ``impl="math"`` still runs the fused SDPA.

        Raises:
            PassError: a marked node still runs ``aten.scaled_dot_product_attention``.
        """
        for n in gm.graph.nodes:
            if _marked(n):
                raise pass_error(PASS, n, "marked impl='math' but still runs the fused SDPA")
