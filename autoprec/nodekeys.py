"""Stable node keys, the user's autocast/no_grad regions, and the graph fingerprint over the keys.

A node key is ``<module path>/<op>#<k>`` (docs/architecture.md, "Node keys and op classes"), e.g.
``model.layers.3.mlp.down_proj/linear#0``: stable across re-captures of the same model code and
independent of FX's generated node names. Policies name nodes only through keys, module globs and
op classes; :func:`graph_fingerprint` hashes the keys and shapes, so the same model code gives the
same fingerprint.
"""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict

import torch
from torch import fx

from autoprec.nodemeta import Region, meta_of, read_meta
from autoprec.ops import op_name

__all__ = ["BLOCK_PATTERN", "assign_keys", "block_of", "graph_fingerprint", "mark_regions", "module_path",
           "node_key", "op_name"]


def module_path(node: fx.Node) -> str:
    """Dotted path of the innermost ``nn.Module`` that produced ``node`` (``""`` for the root).

    Read from ``node.meta["nn_module_stack"]``, which torch.export records for every node.
    """
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, _type = list(stack.values())[-1]
    return str(path)


#: A repeated block's module path: the outermost ``<container>.<index>`` of a module path
#: (``model.layers.3.mlp`` -> container ``model.layers``, index 3; T5's ``encoder.block.2.layer.0``
#: -> ``encoder.block``, 2). The one rule for "which layer block a node is in": the search's block
#: parameters (``autoprec.search.space.find_blocks``) and the compile regions
#: (``autoprec.applied.regions``) both read it.
BLOCK_PATTERN = re.compile(r"^(?P<container>.+?)\.(?P<index>\d+)(?=\.|$)")


def block_of(module: str) -> tuple[str, int] | None:
    """``(container, index)`` of the repeated block ``module`` (a module path) lies in, or None
    outside any (:data:`BLOCK_PATTERN`)."""
    match = BLOCK_PATTERN.match(module or "")
    return (match["container"], int(match["index"])) if match else None


def node_key(module: str, op: str, k: int) -> str:
    """Format a stable node key: ``model.layers.3.mlp.down_proj/linear#0``
    (docs/architecture.md#node-keys-and-op-classes)."""
    return f"{module}/{op}#{k}" if module else f"{op}#{k}"


def assign_keys(gm: fx.GraphModule) -> dict[str, fx.Node]:
    """Give every ``call_function`` node of ``gm`` its stable key.

    Sets the ``key``, ``module`` and ``op`` of each node's :class:`~autoprec.nodemeta.NodeMeta` (its
    other fields are kept) and returns ``{key: node}`` in graph order.
    """
    counters: dict[tuple[str, str], int] = defaultdict(int)
    keys: dict[str, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        mod, op = module_path(node), op_name(node)
        k = counters[(mod, op)]
        counters[(mod, op)] += 1
        key = node_key(mod, op, k)
        meta = meta_of(node)
        meta.key, meta.module, meta.op = key, mod, op
        keys[key] = node
    return keys


def mark_regions(gm: fx.GraphModule) -> list[fx.Node]:
    """Record the user's ``torch.autocast`` / ``torch.no_grad`` blocks (case C13).

    torch.export (non-strict, training IR) keeps each such block as a higher-order op,
    ``higher_order.wrap_with_autocast(device, dtype, enabled, cache_enabled, submod, *inputs)`` or
    ``higher_order.wrap_with_set_grad_enabled(enabled, submod, *inputs)``, whose body is a
    sub-``GraphModule``. autoprec keeps these nodes whole (fp32 inputs, fp32 body unless the
    user's own autocast says otherwise), never inlines and so never drops the context. Sets the
    :class:`~autoprec.nodemeta.NodeMeta` fields ``region`` (a :class:`~autoprec.nodemeta.Region`) and
    ``autocast_disabled`` on the node and on every node of its body.

    Returns:
        The region nodes, in graph order.
    """
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = op_name(node)
        if name == "wrap_with_autocast":
            device, dtype, enabled = node.args[0], node.args[1], bool(node.args[2])
            region = Region(kind="autocast", enabled=enabled, device=str(device), dtype=str(dtype))
            body = node.args[4]
        elif name == "wrap_with_set_grad_enabled":
            region = Region(kind="grad", enabled=bool(node.args[0]))
            body = node.args[1]
        else:
            continue
        meta = meta_of(node)
        meta.region, meta.autocast_disabled = region, True
        sub = getattr(gm, body.target, None) if isinstance(body, fx.Node) and body.op == "get_attr" else None
        if isinstance(sub, fx.GraphModule):
            for inner in sub.graph.nodes:
                inner_meta = meta_of(inner)
                inner_meta.autocast_disabled, inner_meta.region = True, region
        found.append(node)
    return found


def graph_fingerprint(gm: torch.fx.GraphModule) -> str:
    """SHA-256 (16 hex) of the captured graph's node keys and shapes: same model code -> same value."""
    h = hashlib.sha256()
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        key = read_meta(n).key
        h.update(f"{n.op}|{n.target if key is None else key}|{getattr(v, 'shape', '')}|"
                 f"{getattr(v, 'dtype', '')};".encode())
    return h.hexdigest()[:16]
