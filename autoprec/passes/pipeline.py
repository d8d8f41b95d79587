"""Run the passes in order: assign dtypes -> insert casts -> verify (lint after each)."""

from __future__ import annotations

import torch
from torch import fx

from autoprec.passes.assign import assign_dtypes
from autoprec.passes.base import PassResult
from autoprec.passes.casts import insert_casts
from autoprec.passes.verify import verify
from autoprec.policy import Policy


def _output_dtypes(gm: fx.GraphModule) -> list[torch.dtype | None]:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    return [getattr(a.meta.get("val"), "dtype", None) if isinstance(a, fx.Node) else None for a in flat]


def run_pipeline(gm: fx.GraphModule, policy: Policy, placement: str = "mincut") -> PassResult:
    """Lower a captured graph under ``policy``; ``gm`` itself is not modified.

    Args:
        gm: From :func:`autoprec.capture.capture`.
        policy: The dtype policy.
        placement: ``"mincut"`` (default), ``"paint"`` or ``"naive"`` (see :mod:`autoprec.graph`).

    Returns:
        ``PassResult`` with the lowered graph (same Parameters as ``gm``) and stats
        ``casts`` (count), ``cast_bytes`` (bytes of the tensors converted) and ``placed``.

    Raises:
        PassError: a pass or the verifier failed; the message names the pass and the node.
    """
    out_dtypes = _output_dtypes(gm)
    r1 = assign_dtypes(gm, policy, placement)
    r1.graph_module.graph.lint()
    r2 = insert_casts(r1.graph_module)
    verify(r2.graph_module, out_dtypes)
    return PassResult(r2.graph_module, True, {**r1.stats, **r2.stats})


def lower(gm: fx.GraphModule, policy: Policy, placement: str = "mincut") -> fx.GraphModule:
    """Shorthand for ``run_pipeline(gm, policy, placement).graph_module``."""
    return run_pipeline(gm, policy, placement).graph_module
