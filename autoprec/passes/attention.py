"""Pass: with ``policy.attention == "math"``, SDPA nodes run as ``autoprec::sdpa_math`` (docs/architecture.md#passes).

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

from autoprec.passes.base import PassBase, PassResult, clone_graph_module, pass_error
from autoprec.policy import Policy

__all__ = ["MathAttention", "math_attention"]

PASS = "math_attention"
_SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _math_op() -> object:
    import autoprec.kernels.attention  # noqa: F401  registers torch.ops.autoprec.sdpa_math

    return torch.ops.autoprec.sdpa_math.default


def math_attention(gm: fx.GraphModule, policy: Policy) -> PassResult:
    """Retarget every SDPA node of a copy of ``gm`` to ``autoprec::sdpa_math`` when the policy
    asks for explicit attention.

    Args:
        gm: Output of ``insert_casts`` (or later); not modified.
        policy: Its ``attention`` field: ``"math"`` retargets, ``"fused"`` leaves the graph.

    Returns:
        ``PassResult`` with stats ``math_attention`` (nodes retargeted).
    """
    stats = {"math_attention": 0}
    if policy.attention != "math" or not any(n.target is _SDPA for n in gm.graph.nodes):
        return PassResult(gm, False, stats)
    gm = clone_graph_module(gm)
    op = _math_op()
    for n in gm.graph.nodes:
        if n.target is _SDPA:
            n.target = op
            n.meta["autoprec"]["decided_by"] = f"{n.meta['autoprec'].get('decided_by')}; {PASS}"
            stats["math_attention"] += 1
    gm.recompile()
    return PassResult(gm, True, stats)


class MathAttention(PassBase):
    """:func:`math_attention` as a :class:`~autoprec.passes.base.PassBase`.

    Args:
        policy: The policy (its ``attention`` field).
    """

    name = PASS

    def __init__(self, policy: Policy) -> None:
        self.policy = policy

    def call(self, gm: fx.GraphModule) -> PassResult:
        """``math_attention(gm, policy)``; ``gm`` is not modified."""
        return math_attention(gm, self.policy)

    def ensures(self, gm: fx.GraphModule) -> None:
        """Under ``attention="math"`` no fused SDPA node is left.

        Raises:
            PassError: a node still runs ``aten.scaled_dot_product_attention``.
        """
        if self.policy.attention == "math":
            for n in gm.graph.nodes:
                if n.target is _SDPA:
                    raise pass_error(PASS, n, "policy attention is 'math' but the node still runs the fused SDPA")
