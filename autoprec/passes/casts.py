"""Pass 2: insert casts where a floating tensor crosses a dtype boundary.

A node with an assigned dtype ``d`` reads each floating input in ``d``; where the producer's
dtype differs, one ``aten._to_copy(x, dtype=d)`` per (producer, dtype) is inserted right after
the producer and shared by all consumers. Integer/bool tensors (indices, masks) are never cast
(case C11). Graph outputs are cast back to the dtype they had when captured, so the module is a
drop-in replacement. Ops that set their own dtype (``.to``) read any dtype and get no cast.

A node whose ``compute`` dtype differs from its storage dtype (a rule's ``compute``, e.g. bf16
storage with fp32 compute) reads each input rounded through the storage dtype and then cast to
the compute dtype (``x -> bf16 -> fp32``: the weights are rounded as a bf16 kernel would see
them), computes, and is stored back by one cast its consumers share; afterwards its ``dtype`` is
the compute dtype and ``storage`` the stored one. An op with several outputs (``split``,
``broadcast_tensors``) is stored back after each ``getitem`` that reads an output.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from autoprec.dtypes import DTYPES, to_torch
from autoprec.graph import tensor_bytes
from autoprec.nodemeta import NodeMeta, meta_of, read_meta, set_meta
from autoprec.ops import captured_dtype, is_float_value, written_in_place
from autoprec.passes.base import PassBase, PassResult, pass_error, writable

PASS = "insert_casts"
CAST_OP = torch.ops.aten._to_copy.default
CLAMP_OP = torch.ops.aten.clamp.default
_VIEW_OPS = {"view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "expand", "slice", "select",
             "permute", "transpose", "t", "contiguous", "clone", "to", "_to_copy", "alias"}


def _constant_fill_source(u: fx.Node, dt: str) -> str | None:
    """The key of a constant-fill producer (``full(-1e9)``...) behind ``u`` whose value does not
    fit ``dt``, looking through views and copies; ``None`` otherwise."""
    from autoprec.passes.constants import is_mask_fill, out_of_range_constants

    n = u
    for _ in range(32):
        if not isinstance(n, fx.Node) or n.op != "call_function":
            return None
        if is_mask_fill(n) and out_of_range_constants(n, dt):
            return read_meta(n).key or n.name
        if read_meta(n).op not in _VIEW_OPS or not n.args:
            return None
        n = n.args[0]
    return None


def _dtype_of(node: fx.Node) -> str | None:
    return read_meta(node).dtype


def is_inserted_cast(node: fx.Node) -> bool:
    """True for a cast node inserted by :func:`insert_casts`."""
    return node.op == "call_function" and read_meta(node).inserted_cast


def _read_dtype(consumer: fx.Node, a: object) -> str | None:
    """The dtype ``consumer`` must read its input ``a`` in, or ``None`` when ``a`` needs no cast.

    ``a`` needs a cast only if it is a float tensor with an assigned dtype. The output node
    reads each output in its captured dtype; a ``call_function`` node reads in its assigned
    dtype, except inserted casts and fixed-dtype ops (``.to``), which read any dtype.
    """
    if not isinstance(a, fx.Node) or _dtype_of(a) is None or not is_float_value(a.meta.get("val")):
        return None
    if consumer.op == "output":
        return captured_dtype(a)
    meta = read_meta(consumer)
    if consumer.op != "call_function" or meta.inserted_cast:
        return None
    if meta.decided_by == "fixed-dtype op":
        return None
    return meta.dtype


def insert_casts(gm: fx.GraphModule) -> PassResult:
    """Insert the casts the assigned dtypes require (on a copy of ``gm``).

    Args:
        gm: Output of :func:`autoprec.passes.assign.assign_dtypes`.

    Returns:
        ``PassResult`` with ``stats = {"casts": count, "cast_bytes": bytes converted}`` where
        bytes are the source tensors' element counts times 4 (fp32 size, from the captured
        ``node.meta["val"]``), the same unit the min-cut objective minimises.

    Raises:
        PassError: a node that must be cast has no dtype assigned.
    """
    gm = writable(gm)
    graph = gm.graph
    cache: dict[tuple[fx.Node, ...], fx.Node] = {}
    stats = {"casts": 0, "cast_bytes": 0}
    # a tensor changed in place (x[:, 0] = 0, z[:, :8] = x) is cast where it is read, after the
    # change; a cast right after its producer read the values before it
    written = set(written_in_place(graph.nodes).values())

    def cast(u: fx.Node, dt: str, consumer: fx.Node) -> fx.Node:
        du = _dtype_of(u)
        if du is None or du == "auto":
            raise pass_error(PASS, u, f"no dtype assigned to this input of {consumer.name}")
        if du == dt:
            return u
        key = (u, dt, consumer) if u in written else (u, dt)
        if key not in cache:
            src = u
            fill = _constant_fill_source(u, dt)
            if fill is not None:  # saturate: -1e9 -> finfo(dt).min, not -inf (case C03)
                fi = torch.finfo(to_torch(dt))
                with graph.inserting_after(u):
                    src = graph.call_function(CLAMP_OP, (u, float(fi.min), float(fi.max)))
                src.meta["val"] = u.meta.get("val")
                set_meta(src, NodeMeta(dtype=du, op_class="cast", saturating_cast=True,
                                       reason=f"constant fill of {fill} is outside {dt}'s range",
                                       key=f"saturate({read_meta(u).key or u.name})"))
            with graph.inserting_before(consumer) if u in written else graph.inserting_after(src):
                c = graph.call_function(CAST_OP, (src,), {"dtype": to_torch(dt)})
            if "val" in u.meta:  # shape only; dtypes are re-derived by the verifier
                c.meta["val"] = u.meta["val"]
            c.meta["nn_module_stack"] = u.meta.get("nn_module_stack", {})
            set_meta(c, NodeMeta(dtype=dt, inserted_cast=True, op_class="cast", decided_by=PASS,
                                 reason=f"{du} producer read in {dt}",
                                 key=f"cast({read_meta(u).key or u.name})->{dt}"))
            cache[key] = c
            stats["casts"] += 1
            stats["cast_bytes"] += tensor_bytes(u)
        return cache[key]

    for node in list(graph.nodes):  # the casts added meanwhile are not visited
        compute = _float_compute(node)

        def repl(a, node=node, compute=compute):
            dt = _read_dtype(node, a)
            if dt is None:
                return a
            a = cast(a, dt, node)  # rounded through the storage dtype first
            return a if compute is None else cast(a, compute, node)

        node.args = fx.node.map_arg(node.args, repl)
        node.kwargs = fx.node.map_arg(node.kwargs, repl)
        if compute is not None:
            _store(graph, node, compute, stats)
    gm.recompile()
    return PassResult(gm, stats["casts"] > 0, stats)


def _float_compute(node: fx.Node) -> str | None:
    """The float compute dtype of a node that computes in another dtype than it stores
    (``NodeMeta.compute`` of ``assign_dtypes``), or None. fp8 compute is ``lower_fp8``'s: the
    node reads and writes its storage dtype here."""
    meta = read_meta(node)
    compute = meta.compute
    if node.op != "call_function" or compute is None or compute not in DTYPES or compute == meta.dtype:
        return None
    return compute


def _store(graph: fx.Graph, node: fx.Node, compute: str, stats: dict[str, int]) -> None:
    """Make ``node`` output its compute dtype and store it back: one cast to the storage dtype
    right after it, read by all its consumers; the node's ``dtype`` becomes ``compute`` and
    ``storage`` records what its consumers read."""
    meta = meta_of(node)
    storage = meta.dtype
    if isinstance(node.meta.get("val"), (list, tuple)):  # several outputs (split, broadcast_tensors)
        _store_each(graph, node, compute, stats)
        return
    users = list(node.users)
    with graph.inserting_after(node):
        c = graph.call_function(CAST_OP, (node,), {"dtype": to_torch(storage)})
    c.meta["val"] = node.meta.get("val")
    c.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
    cast_meta = set_meta(c, NodeMeta(dtype=storage, inserted_cast=True, op_class="cast", decided_by=PASS,
                                     reason=f"computed in {compute}, stored {storage}",
                                     key=f"store({meta.key or node.name})->{storage}"))
    for u in users:
        u.replace_input_with(node, c)
    saved, meta.saved = meta.saved, None  # what backward keeps is the stored tensor: the cast's output
    if saved is not None and saved != storage:
        cast_meta.saved = saved
    meta.dtype, meta.storage = compute, storage
    stats["casts"] += 1
    stats["cast_bytes"] += tensor_bytes(node)


def _store_each(graph: fx.Graph, node: fx.Node, compute: str, stats: dict[str, int]) -> None:
    """:func:`_store` for a node with several outputs: a list is no tensor to cast, so each float
    output is stored back after the ``operator.getitem`` that reads it (how an ATen graph reads
    them); the node's ``dtype`` becomes ``compute``, and each getter's ``dtype`` and ``storage`` as
    :func:`_store` sets a node's.

    Raises:
        PassError: the node's outputs are read other than through ``operator.getitem``.
    """
    getters = list(node.users)
    if not all(g.op == "call_function" and g.target is operator.getitem for g in getters):
        raise pass_error(PASS, node, f"computes in {compute} but its outputs are read other than by getitem "
                                     f"({', '.join(g.name for g in getters)}), so they cannot be stored back")
    meta_of(node).dtype = compute
    for g in getters:
        if read_meta(g).dtype is not None and is_float_value(g.meta.get("val")):
            _store(graph, g, compute, stats)


class InsertCasts(PassBase):
    """Pass 2 as a :class:`~autoprec.passes.base.PassBase`: :func:`insert_casts`."""

    name = PASS

    def call(self, gm: fx.GraphModule) -> PassResult:
        """``insert_casts(gm)``; ``gm`` is not modified
        (unless the runner owns it: ``writable``)."""
        return insert_casts(gm)

    def ensures(self, gm: fx.GraphModule) -> None:
        """Every edge agrees: each node reads its float inputs in the dtype it must read them in.

        Raises:
            PassError: a node reads an input of another dtype with no cast between them.
        """
        for node in gm.graph.nodes:
            for a in node.all_input_nodes:
                want = _read_dtype(node, a)
                if want is not None and _dtype_of(a) != want:
                    raise pass_error(
                        PASS, node, f"reads input {a.name} ({_dtype_of(a)}) in {want} with no cast"
                    )
