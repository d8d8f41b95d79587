"""Pass 3: fp32 accumulation for reductions computed in a low dtype (docs/architecture.md#data-flow, case
C06).

Adding ``0.01`` into a bf16 accumulator 1000 times gives 4.0, not 10.0: each partial sum is
rounded to 8 mantissa bits. When ``policy.accumulate == "fp32"`` (the default) every reduction
(:data:`autoprec.ops.REDUCTION_OPS`) whose assigned dtype is low is rewritten to accumulate in
fp32 and cast its result back to the low dtype, so the rest of the graph (and cast placement)
is unchanged:

- ops with an accumulation-dtype argument (``sum``, ``mean``, ``cumsum``, ``prod``,
  ``linalg_vector_norm``): ``dtype=torch.float32`` is set on the node (inputs stay low: no
  extra cast of the large input), then ``_to_copy(.., dtype=low)``;
- others (``var``, ``std``, ``logsumexp``...): the low inputs are upcast to fp32 first.

Matmuls need no rewrite: BLAS/oneDNN/cuBLAS kernels for bf16/fp16 already accumulate in fp32
(TVM's ToMixedPrecision leaves accumulation to the kernel; this pass covers the reductions that
are separate ops in the graph).
"""

from __future__ import annotations

import torch
from torch import fx

from autoprec.dtypes import LOW_DTYPES, to_torch
from autoprec.nodemeta import NodeMeta, meta_of, read_meta, set_meta
from autoprec.ops import REDUCTION_OPS, REDUCTIONS_WITH_DTYPE
from autoprec.passes.base import PassBase, PassResult, pass_error, writable
from autoprec.passes.casts import CAST_OP
from autoprec.policy import Policy

PASS = "accumulate_fp32"


def _new_cast(graph: fx.Graph, src: fx.Node, dt: str, where: str, after: fx.Node) -> fx.Node:
    with graph.inserting_after(after):
        c = graph.call_function(CAST_OP, (src,), {"dtype": to_torch(dt)})
    c.meta["val"] = src.meta.get("val")
    c.meta["nn_module_stack"] = src.meta.get("nn_module_stack", {})
    key = read_meta(src).key or src.name
    set_meta(c, NodeMeta(dtype=dt, inserted_cast=True, op_class="cast", decided_by=PASS,
                         key=f"{where}({key})->{dt}"))
    return c


def _low_reduction(node: fx.Node) -> bool:
    """True for a reduction (:data:`autoprec.ops.REDUCTION_OPS`) assigned a low dtype."""
    meta = read_meta(node)
    return node.op == "call_function" and meta.op in REDUCTION_OPS and meta.dtype in LOW_DTYPES


def accumulate_fp32(gm: fx.GraphModule, policy: Policy) -> PassResult:
    """Make low-precision reductions of ``gm`` (a copy) accumulate in fp32.

    Args:
        gm: Output of :func:`autoprec.passes.casts.insert_casts`; not modified (unless the runner owns it:
            :func:`autoprec.passes.base.writable`).
        policy: Its ``accumulate`` field: ``"fp32"`` rewrites, ``"none"`` returns ``gm`` itself.

    Returns:
        ``PassResult`` with stats ``accumulate_fp32`` (reductions rewritten) and
        ``accumulate_casts`` (casts this pass added).

    Raises:
        PassError: a reduction's output is not a single tensor (cannot be cast back).
    """
    stats = {"accumulate_fp32": 0, "accumulate_casts": 0}
    if policy.accumulate != "fp32":
        return PassResult(gm, False, stats)  # nothing to rewrite: no copy (as math_attention)
    gm = writable(gm)
    graph = gm.graph
    for node in list(graph.nodes):
        if not _low_reduction(node):
            continue
        meta = meta_of(node)
        op, dt = meta.op, meta.dtype
        if not isinstance(node.meta.get("val"), torch.Tensor):
            raise pass_error(PASS, node, "reduction with several outputs cannot accumulate in fp32")
        if op in REDUCTIONS_WITH_DTYPE:
            node.kwargs = {**node.kwargs, "dtype": torch.float32}
        else:
            def up(a, dt=dt):
                if isinstance(a, fx.Node) and read_meta(a).dtype == dt:
                    stats["accumulate_casts"] += 1
                    return _new_cast(graph, a, "fp32", "upcast", a)
                return a

            node.args = fx.node.map_arg(node.args, up)
        users = list(node.users)
        back = _new_cast(graph, node, dt, "accumulated", node)
        for u in users:
            u.replace_input_with(node, back)
        meta.dtype, meta.accumulate, meta.lowered_to = "fp32", "fp32", dt
        meta.decided_by = f"{meta.decided_by}; {PASS}"
        stats["accumulate_fp32"] += 1
        stats["accumulate_casts"] += 1
    gm.recompile()
    return PassResult(gm, stats["accumulate_fp32"] > 0, stats)


class AccumulateFp32(PassBase):
    """Pass 3 as a :class:`~autoprec.passes.base.PassBase`: :func:`accumulate_fp32` for a policy.

    Args:
        policy: Its ``accumulate`` field decides whether reductions are rewritten.
    """

    name = PASS

    def __init__(self, policy: Policy) -> None:
        self.policy = policy

    def call(self, gm: fx.GraphModule) -> PassResult:
        """``accumulate_fp32(gm, policy)``; ``gm`` is not modified
        (unless the runner owns it: ``writable``)."""
        return accumulate_fp32(gm, self.policy)

    def ensures(self, gm: fx.GraphModule) -> None:
        """With ``policy.accumulate == "fp32"``, no reduction is left accumulating in a low dtype.

        Raises:
            PassError: a reduction still has a low assigned dtype.
        """
        if self.policy.accumulate != "fp32":
            return
        for node in gm.graph.nodes:
            if _low_reduction(node):
                raise pass_error(PASS, node, "reduction still accumulates in a low dtype")
