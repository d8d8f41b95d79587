"""Run the passes in order: assign dtypes -> insert casts -> fp32 accumulation -> verify.

``graph.lint()`` runs after every pass; a lint failure raises ``PassError`` naming the pass.
"""

from __future__ import annotations

import torch
from torch import fx

from autoprec.passes.accumulate import accumulate_fp32
from autoprec.passes.assign import assign_dtypes
from autoprec.passes.base import PassResult, pass_error
from autoprec.passes.casts import insert_casts
from autoprec.passes.verify import verify
from autoprec.policy import Policy


def _output_dtypes(gm: fx.GraphModule) -> list[torch.dtype | None]:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    return [getattr(a.meta.get("val"), "dtype", None) if isinstance(a, fx.Node) else None for a in flat]


def _lint(result: PassResult, name: str) -> fx.GraphModule:
    try:
        result.graph_module.graph.lint()
    except Exception as e:
        raise pass_error(name, None, f"graph.lint() failed after this pass: {e}") from e
    return result.graph_module


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
        ``accumulate_casts``.

    Raises:
        PassError: a pass or the verifier failed; the message names the pass and the node.
    """
    return finish_pipeline(gm, assign_dtypes(gm, policy, placement, constants), policy)


def finish_pipeline(gm: fx.GraphModule, assigned: PassResult, policy: Policy) -> PassResult:
    """The passes after :func:`assign_dtypes`: insert casts -> fp32 accumulation -> verify.

    Split from :func:`run_pipeline` so a caller can look at the assigned dtypes first (the
    search fingerprints them and skips the rest, verification included, for graphs it has
    already measured).

    Args:
        gm: The captured graph ``assigned`` was computed from (for its output dtypes).
        assigned: ``assign_dtypes(gm, policy, ...)``.
        policy: The same policy.

    Raises:
        PassError: a pass or the verifier failed; the message names the pass and the node.
    """
    r2 = insert_casts(_lint(assigned, "assign_dtypes"))
    r3 = accumulate_fp32(_lint(r2, "insert_casts"), policy)
    verify(_lint(r3, "accumulate_fp32"), _output_dtypes(gm))
    return PassResult(r3.graph_module, True, {**assigned.stats, **r2.stats, **r3.stats})


def lower(
    gm: fx.GraphModule, policy: Policy, placement: str = "mincut", constants: str = "fix"
) -> fx.GraphModule:
    """Shorthand for ``run_pipeline(gm, policy, placement, constants).graph_module``."""
    return run_pipeline(gm, policy, placement, constants).graph_module
