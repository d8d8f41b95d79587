"""The lowering pass list: assign dtypes -> insert casts -> fp32 accumulation -> fp8 matmuls ->
explicit attention -> verify.

:func:`lowering_passes` builds it; :class:`~autoprec.passes.manager.PassManager` runs it
(``graph.lint()`` and each pass's post-condition after every pass; failures raise
``PassError`` naming the pass). :func:`run_pipeline` and :func:`lower` run the whole list.
"""

from __future__ import annotations

from torch import fx

from autoprec.passes.accumulate import AccumulateFp32
from autoprec.passes.assign import AssignDtypes
from autoprec.passes.attention import MathAttention
from autoprec.passes.base import PassResult
from autoprec.passes.casts import InsertCasts
from autoprec.passes.fp8 import LowerFp8
from autoprec.passes.manager import PassManager
from autoprec.passes.verify import Verify, output_dtypes
from autoprec.policy import Policy


def lowering_passes(
    gm: fx.GraphModule, policy: Policy, placement: str = "mincut", constants: str = "fix"
) -> PassManager:
    """The passes that lower ``gm`` under ``policy``, in order, as a runner.

    The first pass is ``assign_dtypes``: ``lowering_passes(gm, policy)[:1](gm)`` assigns the dtypes
    only, and ``lowering_passes(gm, policy)[1:].resume(assigned)`` finishes the lowering (the
    search fingerprints the assigned dtypes in between).

    Args:
        gm: The captured graph to lower (read for its output dtypes only; not modified).
        policy: The dtype policy.
        placement: ``"mincut"`` (default), ``"paint"`` or ``"naive"`` (see :mod:`autoprec.graph`).
        constants: ``"fix"`` or ``"strict"``; see :mod:`autoprec.passes.constants` (case C03).

    Returns:
        ``PassManager`` of ``assign_dtypes``, ``insert_casts``, ``accumulate_fp32``, ``lower_fp8``,
        ``math_attention``, ``verify``.

    Raises:
        ValueError: unknown ``placement`` or ``constants`` mode.
    """
    return PassManager([
        AssignDtypes(policy, placement, constants),
        InsertCasts(),
        AccumulateFp32(policy),
        LowerFp8(policy),
        MathAttention(),
        Verify(output_dtypes(gm)),
    ])


def run_pipeline(
    gm: fx.GraphModule, policy: Policy, placement: str = "mincut", constants: str = "fix"
) -> PassResult:
    """Lower a captured graph under ``policy``; ``gm`` itself is not modified.

    Args:
        gm: From :func:`autoprec.capture.capture`.
        policy: The dtype policy.
        placement: ``"mincut"`` (default), ``"paint"`` or ``"naive"`` (see :mod:`autoprec.graph`).
        constants: ``"fix"`` or ``"strict"``; see :mod:`autoprec.passes.constants` (case C03).

    Returns:
        ``PassResult`` with the lowered graph (same Parameters as ``gm``) and stats
        ``casts`` (count of placement casts), ``cast_bytes`` (bytes of the tensors converted),
        ``placed``, ``constants_fp32``, ``constants_clamped``, ``accumulate_fp32`` and
        ``accumulate_casts``, ``fp8_matmuls``, ``math_attention``, ``saved_low``.

    Raises:
        PassError: a pass or the verifier failed; the message names the pass and the node.
        ValueError: unknown ``placement`` or ``constants`` mode.
    """
    return lowering_passes(gm, policy, placement, constants)(gm)


def lower(
    gm: fx.GraphModule, policy: Policy, placement: str = "mincut", constants: str = "fix"
) -> fx.GraphModule:
    """Shorthand for ``run_pipeline(gm, policy, placement, constants).graph_module``."""
    return run_pipeline(gm, policy, placement, constants).graph_module
