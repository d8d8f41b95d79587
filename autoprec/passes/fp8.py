"""Pass: matmuls whose compute dtype is fp8 run as ``autoprec::fp8_linear`` (docs/architecture.md#passes).

After ``insert_casts`` a node whose ``NodeMeta.compute`` is ``"fp8_e4m3"`` reads its inputs
and writes its output in its storage dtype; this pass swaps its ATen target for the fp8 linear of
:mod:`autoprec.kernels.fp8` (torchao.float8's ``matmul_with_hp_or_float8_args`` under the policy's
``fp8_scaling`` recipe: ``tensorwise``, ``rowwise`` or ``rowwise_with_gw_hp``, torchao's names),
keeping arguments and output dtype, so cast placement and the verifier see an ordinary node:

- ``linear(x[..., K], w[N, K], bias?)`` -> ``fp8_linear(x, w, bias, recipe)``;
- ``mm(a[M, K], b[K, N])`` and ``matmul(a[..., K], b[K, N])`` -> ``fp8_linear(a, t(b), None, recipe)``;
- ``addmm(bias[N], a[M, K], b[K, N])`` (GPT-2's ``Conv1D``; ``beta = alpha = 1``) ->
  ``fp8_linear(a, t(b), bias, recipe)``.

Other matmul-class ops (``bmm``, attention, convolutions) have no fp8 kernel; ``assign_dtypes``
leaves them in their storage dtype (:func:`fp8_lowerable`). torchao is needed only when a node is
lowered: without it the pass raises ImportError naming ``pip install torchao``.
"""

from __future__ import annotations

import torch
from torch import fx

from autoprec.dtypes import FP8_COMPUTE
from autoprec.nodemeta import meta_of, read_meta, set_meta
from autoprec.passes.base import PassBase, PassResult, pass_error, writable
from autoprec.policy import Policy

__all__ = ["LowerFp8", "fp8_lowerable", "lower_fp8"]

PASS = "lower_fp8"
_aten = torch.ops.aten
_LINEAR, _MM, _MATMUL, _ADDMM = (_aten.linear.default, _aten.mm.default, _aten.matmul.default,
                                 _aten.addmm.default)


def _rank(a: object) -> int | None:
    v = a.meta.get("val") if isinstance(a, fx.Node) else None
    return v.dim() if isinstance(v, torch.Tensor) else None


def fp8_lowerable(node: fx.Node) -> bool:
    """Whether the fp8 kernel can compute ``node``: ``linear`` with a 2-D weight, ``mm``, ``matmul``
    whose first operand has rank ≥ 2 and second is 2-D (the weight of ``x @ W``), or ``addmm``
    with ``beta = alpha = 1``."""
    if node.op != "call_function" or len(node.args) < 2:
        return False
    if node.target is _ADDMM:
        plain = all(node.kwargs.get(k, 1) == 1 for k in ("beta", "alpha"))
        return plain and len(node.args) == 3 and _rank(node.args[1]) == 2 and _rank(node.args[2]) == 2
    if node.target is _LINEAR:
        return _rank(node.args[1]) == 2
    if node.target in (_MM, _MATMUL):
        return _rank(node.args[1]) == 2 and (_rank(node.args[0]) or 0) >= 2
    return False


def _fp8_op(recipe: str) -> object:
    """``torch.ops.autoprec.fp8_linear.default``, after checking that torchao can run ``recipe``.

    Raises:
        ImportError: torchao is not installed (the message names ``pip install torchao``).
    """
    from autoprec.kernels.fp8 import torchao_config  # registers torch.ops.autoprec.fp8_linear

    torchao_config(recipe)
    return torch.ops.autoprec.fp8_linear.default


def lower_fp8(gm: fx.GraphModule, policy: Policy) -> PassResult:
    """Swap every fp8-compute matmul of a copy of ``gm`` for ``autoprec::fp8_linear``.

    Args:
        gm: Output of ``insert_casts``; not modified (unless the runner owns it:
            :func:`autoprec.passes.base.writable`).
        policy: Its ``fp8_scaling``, a torchao.float8 recipe name (``"tensorwise"``, ``"rowwise"``
            or ``"rowwise_with_gw_hp"``), goes to every fp8 node.

    Returns:
        ``PassResult`` with stats ``fp8_matmuls`` (nodes swapped).

    Raises:
        PassError: a node marked fp8 is not an op :func:`fp8_lowerable` accepts.
        ImportError: fp8 nodes but no torchao (a ``PassManager`` reports it as a PassError of
            this pass, the message kept).
    """
    stats = {"fp8_matmuls": 0}
    if not any(read_meta(n).compute == FP8_COMPUTE for n in gm.graph.nodes):
        return PassResult(gm, False, stats)  # nothing to lower: no copy (as math_attention)
    gm = writable(gm)
    nodes = [n for n in gm.graph.nodes if read_meta(n).compute == FP8_COMPUTE]
    op = _fp8_op(policy.fp8_scaling)
    for n in nodes:
        if not fp8_lowerable(n):
            raise pass_error(PASS, n, f"marked fp8 but {n.target} has no fp8 kernel")
        args = (n.args[1], n.args[2], n.args[0]) if n.target is _ADDMM else n.args  # (x, W, bias)
        x, w = args[0], args[1]
        bias = (args[2] if len(args) > 2 else n.kwargs.get("bias")) if n.target in (_LINEAR, _ADDMM) else None
        if n.target is not _LINEAR:  # x @ W[K, N] -> linear(x, W^T)
            src = w
            with gm.graph.inserting_before(n):
                w = gm.graph.call_function(_aten.t.default, (src,))
            w.meta["val"] = src.meta["val"].t()
            set_meta(w, read_meta(src).copy(key=f"t({read_meta(n).key})", inserted_cast=True,
                                            op_class="follow"))
        n.target, n.args, n.kwargs = op, (x, w, bias, policy.fp8_scaling), {}
        meta = meta_of(n)
        meta.decided_by = f"{meta.decided_by}; {PASS}"
        stats["fp8_matmuls"] += 1
    gm.recompile()
    return PassResult(gm, True, stats)


class LowerFp8(PassBase):
    """:func:`lower_fp8` as a :class:`~autoprec.passes.base.PassBase`.

    Args:
        policy: The policy (its ``fp8_scaling``: the torchao recipe).
    """

    name = PASS

    def __init__(self, policy: Policy) -> None:
        self.policy = policy

    def call(self, gm: fx.GraphModule) -> PassResult:
        """``lower_fp8(gm, policy)``; ``gm`` is not modified
        (unless the runner owns it: ``writable``)."""
        return lower_fp8(gm, self.policy)

    def ensures(self, gm: fx.GraphModule) -> None:
        """No node marked fp8 is left on an ATen matmul.

        Raises:
            PassError: an fp8-compute node still runs its original op.
        """
        for n in gm.graph.nodes:
            fp8 = read_meta(n).compute == FP8_COMPUTE
            if fp8 and n.target in (_LINEAR, _MM, _MATMUL, _ADDMM):
                raise pass_error(PASS, n, "marked fp8 but still runs the ATen matmul")
