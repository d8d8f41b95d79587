"""What autoprec records on a graph node: one typed :class:`NodeMeta` per node (docs/architecture.md#passes).

Capture, the passes and their readers (compile regions, saved activations, the search, the report)
share what they know about a node through ``node.meta["autoprec"]`` (:data:`META_KEY`), which holds
a :class:`NodeMeta`. The key is the one the untyped dict had, so code that looks for autoprec's
metadata on a node still finds it there; no saved artifact depends on it (policies name nodes by
key, checkpoints hold state dicts, and graph pickles drop node metadata). Nothing else names that
key: writers call :func:`meta_of` (which creates the object on first write) or :func:`set_meta` (a
node the passes insert), readers :func:`read_meta` (which creates nothing), and a pass that copies a
graph calls :func:`unshare_meta`.

Fields, by who writes them (dtype names are ``autoprec.dtypes``'s: ``fp32``, ``bf16``, ``fp16``, and
``fp8_e4m3`` / ``fp8_e5m2`` where said; every field is None, or False for a flag, until written):

- ``key`` (str): the stable node key, ``<module path>/<op>#<k>`` (``nodekeys.assign_keys``, every
  captured ``call_function`` node); a node the passes insert gets one built from its source's:
  ``cast(<key>)-><dtype>``, ``store(<key>)-><dtype>``, ``saturate(<key>)`` (``insert_casts``),
  ``upcast(<key>)->fp32``, ``accumulated(<key>)-><dtype>`` (``accumulate_fp32``), ``t(<key>)``
  (``lower_fp8``). Placeholders, ``get_attr`` and output nodes have none (readers show the FX name).
- ``module`` (str): dotted path of the innermost ``nn.Module`` that produced the node, ``""`` for the
  root (``nodekeys.module_path``); None on inserted casts.
- ``op`` (str): the op's short name (``ops.op_name``: ``aten.linear.default`` -> ``linear``).
- ``region`` (:class:`Region`): the user's ``torch.autocast`` / ``torch.no_grad`` block the node is,
  or is inside (``nodekeys.mark_regions``, case C13).
- ``autocast_disabled`` (bool): the node keeps fp32 / its captured dtype in every policy (a region
  node or a node of a region's body).
- ``pattern`` (str): ``"rms_norm"`` on the nodes of a decomposed RMSNorm (``ops.rmsnorm_regions``,
  case C04), set by ``assign_dtypes``.
- ``op_class`` (str): ``matmul``, ``sensitive``, ``follow`` or ``nonfloat`` (``ops.classify``),
  ``region`` (a higher-order region op), or ``cast`` (a cast the passes inserted); ``assign_dtypes``.
- ``reason`` (str): why, in words: the op table's numerical reason, or a pass's (``"bf16 producer read
  in fp32"``, ``"constant 100000.0 is outside the fp16 range ..."``).
- ``dtype`` (str): the dtype the node's output tensor has: its storage dtype after
  ``assign_dtypes``; ``"auto"`` while a ``follow`` node waits for placement; None for a non-float
  node. On a placeholder/``get_attr`` its captured dtype. After ``insert_casts`` a node that
  computes in another dtype holds its compute dtype here and its storage in ``storage``; after
  ``accumulate_fp32`` a low reduction holds ``fp32``.
- ``decided_by`` (str): what set ``dtype`` (``"rule"``, ``"default_dtype"``, ``"placement:mincut"``,
  ``"input"``, ``"nonfloat"``, a pass name...); later passes append ``"; <pass>"``.
- ``compute`` (str): the dtype the op computes in where a rule sets one other than its storage dtype
  (``fp32`` or ``fp8_e4m3``; ``assign_dtypes``); ``lower_fp8`` lowers the ``fp8_e4m3`` ones.
- ``storage`` (str): the stored dtype of a node computing in another (``insert_casts``), read by its
  consumers through one store cast.
- ``saved`` (str): what the output is saved as for backward (``fp32``, ``bf16``, ``fp16``,
  ``fp8_e5m2``), where it differs from the dtype it is computed in (``assign_dtypes``; moved to the
  store cast by ``insert_casts``); read by ``applied/saved.py``.
- ``impl`` (str): the attention implementation of an SDPA node under ``policy.attention`` other than
  ``fused`` (``"math"``: the ``math_attention`` pass).
- ``inserted_cast`` (bool): a cast (or ``lower_fp8``'s weight transpose) the passes inserted.
- ``saturating_cast`` (bool): a clamp ``insert_casts`` put before the cast of a constant fill that
  does not fit the target dtype (case C03).
- ``accumulate`` (str): ``"fp32"`` on a low-precision reduction ``accumulate_fp32`` rewrote (case C06);
  ``lowered_to`` (str) then holds the low dtype its result is cast back to.
- ``constants_clamped`` (list of ``(argument position or keyword, old value, new value)``): mask fill
  values ``assign_dtypes`` clamped to the node's dtype range (case C03).

Copies: FX's ``node_copy`` (``copy.deepcopy`` of a ``Graph`` or ``GraphModule``, ``graph_copy``)
copies ``node.meta`` shallowly, so copied nodes share their :class:`NodeMeta` with the originals, as
they shared the dict before; :func:`unshare_meta` gives each node of a copied graph its own (what
``passes.base.clone_graph_module`` does, so a pass never writes into its input graph). A pickled
``GraphModule`` keeps only its code (``GraphModule.__reduce__``), and ``torch.export`` or
``torch.compile`` re-trace into new nodes: none of them carries node metadata, of this key or
another, except what torch itself knows (``val``, ``nn_module_stack``, ``custom``...).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

from torch import fx

__all__ = ["META_KEY", "NodeMeta", "Region", "meta_of", "read_meta", "set_meta", "unshare_meta"]

#: Key under ``node.meta`` of a node's :class:`NodeMeta`.
META_KEY = "autoprec"


@dataclass(frozen=True)
class Region:
    """A user ``torch.autocast`` / ``torch.no_grad`` block kept whole (``nodekeys.mark_regions``).

    Attributes:
        kind: ``"autocast"`` (``wrap_with_autocast``) or ``"grad"`` (``wrap_with_set_grad_enabled``).
        enabled: The block's ``enabled`` argument.
        device: Autocast's device type (``"cpu"``, ``"cuda"``); None for a grad block.
        dtype: Autocast's dtype as torch prints it (``"torch.bfloat16"``); None for a grad block.
    """

    kind: str
    enabled: bool
    device: str | None = None
    dtype: str | None = None


@dataclass(slots=True)
class NodeMeta:
    """autoprec's record of one node; the fields are described in the module docstring."""

    key: str | None = None
    module: str | None = None
    op: str | None = None
    region: Region | None = None
    autocast_disabled: bool = False
    pattern: str | None = None
    op_class: str | None = None
    reason: str | None = None
    dtype: str | None = None
    decided_by: str | None = None
    compute: str | None = None
    storage: str | None = None
    saved: str | None = None
    impl: str | None = None
    inserted_cast: bool = False
    saturating_cast: bool = False
    accumulate: str | None = None
    lowered_to: str | None = None
    constants_clamped: list[tuple[str, float, float]] | None = None

    def copy(self, **changes: Any) -> NodeMeta:
        """A new, writable :class:`NodeMeta` with the same fields (``region`` and
        ``constants_clamped`` shared, as ``dict(meta)`` shared them), ``changes`` applied.

        Raises:
            TypeError: a name in ``changes`` is not a field.
        """
        return NodeMeta(**{**{f.name: getattr(self, f.name) for f in fields(NodeMeta)}, **changes})

    def as_dict(self) -> dict[str, Any]:
        """The fields that differ from their defaults, ``region`` as a dict of its set fields (e.g.
        the vertex attributes of ``graph.to_networkx``)."""
        out: dict[str, Any] = {}
        for f in fields(NodeMeta):
            value = getattr(self, f.name)
            if value != f.default:
                out[f.name] = ({k: v for k, v in dataclasses.asdict(value).items() if v is not None}
                               if isinstance(value, Region) else value)
        return out


class _Absent(NodeMeta):
    """The read-only :class:`NodeMeta` :func:`read_meta` returns for a node that has none."""

    __slots__ = ()

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"read_meta() of a node without autoprec metadata is read-only (setting "
                             f"{name}); write through autoprec.nodemeta.meta_of")


_ABSENT = object.__new__(_Absent)
for _f in fields(NodeMeta):
    object.__setattr__(_ABSENT, _f.name, _f.default)


def _stored(node: fx.Node) -> NodeMeta | None:
    meta = node.meta.get(META_KEY)
    if meta is not None and not isinstance(meta, NodeMeta):
        raise TypeError(f"node {node.name}: node.meta[{META_KEY!r}] holds a {type(meta).__name__}, "
                        "not an autoprec.nodemeta.NodeMeta")
    return meta


def read_meta(node: fx.Node) -> NodeMeta:
    """``node``'s :class:`NodeMeta`, or a read-only one with every field at its default when it has
    none (nothing is created).

    Raises:
        TypeError: ``node.meta["autoprec"]`` holds something other than a :class:`NodeMeta`.
    """
    meta = _stored(node)
    return _ABSENT if meta is None else meta


def meta_of(node: fx.Node) -> NodeMeta:
    """``node``'s :class:`NodeMeta` to write into, created (every field at its default) on first use.

    Raises:
        TypeError: ``node.meta["autoprec"]`` holds something other than a :class:`NodeMeta`.
    """
    meta = _stored(node)
    if meta is None:
        meta = node.meta[META_KEY] = NodeMeta()
    return meta


def set_meta(node: fx.Node, meta: NodeMeta) -> NodeMeta:
    """Give ``node`` (typically one a pass inserts) ``meta``, replacing any it had; returns ``meta``."""
    node.meta[META_KEY] = meta
    return meta


def unshare_meta(graph: fx.Graph) -> None:
    """Give every node of ``graph`` that has a :class:`NodeMeta` its own copy (:meth:`NodeMeta.copy`).

    For a graph just copied from another (``copy.deepcopy``), whose nodes share their metadata with
    the original's: afterwards a write into one graph's node metadata leaves the other's as it was.
    """
    for node in graph.nodes:
        meta = _stored(node)
        if meta is not None:
            node.meta[META_KEY] = meta.copy()
