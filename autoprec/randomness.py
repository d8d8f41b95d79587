"""Which nodes of a graph draw random numbers (dropout, ``rand*``, attention with ``dropout_p``):
the compile options of such graphs (:mod:`autoprec.applied.compile`) and the RNG handling of the
measurements (:mod:`autoprec.measure.harness`) depend on it (docs/architecture.md#measurements)."""

from __future__ import annotations

import torch
from torch import fx

from autoprec._torch_compat import overload_schema
from autoprec.ops import op_argument

__all__ = ["draws_random", "random_nodes"]


def random_nodes(gm: torch.nn.Module) -> list[fx.Node]:
    """The nodes of the graph (and of any graph inside it) that draw random numbers, in graph order.

    ATen marks such ops ``Tag.nondeterministic_seeded`` (``dropout``, ``native_dropout``,
    ``bernoulli``, ``rand*``, ...; native_functions.yaml). Attention ops carry the tag too and
    count only with ``dropout_p`` ≠ 0; ``dropout(x, p, train=False)`` and ``p == 0`` do not count.
    """
    out = []
    for sub in gm.modules():
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        out += [node for node in graph.nodes if node.op == "call_function" and _draws(node)]
    return out


def draws_random(gm: torch.nn.Module) -> bool:
    """Whether the graph (or any graph inside it) has a node that draws random numbers
    (:func:`random_nodes`)."""
    return bool(random_nodes(gm))


def _draws(node: fx.Node) -> bool:
    """Whether the call ``node`` draws random numbers (see :func:`random_nodes`)."""
    schema = overload_schema(node.target)
    if schema is None or torch.Tag.nondeterministic_seeded not in node.target.tags:
        return False
    arg = lambda name: op_argument(node, name)  # noqa: E731
    off = arg("train") is False or arg("dropout_p") == 0 or ("dropout" in schema.name and arg("p") == 0)
    return not off
