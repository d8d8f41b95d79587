"""The model's output structure rebuilt outside the compiled region (docs/architecture.md#runtime).

A captured graph returns ``pytree.tree_unflatten(flat, out_spec)``: the model's own output type
(``CausalLMOutputWithPast`` with ``.loss`` and ``.logits``, a dict, a tuple, ``None`` fields,
values kept out of the graph by :class:`autoprec.modelspec.Kept`). :class:`MixedPrecisionModule`
compiles a copy of the graph that returns the flat outputs and rebuilds the structure in plain
Python afterwards (:func:`rebuild`), so what the user gets does not depend on Dynamo tracing the
output types, and is the same whether the graph is compiled or not.
"""

from __future__ import annotations

from typing import Any

from torch import fx

from autoprec._torch_compat import pytree, pytree_info, set_pytree_codegen

__all__ = ["flat_output_graph", "rebuild"]


def flat_output_graph(gm: fx.GraphModule) -> tuple[fx.GraphModule, pytree.TreeSpec | None]:
    """A copy of ``gm`` whose forward returns its flat outputs, and the spec that rebuilds them.

    Args:
        gm: A captured (or lowered) graph; its pytree output spec, if any, is taken out.

    Returns:
        ``(flat, spec)``: ``flat`` has ``gm``'s call signature, reads the same Parameters and
        returns the graph's output values as a tuple; ``spec`` is ``gm``'s output spec, or None
        when ``gm`` has none (then ``flat`` is ``gm`` itself and its outputs need no rebuilding).
    """
    info = pytree_info(gm.graph)
    if info is None or info.out_spec is None:
        return gm, None
    graph = fx.Graph()
    set_pytree_codegen(graph, info._replace(out_spec=None))
    graph.output(graph.graph_copy(gm.graph, {}))
    flat = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    flat.meta = dict(gm.meta)
    return flat, info.out_spec


def rebuild(flat: Any, spec: pytree.TreeSpec | None) -> Any:
    """The output structure ``spec`` describes, filled with ``flat`` (a graph's flat outputs).

    Args:
        flat: What :func:`flat_output_graph`'s graph (or its compiled form) returned.
        spec: Its output spec; None returns ``flat`` unchanged.

    Returns:
        The model's output: the same type and fields as ``model.forward`` returns.
    """
    if spec is None:
        return flat
    return pytree.tree_unflatten(list(flat) if isinstance(flat, (tuple, list)) else [flat], spec)
