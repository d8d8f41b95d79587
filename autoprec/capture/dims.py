"""Which input dimensions are the batch and the sequence dimension, and the range each may take.

One rule, made once per capture as a :class:`DimPlan` and passed down: to the export
(:func:`autoprec.capture.export.export_program`, the ``torch.export`` ``dynamic_shapes``), through
the exported ranges to :class:`autoprec.capture.shapes.InputShapes` (the ranges a call is checked
against), and to the per-shape graph cache of ``autoprec.applied.shape_cache`` (the same ranges when
a model cannot be captured dynamically); docs/architecture.md#runtime.

The heuristic, on the example batch's tensors (flattened as torch's pytree, ``_torch_compat.pytree``,
flattens the call's ``(args, kwargs)``):

- the *primary* input is ``input_ids`` when the batch has it, else the first integer tensor, else
  the first tensor (with at least one dimension);
- **batch** is dimension 0 of every tensor whose dimension 0 equals the primary's (``B``);
- **sequence** is dimension 1 of every 2-D-or-more tensor whose dimension 1 equals the primary's
  (``T``), when the primary is a 2-D integer tensor (token ids ``[B, T]``; images and feature
  vectors have no sequence dimension);
- **target** (``target_seq``, encoder-decoders: ``config.is_encoder_decoder``) is dimension 1 of the
  target-side inputs (``labels``, ``decoder_*``), a length of its own.

Ranges: batch sizes ``1..B`` (the example batch is taken as the largest: data loaders give full
batches and a smaller last one); sequence lengths ``2..max(T, config.max_position_embeddings)``
when the model has a ``config`` with ``max_position_embeddings`` (Hugging Face models), else
``2..T``. A dimension is dynamic only when its example size is at least 2 (``torch.export``
specialises sizes 0 and 1) and its range holds more than one size. Sequence length 1 is
excluded because Hugging Face attention code branches on ``query_length == 1`` (decoding), which
would specialise the capture. Several batches (``tune``'s and ``train``'s first batches) are
measured per role (:func:`largest_sizes`) and planned once, on the largest of them, with ranges
reaching every batch's sizes (``at_least``).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoprec._torch_compat import pytree
from autoprec.modelspec import split_batch

__all__ = ["BATCH", "SEQ", "TARGET", "DimPlan", "DimRange", "largest_batch", "largest_sizes", "leaf_name",
           "leaves_of", "max_positions", "maxima", "plan_dims", "role_sizes", "shapes_vary", "tensor_shapes"]

#: The roles a dynamic dimension can have: the batch, the (source) sequence, an encoder-decoder's target.
BATCH, SEQ, TARGET = "batch", "seq", "target_seq"


@dataclass(frozen=True)
class DimRange:
    """A dynamic dimension: its role (``"batch"``, ``"seq"``, ``"target_seq"``), inclusive bounds and
    example size (all in elements)."""

    role: str
    lo: int
    hi: int
    example: int

    def __str__(self) -> str:
        return f"{self.role} {self.lo}..{self.hi}"


@dataclass
class DimPlan:
    """Dynamic dimensions of one capture, for its example batch: made once (:func:`plan_dims`) and
    passed to whoever needs them (the export, the per-shape cache's range check).

    Attributes:
        names: Display name per tensor leaf of ``(args, kwargs)`` (``"input_ids"``, ``"args[0]"``).
        paths: ``pytree.keystr`` path per leaf (``"[1]['input_ids']"``), in flatten order.
        dims: Per leaf, ``{dimension index: DimRange}`` of its dynamic dimensions.
        ranges: ``{role: DimRange}`` of the roles found (``batch``, ``seq``, ``target_seq``).
    """

    names: list[str] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    dims: list[dict[int, DimRange]] = field(default_factory=list)
    ranges: dict[str, DimRange] = field(default_factory=dict)

    @property
    def dynamic(self) -> bool:
        """Whether any dimension is dynamic."""
        return any(self.dims)

    def describe(self) -> str:
        """``"batch 1..4, seq 2..512"`` (or ``"no dynamic dimension"``)."""
        return ", ".join(str(r) for r in self.ranges.values()) or "no dynamic dimension"

    def out_of_range(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
        """Inputs of a call whose dynamic dimensions leave their range, as message fragments.

        Returns:
            ``["input 'input_ids' has shape (5, 17): dim 0 (batch) is 5, allowed 1..4", ...]``;
            empty when every dimension fits or the call has another structure than the example.
        """
        found, paths = leaves_of(args, kwargs)
        by_path = {pytree.keystr(p): leaf for p, leaf in zip(paths, found)}  # keywords in any order
        if len(found) != len(self.dims) or set(by_path) != set(self.paths):
            return []
        leaves = [by_path[p] for p in self.paths]
        bad = []
        for name, leaf, dims in zip(self.names, leaves, self.dims):
            if not isinstance(leaf, torch.Tensor):
                continue
            for i, r in dims.items():
                size = leaf.shape[i] if i < leaf.dim() else None
                if size is None or not r.lo <= size <= r.hi:
                    bad.append(f"input {name!r} has shape {tuple(leaf.shape)}: dim {i} ({r.role}) is {size}, "
                               f"allowed {r.lo}..{r.hi}")
        return bad


def plan_dims(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
              at_least: Mapping[str, int] | None = None) -> DimPlan:
    """Find the batch and sequence dimensions of a call and their ranges (heuristic: module docstring).

    The plan builder: a capture makes its plan once and passes it down (to the export, to the
    per-shape cache); several batches are measured with :func:`largest_sizes`, not planned.

    Args:
        model: The model; ``model.config.max_position_embeddings`` (an int), when present, bounds
            the sequence length (:func:`max_positions`; ``at_least`` does not widen past it, unless
            the example itself is longer).
        args, kwargs: The example call, as ``autoprec.modelspec.split_batch`` splits a batch.
        at_least: Upper bounds the ranges must reach whatever the example's sizes, by role
            (``{"batch": 4, "seq": 128}``: the largest sizes of several batches, :func:`largest_sizes`).

    Returns:
        A :class:`DimPlan`; ``plan.dynamic`` is False when no dimension can vary (e.g. batch 1 and
        no token ids).
    """
    roles = _Roles.of(model, args, kwargs)
    plan = DimPlan(names=roles.names, paths=roles.paths, dims=[{} for _ in roles.names])
    want = dict(at_least or {})
    positions = max_positions(model)
    for role, size in roles.sizes.items():  # batch, seq, target_seq: the order ranges are shown in
        hi = max(size, want.get(role, 0), 0 if role == BATCH else positions or 0)
        if role != BATCH and positions and size <= positions:
            hi = min(hi, positions)  # no range past the position table (at_least does not widen it)
        if role != BATCH or hi >= 2:  # a batch that cannot exceed 1 stays static
            plan.ranges[role] = DimRange(role, 1 if role == BATCH else 2, hi, size)
    for leaf, dim, role in roles.members:
        if role in plan.ranges:
            plan.dims[leaf][dim] = plan.ranges[role]
    return plan


def role_sizes(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, int]:
    """The example size per role of one call (``{"batch": 4, "seq": 128}``), by :func:`plan_dims`'s
    heuristic, without a plan: ``batch`` whenever the call has a tensor, ``seq`` for token ids
    ``[B, T]`` with ``T >= 2``, ``target_seq`` for an encoder-decoder's target side."""
    return dict(_Roles.of(model, args, kwargs).sizes)


def largest_sizes(model: nn.Module, batches: list[Any]) -> dict[str, int]:
    """The largest size per role over several batches (:func:`role_sizes` of each): the
    ``at_least`` of :func:`plan_dims`, so one capture's ranges cover all of them.

    Args:
        model: The model (its ``forward`` names positional inputs; a config marks encoder-decoders).
        batches: Batches as ``get_batch`` returns them (dict, tuple/list or tensor).
    """
    out: dict[str, int] = {}
    for batch in batches:
        for role, size in role_sizes(model, *split_batch(batch)).items():
            out[role] = max(out.get(role, 0), size)
    return out


@dataclass(frozen=True)
class _Roles:
    """Which tensor dimensions of one call have which role, and the role's size there.

    Attributes:
        names, paths: Per leaf of ``(args, kwargs)``, as :class:`DimPlan`'s.
        sizes: ``{role: example size}``, in the order batch, seq, target_seq.
        members: ``(leaf index, dimension, role)`` of every dimension that has a role.
    """

    names: list[str]
    paths: list[str]
    sizes: dict[str, int]
    members: list[tuple[int, int, str]]

    @classmethod
    def of(cls, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Roles:
        """The roles of a call (module docstring: primary input, batch, sequence, target)."""
        leaves, paths = leaves_of(args, kwargs)
        names = [leaf_name(p, _arg_names(model)) for p in paths]
        roles = cls(names, [pytree.keystr(p) for p in paths], {}, [])
        tensors = [(i, t) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.dim() >= 1]
        if not tensors:
            return roles
        primary = next((t for i, t in tensors if names[i] == "input_ids"), None)
        if primary is None:
            primary = next((t for _, t in tensors if not t.dtype.is_floating_point and not t.is_complex()),
                           tensors[0][1])
        b = roles.sizes[BATCH] = int(primary.shape[0])
        roles.members.extend((i, 0, BATCH) for i, t in tensors if t.shape[0] == b)
        if primary.dim() == 2 and not primary.dtype.is_floating_point and int(primary.shape[1]) >= 2:
            t_len = roles.sizes[SEQ] = int(primary.shape[1])
            targets = _target_inputs(model, names, tensors, primary)
            for i, t in tensors:
                if i in targets:  # an encoder-decoder's target side: a length of its own
                    n = roles.sizes.setdefault(TARGET, int(t.shape[1]))
                    if t.shape[1] == n:
                        roles.members.append((i, 1, TARGET))
                elif t.dim() >= 2 and t.shape[1] == t_len:
                    roles.members.append((i, 1, SEQ))
        return roles


def _target_inputs(model: nn.Module, names: list[str], tensors: list[tuple[int, torch.Tensor]],
                   primary: torch.Tensor) -> set[int]:
    """Indices of an encoder-decoder model's target-side inputs (``labels``, ``decoder_*``), whose
    length is independent of the source's (``config.is_encoder_decoder``, e.g. T5)."""
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return set()
    return {i for i, t in tensors if t is not primary and t.dim() >= 2 and t.shape[1] >= 2
            and (names[i] == "labels" or names[i].startswith("decoder_"))}


def maxima(plans: list[DimPlan]) -> dict[str, int]:
    """The largest example size per role over several plans (``at_least`` of :func:`plan_dims`, so
    one capture's ranges cover all of them; for batches, :func:`largest_sizes` needs no plans)."""
    out: dict[str, int] = {}
    for plan in plans:
        for role, r in plan.ranges.items():
            out[role] = max(out.get(role, 0), r.example)
    return out


def leaves_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """The leaves of a call's ``(args, kwargs)`` and their pytree key paths, in torch's flatten
    order (the order of :class:`DimPlan`'s per-leaf lists)."""
    flat = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]
    return [v for _, v in flat], [p for p, _ in flat]


def leaf_name(path: Any, arg_names: list[str] | tuple[str, ...] = ()) -> str:
    """``input_ids`` for a keyword or a named positional argument (``args[0]`` when unnamed),
    ``extra[1]['z']`` for a nested leaf."""
    top, rest = path[1], path[2:]
    if path[0].idx == 0:
        base = arg_names[top.idx] if top.idx < len(arg_names) else f"args[{top.idx}]"
    else:
        base = str(top.key)
    return base + pytree.keystr(rest)


def tensor_shapes(args: tuple[Any, ...], kwargs: dict[str, Any],
                  arg_names: list[str] | tuple[str, ...] = ()) -> list[tuple[str, tuple[int, ...]]]:
    """``[(leaf_name, shape), ...]`` of a call's tensor leaves, in flatten order: the one naming
    rule of inputs in autoprec's log lines and reports (``input_ids``, ``args[0]``, ``extra[1]['z']``)."""
    flat = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]
    return [(leaf_name(path, arg_names), tuple(x.shape)) for path, x in flat if isinstance(x, torch.Tensor)]


def _arg_names(model: nn.Module) -> list[str]:
    """Names of ``model.forward``'s positional parameters, in order (empty when unknown)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds]


def max_positions(model: nn.Module) -> int | None:
    """``model.config.max_position_embeddings`` when it is a positive int, else None: the longest
    sequence a capture's ranges reach (a learned position table has no rows past it; Inductor's
    kernels abort the process on the out-of-range index where eager raises ``IndexError``)."""
    n = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def _tensor_shapes(batch: Any) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]


def shapes_vary(batches: list[Any]) -> bool:
    """Whether the model file's batches have more than one input shape: the rule by which
    ``autoprec tune`` (its harness's batches ``get_batch(0..4)``) and ``autoprec train`` (the same
    first batches) capture with dynamic batch/sequence dimensions instead of for one shape.
    The same rule on the same model file gives both the same graph (and graph fingerprint)."""
    return len({tuple(_tensor_shapes(b)) for b in batches}) > 1


def largest_batch(batches: list[Any]) -> Any:
    """The batch with the most tensor elements (the first of equals): a dynamic capture's example,
    since its ranges run up to the example's sizes (:func:`plan_dims`)."""
    def numel(b: Any) -> int:
        return sum(math.prod(s) for s in _tensor_shapes(b))

    return max(batches, key=numel)
