"""Graph views and cast placement for ``follow`` nodes (docs/architecture.md#data-flow, issue "compiler
core").

A cast is paid once per producer and target dtype: if a tensor ``u`` of ``B`` bytes is read by
consumers in a dtype other than its own, one conversion of ``B`` bytes is needed. ``follow``
nodes (elementwise and data movement) can run in either dtype, so their dtype is chosen to
minimise the total bytes converted.

For two dtypes (fp32 vs one low dtype) this is a binary labelling problem whose cost is a sum
of "group is mixed" terms, one per producer group ``{u} ∪ consumers(u)``. Each such term is
represented exactly in an s–t graph with two auxiliary vertices (the P^n Potts construction of
Kohli, Kumar & Torr, "P3 & Beyond", CVPR 2007), so a minimum cut (networkx) gives the optimal
placement. With two low dtypes in one policy, the cut decides fp32 vs low, and each low
follow node then takes the low dtype of the lowered nodes it is connected to (most bytes wins).

Modes, for comparison (docs/cast_placement.md):

- ``naive``: follow nodes stay fp32; every lowered node casts its inputs down and its output back.
- ``paint``: TensorFlow-AMP-style forward painting: a follow node is low when one of its float
  inputs (other than a parameter) is low.
- ``mincut``: the optimal placement above (default).
- ``promote``: PyTorch's type promotion (``torch.result_type``): a follow node takes the widest
  dtype of its float tensor inputs (tensors with dimensions before 0-dim ones; bf16 with fp16
  gives fp32), which is what ``torch.autocast`` does with every op outside its op lists; the
  autocast twin (``Policy.autocast``, ``follow_placement="promote"``) uses it.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Iterable

import networkx as nx
import torch
from networkx.algorithms.flow import shortest_augmenting_path
from torch import fx

from autoprec._torch_compat import optimization_hint
from autoprec.nodemeta import read_meta

__all__ = ["PLACEMENT_MODES", "check_placement_mode", "place_follow", "tensor_bytes", "to_networkx"]

PLACEMENT_MODES = ("mincut", "paint", "naive", "promote")
_INF = float("inf")
# Tie-break: among placements with equal cast bytes prefer low precision (fewer bytes moved by
# the follow op itself); the weight is far below one byte of cast so it never trades a cast.
_PREFER_LOW = 1e-6


def tensor_bytes(node: fx.Node) -> int:
    """Bytes of the floating tensor(s) ``node`` produces, from ``node.meta["val"]`` (fp32 size).

    A graph captured with dynamic dimensions has symbolic sizes (``s0*s1*64``); they are counted at
    their hints, the example batch's sizes (``optimization_hint``, which adds no guard, so the byte
    count never specialises the graph): cast placement is then optimal for the example's shape,
    and since every size in a transformer scales with the same batch x sequence product, for the
    others too.
    """
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else [val]
    total = 0
    for v in vals:
        if isinstance(v, torch.Tensor) and v.dtype.is_floating_point:
            total += _size_hint(v.numel()) * v.element_size()
    return total


def _size_hint(n: int | torch.SymInt) -> int:
    """``n`` as an int; a symbolic size at its hint (example value), 1 when it has none (unbacked)."""
    if isinstance(n, int):
        return n
    return int(optimization_hint(n, fallback=1))


def check_placement_mode(mode: str) -> None:
    """Check a cast placement mode name.

    Raises:
        ValueError: ``mode`` is not in :data:`PLACEMENT_MODES`; the message lists the valid modes.
    """
    if mode not in PLACEMENT_MODES:
        raise ValueError(f"unknown placement mode {mode!r}; valid: {', '.join(PLACEMENT_MODES)}")


def to_networkx(gm: fx.GraphModule) -> nx.DiGraph:
    """A ``networkx.DiGraph`` of ``gm``: one vertex per FX node, an edge per data dependency.

    Edge attribute ``bytes`` is the size of the tensor(s) flowing along it (0 for non-float).
    Vertex attributes: ``fx_op`` (FX opcode) plus the set fields of the node's
    :class:`~autoprec.nodemeta.NodeMeta` if any (``key``, ``op`` (ATen op name), ``dtype``...;
    :meth:`~autoprec.nodemeta.NodeMeta.as_dict`).
    """
    g = nx.DiGraph()
    for n in gm.graph.nodes:
        g.add_node(n.name, **{**read_meta(n).as_dict(), "fx_op": n.op})
        for a in n.all_input_nodes:
            g.add_edge(a.name, n.name, bytes=tensor_bytes(a))
    return g


def place_follow(
    nodes: Iterable[fx.Node],
    labels: dict[fx.Node, str | None],
    casting: set[fx.Node],
    mode: str = "mincut",
    low_default: str = "bf16",
) -> dict[fx.Node, str]:
    """Choose a dtype for every node labelled ``"auto"``.

    Args:
        nodes: All FX nodes in graph order.
        labels: Current dtype name per float-producing node: a dtype (fixed), ``"auto"`` (to be
            placed) or ``None`` (not a float producer). The output node is labelled with the
            graph's original output dtype when it consumes float tensors.
        casting: Nodes whose float inputs are cast to their own dtype (every lowered/auto node
            and the output node); nodes outside it (explicit ``.to`` casts) accept any dtype.
        mode: One of :data:`PLACEMENT_MODES`.
        low_default: Low dtype used when the cut puts a node on the low side and no lowered
            neighbour says which low dtype (policy's default low dtype).

    Returns:
        ``{node: dtype name}`` for the ``"auto"`` nodes.

    Raises:
        ValueError: ``mode`` is not in :data:`PLACEMENT_MODES`.
    """
    check_placement_mode(mode)
    nodes = list(nodes)
    auto = [n for n in nodes if labels.get(n) == "auto"]
    if not auto:
        return {}
    lows = {d for d in labels.values() if d not in (None, "auto", "fp32")}
    if not lows or mode == "naive":
        return {n: "fp32" for n in auto}
    if mode == "paint":
        return _paint(nodes, labels)
    if mode == "promote":
        return _promote(nodes, labels)
    low_side = _mincut(nodes, labels, casting)
    out: dict[fx.Node, str] = {n: "fp32" for n in auto if n not in low_side}
    out.update(_pick_low(nodes, labels, [n for n in auto if n in low_side], lows, low_default))
    return out


def _consumers(nodes: list[fx.Node], labels: dict[fx.Node, str | None], casting: set[fx.Node]):
    cons: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for v in nodes:
        if v not in casting:
            continue
        for u in v.all_input_nodes:
            if labels.get(u) is not None:
                cons[u].append(v)
    return cons


def _mincut(nodes, labels, casting) -> set[fx.Node]:
    """Nodes on the low side of an optimal two-label placement (S = low, T = fp32).

    A node with a fixed dtype is joined to its terminal by an infinite edge, so it is built as that
    terminal (s for a low dtype, t for fp32; every cut keeps its capacity). The network then falls
    apart into components that meet only at s and t (a transformer's follow nodes between two
    matmuls or norms) and each is cut on its own: every s-t cut of the whole is a union of cuts of
    the parts, with the sum of their capacities, so the minimum cuts are the unions of theirs.
    ``assign_dtypes`` of ``Policy.default("bf16")`` on a 24-layer Qwen2 took 0.86 s with one cut
    (shortest augmenting paths grow faster than the network) and 0.32 s by components.
    """
    s, t = "__low__", "__fp32__"
    edges: list[tuple[str, str, float]] = []

    def vid(n: fx.Node) -> str:  # only nodes with a dtype (labelled) take part
        lab = labels.get(n)
        return "n:" + n.name if lab == "auto" else (t if lab == "fp32" else s)

    def edge(a: str, b: str, c: float) -> None:
        if a != b and b != s and a != t:  # an edge into s or out of t carries no flow to t
            edges.append((a, b, c))

    for n, lab in labels.items():
        if lab == "auto":  # cut (paid) iff n ends on the fp32 side
            edge(s, vid(n), _PREFER_LOW * max(tensor_bytes(n), 1))
        if n.op == "call_function" and n.target is operator.getitem and lab == "auto":
            parent = n.args[0]
            if isinstance(parent, fx.Node) and labels.get(parent) is not None:
                edge(vid(parent), vid(n), _INF)  # a getitem has its parent's dtype
                edge(vid(n), vid(parent), _INF)
    for u, vs in _consumers(nodes, labels, casting).items():
        c = float(tensor_bytes(u))
        if c <= 0:
            continue
        members = [vid(u)] + [vid(v) for v in vs]
        a1, a2 = f"any_fp32:{u.name}", f"any_low:{u.name}"
        edge(s, a1, c)  # cut iff some member is fp32
        edge(a2, t, c)  # cut iff some member is low
        for m in members:
            edge(a1, m, _INF)
            edge(m, a2, _INF)
    parts = nx.utils.UnionFind()  # the components, terminals left out
    for a, b, _c in edges:
        parts.union(*[x for x in (a, b) if x not in (s, t)])
    by_part: dict[str, list[tuple[str, str, float]]] = defaultdict(list)
    for a, b, c in edges:
        by_part[parts[b if a == s else a]].append((a, b, c))
    by_id = {vid(n): n for n in labels if labels.get(n) == "auto"}
    low: set[fx.Node] = set()
    for part in by_part.values():
        g = nx.DiGraph()
        g.add_weighted_edges_from(part, weight="capacity")
        placed = [by_id[x] for x in g if x in by_id]
        if not placed:
            continue  # a group whose members are all fixed: its cast is paid whatever is placed
        if t not in g:  # nothing to cut (each placed node has its edge from s): all low
            low.update(placed)
            continue
        # shortest augmenting paths: faster than preflow-push on these networks. Every maximum flow
        # gives the same cut: nx.minimum_cut takes the source side as the nodes that cannot reach t
        # in the residual network, which is the same for any maximum flow (the sink-side-minimal
        # minimum cut; Ford & Fulkerson), so the placement does not depend on the flow algorithm.
        _value, (s_side, _t_side) = nx.minimum_cut(g, s, t, flow_func=shortest_augmenting_path)
        low.update(by_id[x] for x in s_side if x in by_id)
    return low


def _pick_low(nodes, labels, low_nodes, lows, low_default) -> dict[fx.Node, str]:
    """Give each low-side follow node the low dtype its lowered neighbours use most (by bytes)."""
    if len(lows) == 1:
        only = next(iter(lows))
        return {n: only for n in low_nodes}
    chosen: dict[fx.Node, str] = {}
    pending = set(low_nodes)
    for _ in range(len(low_nodes) + 1):
        progressed = False
        for n in [m for m in nodes if m in pending]:
            votes: dict[str, int] = defaultdict(int)
            neigh = list(n.all_input_nodes) + list(n.users)
            for m in neigh:
                d = chosen.get(m) or labels.get(m)
                if d in lows:
                    votes[d] += max(tensor_bytes(m), 1)
            if votes:
                chosen[n] = max(sorted(votes), key=lambda d: votes[d])
                pending.discard(n)
                progressed = True
        if not progressed:
            break
    for n in pending:
        chosen[n] = low_default if low_default in lows else min(lows)
    return chosen


def _paint(nodes, labels) -> dict[fx.Node, str]:
    out: dict[fx.Node, str] = {}
    for n in nodes:
        if labels.get(n) != "auto":
            continue
        d = "fp32"
        for u in n.all_input_nodes:
            if u.op == "get_attr":
                continue
            du = out.get(u) or labels.get(u)
            if du not in (None, "auto", "fp32"):
                d = du
                break
        out[n] = d
    return out


def _promote(nodes, labels) -> dict[fx.Node, str]:
    """Type promotion in graph order: each ``auto`` node takes the widest dtype among its float
    tensor inputs with dimensions, else among its 0-dim tensor inputs (PyTorch's promotion
    categories: "Tensor Attributes" docs, ``torch.result_type``); fp32 wins over any low dtype,
    and two different low dtypes (bf16, fp16) promote to fp32. A node with no float tensor input
    stays fp32 (its captured dtype)."""
    out: dict[fx.Node, str] = {}
    for n in nodes:
        if labels.get(n) != "auto":
            continue
        dims: set[str] = set()
        zero_dim: set[str] = set()
        for u in n.all_input_nodes:
            d = out.get(u) or labels.get(u)
            if d in (None, "auto"):
                continue
            val = u.meta.get("val")
            (zero_dim if isinstance(val, torch.Tensor) and val.dim() == 0 else dims).add(d)
        found = dims or zero_dim
        out[n] = next(iter(found)) if len(found) == 1 else "fp32"
    return out
