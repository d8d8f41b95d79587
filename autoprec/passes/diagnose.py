"""Find the node whose output first went non-finite (cases C01, C02, C09).

Runs a graph node by node with :class:`torch.fx.Interpreter` (eager, no compile) and returns
the stable key of the first node, in graph order, whose floating output holds an ``inf`` or
``NaN``: the place to put a policy rule (keep that node fp32) or to fix the model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from autoprec._torch_compat import pytree
from autoprec.nodemeta import read_meta

__all__ = ["first_nonfinite_node"]


class _Found(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


class _Watch(fx.Interpreter):
    """Runs the graph; raises :class:`_Found` at the first node with a non-finite float output."""

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.op in ("call_function", "call_module", "placeholder", "get_attr"):
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.dtype.is_floating_point and not bool(
                    torch.isfinite(t).all()
                ):
                    raise _Found(read_meta(n).key or n.name)
        return out


def _flat(gm: fx.GraphModule, args: tuple, kwargs: dict) -> list[Any]:
    """Flatten ``(args, kwargs)`` into placeholder order (exported modules use a pytree spec)."""
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    flat = list(args)
    for name in names[len(args):]:
        if name in kwargs:
            flat.append(kwargs[name])
    if len(flat) != len(names):
        flat = pytree.tree_leaves((args, kwargs))
    return flat


def first_nonfinite_node(gm: fx.GraphModule, *args: Any, **kwargs: Any) -> str | None:
    """The key of the first node (graph order) whose floating output has an inf or NaN.

    Args:
        gm: A captured or lowered graph (``autoprec.capture`` / ``autoprec.passes.lower``).
        *args, **kwargs: Inputs, as for ``gm(*args, **kwargs)``.

    Returns:
        the node's ``NodeMeta.key`` (FX name for nodes without one, e.g. placeholders),
        or ``None`` if every floating value is finite.
    """
    inputs = _flat(gm, args, kwargs) if kwargs else args
    with torch.no_grad():
        try:
            _Watch(gm).run(*inputs)
        except _Found as found:
            return found.key
    return None
