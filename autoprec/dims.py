"""Which input dimensions are the batch and the sequence dimension, and the range each may take.

One rule, used by ``capture(..., dynamic=True)`` (the ``torch.export`` ``dynamic_shapes``), by
:class:`autoprec.shapes.InputShapes` (the ranges a call is checked against) and by the per-shape
graph cache of ``autoprec.applied.shape_cache`` (the same ranges when a model cannot be captured
dynamically); docs/architecture.md#runtime.

The heuristic, on the example batch's tensors (flattened as torch's pytree, ``_torch_compat.pytree``,
flattens the call's ``(args, kwargs)``):

- the *primary* input is ``input_ids`` when the batch has it, else the first integer tensor, else
  the first tensor (with at least one dimension);
- **batch** is dimension 0 of every tensor whose dimension 0 equals the primary's (``B``);
- **sequence** is dimension 1 of every 2-D-or-more tensor whose dimension 1 equals the primary's
  (``T``), when the primary is a 2-D integer tensor (token ids ``[B, T]``; images and feature
  vectors have no sequence dimension).

Ranges: batch sizes ``1..B`` (the example batch is taken as the largest: data loaders give full
batches and a smaller last one); sequence lengths ``2..max(T, config.max_position_embeddings)``
when the model has a ``config`` with ``max_position_embeddings`` (Hugging Face models), else
``2..T``. A dimension is dynamic only when its example size is at least 2 (``torch.export``
specialises sizes 0 and 1) and its range holds more than one size. Sequence length 1 is
excluded because Hugging Face attention code branches on ``query_length == 1`` (decoding), which
would specialise the capture.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoprec._torch_compat import pytree

__all__ = ["BATCH", "SEQ", "TARGET", "DimPlan", "DimRange", "export_ranges", "export_refined",
           "largest_batch", "leaf_name", "maxima", "plan_dims", "shapes_vary", "tensor_shapes"]

BATCH, SEQ, TARGET = "batch", "seq", "target_seq"

@dataclass(frozen=True)
class DimRange:
    """A dynamic dimension: its role (``"batch"`` or ``"seq"``), inclusive bounds and example size."""

    role: str
    lo: int
    hi: int
    example: int

    def __str__(self) -> str:
        return f"{self.role} {self.lo}..{self.hi}"


@dataclass
class DimPlan:
    """Dynamic dimensions of one example batch.

    Attributes:
        names: Display name per tensor leaf of ``(args, kwargs)`` (``"input_ids"``, ``"args[0]"``).
        paths: ``pytree.keystr`` path per leaf (``"[1]['input_ids']"``), in flatten order.
        dims: Per leaf, ``{dimension index: DimRange}`` of its dynamic dimensions.
        ranges: ``{role: DimRange}`` of the roles found (``batch``, ``seq``).
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

    def dynamic_shapes(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The ``dynamic_shapes`` argument of ``torch.export.export(model, args, kwargs)``, or None.

        One ``torch.export.Dim`` per role, shared by every input that has it (so export knows the
        batch sizes of ``input_ids`` and ``labels`` are one size), built as a
        ``torch.export.ShapesCollection`` keyed by the call's tensors and resolved to the pytree
        form export (and :func:`export_refined`) takes.
        """
        if not self.dynamic:
            return None
        made = {role: torch.export.Dim(role, min=r.lo, max=r.hi) for role, r in self.ranges.items()}
        collection = torch.export.ShapesCollection()
        for leaf, dims in zip(_leaves(args, kwargs)[0], self.dims):
            if isinstance(leaf, torch.Tensor) and dims:
                collection[leaf] = {i: made[r.role] for i, r in dims.items()}
        return collection.dynamic_shapes(model, tuple(args), dict(kwargs))

    def out_of_range(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
        """Inputs of a call whose dynamic dimensions leave their range, as message fragments.

        Returns:
            ``["input 'input_ids' has shape (5, 17): dim 0 (batch) is 5, allowed 1..4", ...]``;
            empty when every dimension fits or the call has another structure than the example.
        """
        found, paths = _leaves(args, kwargs)
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

    Args:
        model: The model; ``model.config.max_position_embeddings`` (an int), when present, bounds
            the sequence length.
        args, kwargs: The example call, as ``autoprec.modelspec.split_batch`` splits a batch.
        at_least: Upper bounds the ranges must reach whatever the example's sizes, by role
            (``{"batch": 4, "seq": 128}``: the largest sizes of several batches, :func:`maxima`).

    Returns:
        A :class:`DimPlan`; ``plan.dynamic`` is False when no dimension can vary (e.g. batch 1 and
        no token ids).
    """
    leaves, paths = _leaves(args, kwargs)
    plan = DimPlan(names=[leaf_name(p, _arg_names(model)) for p in paths],
                   paths=[pytree.keystr(p) for p in paths], dims=[{} for _ in leaves])
    tensors = [(i, t) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.dim() >= 1]
    if not tensors:
        return plan
    primary = next((t for i, t in tensors if plan.names[i] == "input_ids"), None)
    if primary is None:
        primary = next((t for _, t in tensors if not t.dtype.is_floating_point and not t.is_complex()),
                       tensors[0][1])
    want = dict(at_least or {})
    b = int(primary.shape[0])
    if max(b, want.get(BATCH, 0)) >= 2:
        plan.ranges[BATCH] = DimRange(BATCH, 1, max(b, want.get(BATCH, 0)), b)
        for i, t in tensors:
            if t.shape[0] == b:
                plan.dims[i][0] = plan.ranges[BATCH]
    if primary.dim() == 2 and not primary.dtype.is_floating_point and int(primary.shape[1]) >= 2:
        t_len = int(primary.shape[1])
        plan.ranges[SEQ] = DimRange(SEQ, 2, max(t_len, _max_positions(model) or 0, want.get(SEQ, 0)), t_len)
        targets = _target_inputs(model, plan.names, tensors, primary)
        for i, t in tensors:
            if i in targets:  # an encoder-decoder's target side: a length of its own
                n = int(t.shape[1])
                plan.ranges.setdefault(TARGET, DimRange(TARGET, 2, max(n, _max_positions(model) or 0,
                                                                      want.get(TARGET, 0)), n))
                if n == plan.ranges[TARGET].example:
                    plan.dims[i][1] = plan.ranges[TARGET]
            elif t.dim() >= 2 and t.shape[1] == t_len:
                plan.dims[i][1] = plan.ranges[SEQ]
    return plan


def _target_inputs(model: nn.Module, names: list[str], tensors: list[tuple[int, torch.Tensor]],
                   primary: torch.Tensor) -> set[int]:
    """Indices of an encoder-decoder model's target-side inputs (``labels``, ``decoder_*``), whose
    length is independent of the source's (``config.is_encoder_decoder``, e.g. T5)."""
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return set()
    return {i for i, t in tensors if t is not primary and t.dim() >= 2 and t.shape[1] >= 2
            and (names[i] == "labels" or names[i].startswith("decoder_"))}


def maxima(plans: list[DimPlan]) -> dict[str, int]:
    """The largest example size per role over several batches' plans (``at_least`` of
    :func:`plan_dims`, so one capture's ranges cover all of them)."""
    out: dict[str, int] = {}
    for plan in plans:
        for role, r in plan.ranges.items():
            out[role] = max(out.get(role, 0), r.example)
    return out


def export_refined(export: Callable[[Any], Any], dynamic_shapes: Any) -> Any:
    """``export(dynamic_shapes)``, retried once with the ranges torch.export suggests.

    Model code can narrow a range (``logits[:, :-1]`` needs sequence length 3 or more, a position
    table of 128 rows caps it at 128): export then raises a constraint violation whose "Suggested
    fixes" ``torch.export.dynamic_shapes.refine_dynamic_shapes_from_suggested_fixes`` applies. Only
    narrowed ranges are taken; a fix that specialises a dimension to one size or ties it to another
    (``seq = 2*_seq`` for code that branches on the length's parity) re-raises the error (the
    per-shape cache of ``autoprec.applied.shape_cache`` serves such models).

    Args:
        export: ``export(dynamic_shapes) -> ExportedProgram``.
        dynamic_shapes: From :meth:`DimPlan.dynamic_shapes` (None: no retry).

    Returns:
        The exported program.

    Raises:
        Exception: whatever ``export`` raises when there is nothing to refine or the refined
            export fails too.
    """
    from torch.export.dynamic_shapes import refine_dynamic_shapes_from_suggested_fixes

    try:
        return export(dynamic_shapes)
    except Exception as e:  # Dynamo's UserError (constraint violation) among others
        if dynamic_shapes is None or "Suggested fixes:" not in str(e):
            raise
        # torch appends advice after the fixes; the parser takes only the "name = fix" lines
        fixes = str(e).split("Suggested fixes:", 1)[1].strip().split("\n\n", 1)[0]
        try:
            refined = refine_dynamic_shapes_from_suggested_fixes("Suggested fixes:\n" + fixes, dynamic_shapes)
        except Exception:  # noqa: BLE001 - fixes torch cannot apply: report the export's own error
            raise e from None
        before, after = pytree.tree_leaves(dynamic_shapes), pytree.tree_leaves(refined)
        if len(before) != len(after) or any(type(a) is not type(b) or getattr(a, "__name__", a) !=
                                            getattr(b, "__name__", b) for a, b in zip(after, before)):
            raise  # a size fixed, or tied to another (seq = 2*_seq): not a range; let the caller fall back
        return export(refined)


def export_ranges(gm: torch.fx.GraphModule, exported: Any,
                  plan: DimPlan) -> dict[str, tuple[str, int | None, int | None]]:
    """``{symbol: (role, lo, hi)}`` of an exported graph's symbolic input dimensions.

    Roles come from ``plan`` by matching each placeholder's pytree path (the exported program's
    ``in_spec``) with the example's; bounds from ``exported.range_constraints`` (the export's
    own, so a range torch narrowed is reported as narrowed). ``capture`` stores it in
    ``gm.meta[autoprec.shapes.DIMS_META]``, where :class:`autoprec.shapes.InputShapes` reads it.

    Args:
        gm: ``exported.module()``.
        exported: The ``torch.export.ExportedProgram``.
        plan: The plan the export's ``dynamic_shapes`` came from.

    Returns:
        ``{"s0": ("batch", 1, 4), "s1": ("seq", 2, 512)}``; a bound is None when unbounded.
    """
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    role_of = {path: dims for path, dims in zip(plan.paths, plan.dims)}
    bounds = {str(k): (_int(v.lower), _int(v.upper)) for k, v in exported.range_constraints.items()}
    found: dict[str, tuple[str, int | None, int | None]] = {}
    tree = pytree.tree_unflatten(vals, exported.call_spec.in_spec)
    for path, val in pytree.tree_flatten_with_path(tree)[0]:
        if not isinstance(val, torch.Tensor):
            continue
        dims = role_of.get(pytree.keystr(path), {})
        for i, d in enumerate(val.shape):
            if isinstance(d, torch.SymInt) and str(d) in bounds:
                role = dims[i].role if i in dims else f"dim {i}"
                found.setdefault(str(d), (role, *bounds[str(d)]))
    return found


def _leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], list[Any]]:
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
    import inspect

    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds]


def _max_positions(model: nn.Module) -> int | None:
    n = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def _int(x: Any) -> int | None:
    """A sympy bound as an int; None for an infinite one."""
    try:
        return int(x)
    except (TypeError, ValueError, OverflowError):
        return None


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
