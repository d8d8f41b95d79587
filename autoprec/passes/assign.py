"""Pass 1: assign a dtype to every node from a :class:`~autoprec.policy.Policy`.

Order of decisions for a ``call_function`` node with a floating output:

1. ``nonfloat`` (not a float tensor): no dtype, never cast.
2. Fixed-dtype ops (``.to(dtype)``, factories): keep the captured dtype. A tensor changed in place,
   directly or through views (``x.mul_(2)`` or ``x[:, 0] = 0`` on a batch tensor, ``z[:, :8] = x``
   into ``torch.zeros``: :func:`autoprec.ops.written_in_place`), the views and the write keep the
   base's captured dtype (an input's: its own), so the write changes the tensor itself, not a cast
   copy, and its readers, cast where they read it, see the change.
3. Nodes captured in a dtype other than fp32 (the user's own choice), ``torch.autocast`` /
   ``no_grad`` regions (higher-order ops, kept whole) and nodes marked ``autocast_disabled``:
   keep fp32 / the captured dtype in every policy (case C13).
4. The policy: the last matching rule (node rules win); else ``default_dtype`` for ``matmul``
   and ``sensitive`` nodes; else ``follow`` nodes are placed by :func:`autoprec.graph.place_follow`.
   The nodes of a decomposed RMSNorm (:func:`autoprec.ops.rmsnorm_regions`) are ``sensitive``,
   including the ``mul`` that applies ``rsqrt`` (case C04).
5. Scalar constants out of the chosen low dtype's range (:mod:`autoprec.passes.constants`,
   case C03): keep the node fp32 or clamp a mask fill value to ``finfo(dtype).min``.

The decision is stored in the node's :class:`~autoprec.nodemeta.NodeMeta`: ``op_class``, ``dtype``
(the storage dtype, what consumers read), ``decided_by`` and ``reason`` (the op table's numerical
reason); where a rule sets them, ``compute`` (the dtype the op computes in, when not the storage
dtype: ``insert_casts`` rounds the inputs through the storage dtype and stores the output back) and
``saved`` (what the output is saved as for backward: ``autoprec.applied.saved``).
"""

from __future__ import annotations

import difflib
import operator
import warnings
from collections.abc import Iterable

import torch
from torch import fx

from autoprec.dtypes import FP8_COMPUTE, LOW_DTYPES, to_torch
from autoprec.graph import check_placement_mode, place_follow
from autoprec.nodemeta import NodeMeta, meta_of, read_meta
from autoprec.ops import (
    RMSNORM_REASON,
    captured_dtype,
    classify,
    op_name,
    reason,
    rmsnorm_regions,
    sets_own_dtype,
    written_in_place,
)
from autoprec.passes.attention import SDPA
from autoprec.passes.base import PassBase, PassResult, pass_error, writable
from autoprec.passes.constants import (
    check_constants_mode,
    clamp_to_range,
    is_mask_fill,
    out_of_range_constants,
)
from autoprec.passes.fp8 import fp8_lowerable
from autoprec.policy import Policy, Rule

PASS = "assign_dtypes"
#: ``decided_by`` of a node changed in place, of the views a write goes through and of their base
#: (:func:`autoprec.ops.written_in_place`): the base's captured dtype.
WRITTEN = "written in place"


def unmatched_rules(policy: Policy, nodes: Iterable[fx.Node]) -> list[int]:
    """Indices of ``policy.rules`` that select no keyed ``call_function`` node of ``nodes`` (a node
    rule: its key is not a node's; any other rule: :meth:`Rule.matches` is False for every node,
    op classes from :func:`autoprec.ops.classify`). The one rule for "matches nothing": the
    warnings here and the refusal of another model's policy (``applied/policy_match.py``) use it."""
    keyed = [(m.key, classify(n), m.module or "") for n in nodes
             if n.op == "call_function" and (m := read_meta(n)).key is not None]
    keys = {k for k, _c, _m in keyed}
    return [i for i, rule in enumerate(policy.rules)
            if (rule.node not in keys if rule.node is not None else not any(rule.matches(*n) for n in keyed))]


def nearest_node_key(name: str, nodes: Iterable[fx.Node]) -> str | None:
    """The node key of ``nodes`` closest to ``name`` (``difflib.get_close_matches``, cutoff 0.6; a
    node rule with a typo: ``lm_head/linear#7`` -> ``lm_head/linear#0``), or None."""
    keys = [k for n in nodes if n.op == "call_function" and (k := read_meta(n).key) is not None]
    close = difflib.get_close_matches(name, keys, n=1, cutoff=0.6)
    return close[0] if close else None


def _check_node_rules(policy: Policy, nodes: list[fx.Node]) -> None:
    by_key = {read_meta(n).key: n for n in nodes if read_meta(n).key is not None}
    inputs = {str(name) for n in nodes if n.op == "placeholder" for name in (n.name, n.target)}
    unmatched = set(unmatched_rules(policy, nodes))
    for i, rule in enumerate(policy.rules):
        if rule.node is None:
            # docs/architecture.md#policy-file: a rule that matches no node is reported. A rule by op class
            # alone may fairly match nothing (a model without norms); one naming modules is a typo or a
            # policy for another model.
            if rule.module is not None and i in unmatched:
                warnings.warn(f"autoprec: policy rules[{i}] {rule.describe()} matches no node of this graph "
                              "(the rule has no effect)", stacklevel=3)
            continue
        n = by_key.get(rule.node)
        if n is None and rule.node in inputs:
            warnings.warn(f"autoprec: policy rules[{i}] names {rule.node!r}, a graph input; inputs are never "
                          "cast (the rule has no effect)", stacklevel=3)
        elif n is None:
            near = nearest_node_key(rule.node, nodes)
            warnings.warn(f"autoprec: policy rules[{i}] names node {rule.node!r}, which is not in the graph"
                          + (f" (did you mean {near!r}?)" if near else ""), stacklevel=3)
        elif sets_own_dtype(n) and read_meta(n).op_class != "nonfloat":
            warnings.warn(f"autoprec: policy rules[{i}] names node {rule.node!r}, whose op sets its own "
                          f"dtype ({read_meta(n).op or n.target}: a cast, a factory or a dtype= argument); "
                          "it keeps the model's (the rule has no effect)", stacklevel=3)
        elif read_meta(n).op_class == "nonfloat":
            raise pass_error(
                PASS, n, f"policy rules[{i}] sets dtype {rule.dtype} on a non-float node "
                "(integer/bool tensors, indices and masks are never cast)"
            )


def assign_dtypes(
    gm: fx.GraphModule, policy: Policy, placement: str = "mincut", constants: str = "fix"
) -> PassResult:
    """Assign a dtype to every float node of a copy of ``gm``.

    Args:
        gm: A captured graph (see :func:`autoprec.capture.capture`); not modified (unless the runner owns it:
            :func:`autoprec.passes.base.writable`).
        policy: The policy to apply.
        placement: Cast placement mode for ``follow`` nodes (:data:`autoprec.graph.PLACEMENT_MODES`);
            a policy with ``follow_placement="promote"`` (the autocast twin) is placed by promotion
            whatever is passed here.
        constants: ``"fix"`` (keep fp32 / clamp mask fills) or ``"strict"`` (raise) for scalar
            constants outside a lowered node's dtype range (case C03).

    Returns:
        ``PassResult`` whose graph's nodes carry a ``NodeMeta.dtype`` (and, on SDPA
        nodes under ``policy.attention="math"``, ``impl="math"``); stats
        ``placed`` (follow nodes placed), ``constants_fp32`` and ``constants_clamped``.

    Raises:
        PassError: a policy node rule targets a non-float node (case C11); ``constants`` is
            ``"strict"`` and a constant does not fit its node's dtype (C03).
        ValueError: unknown ``placement`` or ``constants`` mode.
    """
    check_constants_mode(constants)
    check_placement_mode(placement)
    placement = "promote" if policy.follow_placement == "promote" else placement  # the policy's own rule wins
    gm = writable(gm)
    nodes = list(gm.graph.nodes)
    for region in rmsnorm_regions(nodes):
        for n in region:
            meta_of(n).pattern = "rms_norm"
    labels: dict[fx.Node, str | None] = {}
    casting: set[fx.Node] = set()
    written = written_in_place(nodes)
    for node in nodes:
        meta = meta_of(node)
        orig = captured_dtype(node)
        if node.op in ("placeholder", "get_attr"):
            labels[node] = orig
            meta.dtype, meta.decided_by = orig, "input"
        elif node in written and orig is not None and not sets_own_dtype(node):  # in the base's dtype
            meta.op_class, meta.reason = classify(node), reason(meta.op or "")
            labels[node] = labels.get(written[node]) or orig
            meta.dtype, meta.decided_by = labels[node], WRITTEN
            casting.add(node)
        elif node.op == "call_function":
            _decide(node, meta, orig, policy, labels, casting)
        elif node.op == "output":
            outs = [a for a in node.all_input_nodes if captured_dtype(a) is not None]
            labels[node] = captured_dtype(outs[0]) if outs else None
            casting.add(node)
    _check_node_rules(policy, nodes)
    n_fp32 = _constants_before(nodes, labels, policy, constants)
    low_default = policy.default_dtype if policy.default_dtype != "fp32" else "bf16"
    placed = place_follow(nodes, labels, casting, mode=placement, low_default=low_default)
    for node, dt in placed.items():
        meta = meta_of(node)
        meta.dtype, meta.decided_by = dt, f"placement:{placement}"
    n_clamped = _constants_after(nodes, constants)
    n_saved = _assign_saved(nodes, policy)
    if policy.attention != "fused":  # run by the math_attention pass; part of the search's fingerprint
        for n in nodes:
            if n.target is SDPA:
                meta_of(n).impl = policy.attention
    stats = {"placed": len(placed), "constants_fp32": n_fp32, "constants_clamped": n_clamped,
             "saved_low": n_saved}
    return PassResult(gm, True, stats)


class AssignDtypes(PassBase):
    """Pass 1 as a :class:`~autoprec.passes.base.PassBase`: :func:`assign_dtypes` with fixed options.

    Args:
        policy: The policy to apply.
        placement: Cast placement mode (:data:`autoprec.graph.PLACEMENT_MODES`).
        constants: ``"fix"`` or ``"strict"`` (:data:`autoprec.passes.constants.CONSTANT_MODES`).

    Raises:
        ValueError: unknown ``placement`` or ``constants`` mode (at construction, before any pass runs).
    """

    name = PASS

    def __init__(self, policy: Policy, placement: str = "mincut", constants: str = "fix") -> None:
        check_placement_mode(placement)
        check_constants_mode(constants)
        self.policy, self.placement, self.constants = policy, placement, constants

    def call(self, gm: fx.GraphModule) -> PassResult:
        """``assign_dtypes(gm, policy, placement, constants)``; ``gm`` is not modified
        (unless the runner owns it: ``writable``)."""
        return assign_dtypes(gm, self.policy, self.placement, self.constants)

    def ensures(self, gm: fx.GraphModule) -> None:
        """Every float ``call_function`` node (other than ``nonfloat``) has a concrete dtype.

        Raises:
            PassError: a node producing a float tensor has no dtype, or is still ``"auto"``.
        """
        for n in gm.graph.nodes:
            meta = read_meta(n)
            if n.op != "call_function" or captured_dtype(n) is None or meta.op_class == "nonfloat":
                continue
            if meta.dtype in (None, "auto"):
                raise pass_error(PASS, n, f"float node left without a dtype ({meta.dtype!r})")


def _assign_saved(nodes: list[fx.Node], policy: Policy) -> int:
    """``NodeMeta.saved``: what each float node's output is saved as for backward, where a rule sets
    something other than the dtype the node stores it in (after placement: follow nodes included).

    Returns:
        The number of nodes given a saved dtype.
    """
    count = 0
    for n in nodes:
        meta = read_meta(n)
        if n.op != "call_function" or meta.dtype in (None, "auto") or meta.op_class == "nonfloat":
            continue
        saved = policy.resolve_saved(meta.key or "", meta.op_class or "", meta.module or "")
        if saved is not None and saved != (meta.dtype if meta.compute is None else meta.compute):
            meta_of(n).saved = saved
            count += 1
    return count


def _lows(policy: Policy) -> list[str]:
    return [d for d in policy.dtypes_used() if d in LOW_DTYPES]


def _constants_before(nodes, labels, policy: Policy, mode: str) -> int:
    """Keep fp32 the nodes whose (non mask-fill) constants do not fit their low dtype (C03).

    ``auto`` nodes are checked against every low dtype the policy uses (placement may pick any).
    """
    if mode == "strict":
        return 0
    count = 0
    for n in nodes:
        lab, compute = labels.get(n), _low_compute(n)
        if n.op != "call_function" or (lab in (None, "fp32") and compute is None) or is_mask_fill(n):
            continue
        targets = (_lows(policy) if lab == "auto" else [] if lab in (None, "fp32") else [lab]) + (
            [compute] if compute else [])
        bad = [(d, c) for d in targets for c in out_of_range_constants(n, d)]
        if bad:
            d, (_pos, value) = bad[0]
            labels[n] = "fp32"
            meta = meta_of(n)
            meta.compute, meta.dtype, meta.decided_by = None, "fp32", "constant out of range"
            meta.reason = (f"constant {value!r} is outside the {d} range "
                           f"(max {torch.finfo(to_torch(d)).max:g}); kept fp32")
            count += 1
            if op_name(n) in _CARRIES_CONSTANT:
                count += _keep_readers_fp32(n, labels, value, d)
    return count


#: Ops whose output takes the size of an out-of-range constant they combine with (``mask * -1e9``,
#: ``x + 1e5``): their ``follow`` readers would cast that value to the low dtype (``-inf``).
_CARRIES_CONSTANT = frozenset({"add", "sub", "rsub", "mul", "addcmul", "lerp"})


def _keep_readers_fp32(n: fx.Node, labels: dict, value: float, d: str) -> int:
    """Keep fp32 the ``follow`` nodes that read ``n``'s output (an out-of-range constant carried
    through, case C03's additive mask ``scores + (1 - mask) * -1e9``: the fp16 ``add`` made a fully
    masked row ``-inf``, NaN after softmax), and theirs, transitively; up to the first node of
    another class (the softmax, sensitive). Returns how many."""
    count, todo = 0, list(n.users)
    while todo:
        u = todo.pop()
        meta = meta_of(u)
        if labels.get(u) in (None, "fp32") or meta.op_class != "follow":
            continue
        labels[u] = "fp32"
        meta.compute, meta.dtype, meta.decided_by = None, "fp32", "constant out of range"
        meta.reason = (f"reads {read_meta(n).key or n.name}, which combines constant {value!r} (outside the "
                       f"{d} range) into its output; kept fp32")
        count += 1
        todo.extend(u.users)
    return count


def _low_compute(n: fx.Node) -> str | None:
    """The node's compute dtype when it is a low float dtype other than its storage, else None."""
    compute = read_meta(n).compute
    return compute if compute in LOW_DTYPES else None


def _constants_after(nodes, mode: str) -> int:
    """Clamp mask fill values to the node's dtype range, or raise in strict mode (C03)."""
    count = 0
    for n in nodes:
        meta = read_meta(n)
        dt = _low_compute(n) or meta.dtype  # the dtype the op computes in holds the constant
        if n.op != "call_function" or dt in (None, "fp32", "auto") or meta.decided_by == "fixed-dtype op":
            continue
        bad = out_of_range_constants(n, dt)
        if not bad:
            continue
        if mode == "strict":
            pos, value = bad[0]
            raise pass_error(
                PASS, n, f"constant {value!r} (argument {pos}) is outside the {dt} range "
                f"(max {torch.finfo(to_torch(dt)).max:g}); keep this node fp32 with a rule or "
                "use constants='fix'"
            )
        if is_mask_fill(n):
            changed = clamp_to_range(n, dt)
            meta_of(n).constants_clamped = [(str(p), old, new) for p, old, new in changed]
            count += 1
    return count


def _decide(node, meta: NodeMeta, orig, policy: Policy, labels, casting) -> None:
    cls = classify(node)
    op = meta.op or ""
    if meta.pattern == "rms_norm" and cls != "nonfloat":
        cls = "sensitive"
    meta.op_class = cls
    meta.reason = RMSNORM_REASON if meta.pattern == "rms_norm" else reason(op)
    if cls == "nonfloat" or (orig is None and cls != "region"):
        labels[node] = None
        meta.dtype, meta.decided_by = None, "nonfloat"
        return
    if cls == "region":
        what = "autocast" if op == "wrap_with_autocast" else "grad-mode"
        dt, by = "fp32", f"{what} region (kept whole, fp32)"
        meta.autocast_disabled = True
    elif sets_own_dtype(node):  # a factory, a cast, or an op called with dtype=
        dt, by = orig, "fixed-dtype op"
    elif node.target is operator.getitem:
        dt, by = "auto", "getitem"
    elif orig != "fp32":
        dt, by = orig, "captured dtype"
    elif meta.autocast_disabled:
        dt, by = "fp32", "autocast(enabled=False) region"
    else:
        rule = policy.resolve_rule(meta.key or "", cls, meta.module or "")
        if rule is not None:
            dt, by = rule.storage, "rule"
            _set_compute(node, meta, rule)
        elif cls in ("matmul", "sensitive"):
            dt, by = policy.default_dtype, "default_dtype"
        else:
            dt, by = "auto", "follow"
    labels[node] = dt
    meta.dtype, meta.decided_by = dt, by
    if not sets_own_dtype(node):
        casting.add(node)


def _set_compute(node: fx.Node, meta: NodeMeta, rule: Rule) -> None:
    """Record a rule's compute dtype when it differs from its storage dtype (``meta.compute``).

    fp8 goes only to ops :func:`autoprec.passes.fp8.fp8_lowerable` can lower (``linear``, ``mm``,
    2-D ``matmul``): a node rule naming another op is a ``PassError``; an op-class rule leaves it
    computing in its storage dtype and says why in ``meta.reason``.

    Raises:
        PassError: a node rule asks fp8 of an op with no fp8 kernel.
    """
    compute = rule.compute_dtype
    if compute == rule.storage:
        return
    if compute == FP8_COMPUTE and not fp8_lowerable(node):
        if rule.node is not None:
            raise pass_error(PASS, node, f"policy rule {rule.describe()} asks fp8 of "
                             f"{meta.op}, which has no fp8 kernel (fp8 lowers linear, mm "
                             "and 2-D matmul)")
        meta.reason = f"no fp8 kernel for {meta.op}: computed in {rule.storage}"
        return
    meta.compute = compute
