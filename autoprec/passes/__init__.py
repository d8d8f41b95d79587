"""Graph passes that lower a captured graph to a policy's dtypes, run as a pass list.

Each pass is a :class:`PassBase` (as ``torch.fx.passes.infra.pass_base.PassBase``): a ``name``,
``call(gm) -> PassResult`` (on a copy of ``gm``) and a cheap post-condition ``ensures(gm)``;
the options it depends on (policy, placement mode, constants mode) go to its constructor.
:func:`lowering_passes` lists them in order:

1. ``assign_dtypes`` (:class:`~autoprec.passes.assign.AssignDtypes`): a dtype for every node from
   op classes, policy rules, cast placement for ``follow`` nodes and constant range checks;
   ensures every float node has one.
2. ``insert_casts`` (:class:`~autoprec.passes.casts.InsertCasts`): a cast where a float tensor
   crosses a dtype boundary; ensures every edge's dtypes agree.
3. ``accumulate_fp32`` (:class:`~autoprec.passes.accumulate.AccumulateFp32`): low-precision
   reductions accumulate in fp32; ensures none is left accumulating low.
4. ``lower_fp8`` (:class:`~autoprec.passes.fp8.LowerFp8`): matmuls computing in fp8 run the
   scaled fp8 matmul of :mod:`autoprec.kernels.fp8`; ensures none is left on its ATen op.
5. ``verify`` (:class:`~autoprec.passes.verify.Verify`): re-derives dtypes on fake tensors;
   ensures they match the assigned ones and the outputs keep their captured dtypes.

One runner, :class:`PassManager` (as torch.fx's ``PassManager``), runs a list (or a slice of
it: the search runs ``assign_dtypes`` alone, then resumes with the rest), linting the graph
and checking each post-condition after every pass; any failure raises
:class:`autoprec.errors.PassError` naming the pass (and the node, where known), a non-``PassError``
chained as its cause. :func:`run_pipeline` / :func:`lower` run the whole list. Every pass
records its decision in the node's :class:`~autoprec.nodemeta.NodeMeta`. :func:`first_nonfinite_node`
(not a pass) finds the node where a lowered graph overflows.
"""

from __future__ import annotations

from autoprec.passes.assign import assign_dtypes
from autoprec.passes.base import PassBase, PassResult, pass_error
from autoprec.passes.diagnose import first_nonfinite_node
from autoprec.passes.manager import PassManager
from autoprec.passes.pipeline import lower, lowering_passes, run_pipeline

__all__ = [
    "PassBase", "PassManager", "PassResult", "assign_dtypes", "first_nonfinite_node", "lower",
    "lowering_passes", "pass_error", "run_pipeline",
]
