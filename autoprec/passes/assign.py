"""Pass 1: assign a dtype to every node from a :class:`~autoprec.policy.Policy`.

Order of decisions for a ``call_function`` node with a floating output:

1. ``nonfloat`` (not a float tensor): no dtype, never cast.
2. Fixed-dtype ops (``.to(dtype)``, factories): keep the captured dtype.
3. Nodes captured in a dtype other than fp32 (the user's own choice), and nodes inside a
   ``torch.autocast(enabled=False)`` region: keep fp32 / the captured dtype in every policy.
4. The policy: the last matching rule (node rules win); else ``default_dtype`` for ``matmul``
   and ``sensitive`` nodes; else ``follow`` nodes are placed by :func:`autoprec.graph.place_follow`.

The decision is stored in ``node.meta["autoprec"]``: ``op_class``, ``dtype``, ``decided_by``.
"""

from __future__ import annotations

import operator
import warnings

from torch import fx

from autoprec.dtypes import NAMES
from autoprec.graph import place_follow
from autoprec.ops import FIXED_DTYPE_OPS, classify
from autoprec.passes.base import PassResult, clone_graph_module, pass_error
from autoprec.policy import Policy

PASS = "assign_dtypes"


def _orig_dtype(node: fx.Node) -> str | None:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else [val]
    for v in vals:
        dt = getattr(v, "dtype", None)
        if dt is not None and dt.is_floating_point:
            return NAMES.get(dt, str(dt))
    return None


def _check_node_rules(policy: Policy, nodes: list[fx.Node]) -> None:
    by_key = {n.meta["autoprec"]["key"]: n for n in nodes if "key" in n.meta.get("autoprec", {})}
    for i, rule in enumerate(policy.rules):
        if rule.node is None:
            continue
        n = by_key.get(rule.node)
        if n is None:
            warnings.warn(f"autoprec: policy rules[{i}] names node {rule.node!r}, which is not in the graph")
        elif n.meta["autoprec"]["op_class"] == "nonfloat":
            raise pass_error(
                PASS, n, f"policy rules[{i}] sets dtype {rule.dtype} on a non-float node "
                "(integer/bool tensors, indices and masks are never cast)"
            )


def assign_dtypes(gm: fx.GraphModule, policy: Policy, placement: str = "mincut") -> PassResult:
    """Assign a dtype to every float node of a copy of ``gm``.

    Args:
        gm: A captured graph (see :func:`autoprec.capture.capture`); not modified.
        policy: The policy to apply.
        placement: Cast placement mode for ``follow`` nodes (:data:`autoprec.graph.PLACEMENT_MODES`).

    Returns:
        ``PassResult`` whose graph's nodes carry ``meta["autoprec"]["dtype"]``.

    Raises:
        PassError: a policy node rule targets a non-float node (case C11).
    """
    gm = clone_graph_module(gm)
    nodes = list(gm.graph.nodes)
    labels: dict[fx.Node, str | None] = {}
    casting: set[fx.Node] = set()
    for node in nodes:
        meta = node.meta.setdefault("autoprec", {})
        orig = _orig_dtype(node)
        if node.op in ("placeholder", "get_attr"):
            labels[node] = orig
            meta.update(dtype=orig, decided_by="input")
        elif node.op == "call_function":
            _decide(node, meta, orig, policy, labels, casting)
        elif node.op == "output":
            outs = [a for a in node.all_input_nodes if _orig_dtype(a) is not None]
            labels[node] = _orig_dtype(outs[0]) if outs else None
            casting.add(node)
    _check_node_rules(policy, nodes)
    low_default = policy.default_dtype if policy.default_dtype != "fp32" else "bf16"
    placed = place_follow(nodes, labels, casting, mode=placement, low_default=low_default)
    for node, dt in placed.items():
        node.meta["autoprec"].update(dtype=dt, decided_by=f"placement:{placement}")
    return PassResult(gm, True, {"placed": len(placed)})


def _decide(node, meta, orig, policy: Policy, labels, casting) -> None:
    cls = classify(node)
    meta["op_class"] = cls
    if cls == "nonfloat" or orig is None:
        labels[node] = None
        meta.update(dtype=None, decided_by="nonfloat")
        return
    op = meta.get("op", "")
    if op in FIXED_DTYPE_OPS:
        dt, by = orig, "fixed-dtype op"
    elif node.target is operator.getitem:
        dt, by = "auto", "getitem"
    elif orig != "fp32":
        dt, by = orig, "captured dtype"
    elif meta.get("autocast_disabled"):
        dt, by = "fp32", "autocast(enabled=False) region"
    else:
        rule = policy.resolve(meta.get("key", ""), cls, meta.get("module", ""))
        if rule is not None:
            dt, by = rule, "rule"
        elif cls in ("matmul", "sensitive"):
            dt, by = policy.default_dtype, "default_dtype"
        else:
            dt, by = "auto", "follow"
    labels[node] = dt
    meta.update(dtype=dt, decided_by=by)
    if op not in FIXED_DTYPE_OPS:
        casting.add(node)
