"""The one ``torch.export`` call of a capture, with its refinement retry
(docs/architecture.md#design-choices).

:func:`export_program` exports the model non-strict (the training IR), with the dynamic dimensions
of a :class:`~autoprec.capture.dims.DimPlan` as ``torch.export.Dim``\\ s, and retries once with the
narrower ranges torch.export suggests when the model's code narrows one; :func:`export_ranges`
reads the ranges the export settled on. torch's noise around an export (the pytree deprecation
warning, the partial graph it prints on failure) is kept out of the user's terminal here too.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from autoprec._torch_compat import pytree
from autoprec.capture.dims import DimPlan, leaves_of

__all__ = ["distinct_inputs", "export_program", "export_ranges", "quiet_partial_graph",
           "quiet_pytree_deprecation"]


@contextlib.contextmanager
def quiet_pytree_deprecation() -> Iterator[None]:
    """Silence torch's ``FutureWarning: isinstance(treespec, LeafSpec) is deprecated`` inside the block.

    torch (2.10+) emits it from its own pytree code when an exported module's pytree specs are
    built or deep-copied (``torch.export``, ``ExportedProgram.module()``, ``copy.deepcopy`` of the
    graph in autoprec's passes); the user can do nothing about it. Only that warning is filtered,
    only inside the block (``warnings.catch_warnings``), so every other warning still shows and the
    caller's filters are restored on exit.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)
        yield


@contextlib.contextmanager
def quiet_partial_graph() -> Iterator[None]:
    """Keep torch.export's failure dump out of the user's terminal.

    When export fails, torch prints the partial FX graph (``e.partial_fx_graph``) to stderr and
    the ``symbolic_shapes`` logger warns "Unable to find user code"; ``capture``'s own error
    (:mod:`autoprec.capture.diagnose`) names the source line instead. stderr is buffered inside
    the block and written out afterwards without the partial graph, so everything else (the
    model's warnings) still shows.
    """
    buf = io.StringIO()
    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes_log.level
    shapes_log.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(buf):
            yield
    except Exception as e:
        partial = getattr(e, "partial_fx_graph", None)
        sys.stderr.write(buf.getvalue().replace(f"{partial}\n", "") if partial is not None
                         else buf.getvalue())
        raise
    else:
        sys.stderr.write(buf.getvalue())
    finally:
        shapes_log.setLevel(level)


def export_program(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                   plan: DimPlan | None) -> Any:
    """``torch.export.export(model, args, kwargs, strict=False)``, dynamic where ``plan`` says.

    With a dynamic ``plan`` the export gets one ``torch.export.Dim`` per role (:func:`dynamic_shapes`).
    Model code can narrow a range (``logits[:, :-1]`` needs sequence length 3 or more, a position
    table of 128 rows caps it at 128): export then raises a constraint violation whose "Suggested
    fixes" ``torch.export.dynamic_shapes.refine_dynamic_shapes_from_suggested_fixes`` applies, and
    the export is retried once with them. Narrowed ranges and a dimension fixed to its example's
    size are taken (``batch = 2`` where the ranges allowed only 1 and 2, and torch specialises 1:
    the others stay dynamic, and a call of another batch gets a graph of its own); a fix that ties
    one dimension to another (``seq = 2*_seq`` for code that branches on the length's parity), or
    fixes every dimension, re-raises the error (the per-shape graphs of
    ``autoprec.applied.shape_cache`` serve such models).

    Args:
        model: The model, called as ``model(*args, **kwargs)``.
        args, kwargs: The example call (tensors at the example's sizes).
        plan: The dynamic dimensions (:func:`autoprec.capture.dims.plan_dims`); None or a plan with
            no dynamic dimension: every size is specialised, no retry.

    Returns:
        The ``torch.export.ExportedProgram``.

    Raises:
        Exception: whatever ``torch.export.export`` raises (``UserError``,
            ``GuardOnDataDependentSymNode``, the model's own errors, ...) when there is nothing to
            refine or the refined export fails too.
    """
    args, kwargs = distinct_inputs(args, kwargs)
    shapes = dynamic_shapes(plan, model, args, kwargs) if plan is not None else None
    try:
        return _export(model, args, kwargs, shapes)
    except Exception as e:  # Dynamo's UserError (constraint violation) among others
        refined = _refined(e, shapes)
        if refined is None:
            raise
        return _export(model, args, kwargs, refined)


def distinct_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The example call with every tensor that shares its storage with an earlier one, or is not
    contiguous, replaced by a contiguous copy (same values, its own storage).

    torch.export gives inputs that alias one another one placeholder: the usual causal-LM batch
    ``{"input_ids": ids, "labels": ids}`` was captured reading ``input_ids`` for both, so every
    later batch whose labels differ (shifted, padded with -100) was silently embedded from its
    labels or raised an index error. With distinct inputs each is a placeholder of its own, and
    a call that passes one tensor twice still runs right. A non-contiguous example (the pre-shifted
    ``input_ids=raw[:, :-1], labels=raw[:, 1:]``) made the export with dynamic dimensions fail on a
    guard of its strides, so such a model fell back to one graph per shape. (A model whose code
    depends on its input's strides, ``labels.view(-1)`` of a non-contiguous tensor, then fails at
    the call as it does eagerly, not at the capture.)
    """
    seen: set[Any] = set()

    def own(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.is_meta:
            return x
        try:
            ptr = x.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without a storage of its own
            ptr = 0
        key = (ptr, x.device) if ptr else id(x)
        if key in seen or not x.is_contiguous():
            return x.clone(memory_format=torch.contiguous_format)
        seen.add(key)
        return x

    return pytree.tree_map(own, (args, kwargs))


def _export(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Any) -> Any:
    """The call itself: non-strict export, the training IR (ATen ops, ``linear`` and SDPA whole)."""
    return torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=shapes)


def _refined(e: BaseException, shapes: Any) -> Any:
    """``shapes`` with the narrowed ranges of ``e``'s "Suggested fixes"; None where there are none or
    one fixes a size or ties two dimensions (not a range).

    Raises:
        BaseException: ``e`` itself (its chain cut, as export's own error) when torch cannot apply
            the fixes.
    """
    from torch.export.dynamic_shapes import refine_dynamic_shapes_from_suggested_fixes

    if shapes is None or "Suggested fixes:" not in str(e):
        return None
    # torch appends advice after the fixes; the parser takes only the "name = fix" lines
    fixes = str(e).split("Suggested fixes:", 1)[1].strip().split("\n\n", 1)[0]
    try:
        refined = refine_dynamic_shapes_from_suggested_fixes("Suggested fixes:\n" + fixes, shapes)
    except Exception:  # noqa: BLE001 - fixes torch cannot apply: report the export's own error
        raise e from None
    before, after = pytree.tree_leaves(shapes), pytree.tree_leaves(refined)
    if len(before) != len(after) or any(not _narrowed_or_fixed(b, a) for b, a in zip(before, after)):
        return None  # tied to another (seq = 2*_seq): not a range; let the caller fall back
    if not any(_is_dim(a) for a in after):
        return None  # every dimension fixed: the static capture is the same graph
    return refined


def _is_dim(leaf: Any) -> bool:
    """Whether a ``dynamic_shapes`` leaf is a ``torch.export.Dim`` (not a fixed size or None)."""
    return hasattr(leaf, "__name__") and not isinstance(leaf, (int, type(None)))


def _narrowed_or_fixed(before: Any, after: Any) -> bool:
    """Whether a refined ``dynamic_shapes`` leaf is ``before`` narrowed (the same Dim's name) or
    fixed to one size (an int: code that needs the example's batch of 2, ``batch = 2``); a Dim of
    another name (``seq = 2*_seq``, two dimensions tied) is neither."""
    if not _is_dim(before):
        return not _is_dim(after) and after == before
    return not _is_dim(after) or after.__name__ == before.__name__


def dynamic_shapes(plan: DimPlan, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The ``dynamic_shapes`` argument of ``torch.export.export(model, args, kwargs)`` for ``plan``, or None.

    One ``torch.export.Dim`` per role, shared by every input that has it (so export knows the
    batch sizes of ``input_ids`` and ``labels`` are one size), built as a
    ``torch.export.ShapesCollection`` keyed by the call's tensors and resolved to the pytree form
    export (and its suggested-fix refinement) takes. None when ``plan`` has no dynamic dimension.
    """
    if not plan.dynamic:
        return None
    made = {role: torch.export.Dim(role, min=r.lo, max=r.hi) for role, r in plan.ranges.items()}
    collection = torch.export.ShapesCollection()
    for leaf, dims in zip(leaves_of(args, kwargs)[0], plan.dims):
        if isinstance(leaf, torch.Tensor) and dims:
            collection[leaf] = {i: made[r.role] for i, r in dims.items()}
    return collection.dynamic_shapes(model, tuple(args), dict(kwargs))


def export_ranges(gm: torch.fx.GraphModule, exported: Any,
                  plan: DimPlan) -> dict[str, tuple[str, int | None, int | None]]:
    """``{symbol: (role, lo, hi)}`` of an exported graph's symbolic input dimensions.

    Roles come from ``plan`` by matching each placeholder's pytree path (the exported program's
    ``in_spec``) with the example's; bounds from ``exported.range_constraints`` (the export's
    own, so a range torch narrowed is reported as narrowed). ``capture`` stores it in
    ``gm.meta[autoprec.capture.shapes.DIMS_META]``, where
    :class:`autoprec.capture.shapes.InputShapes` reads it.

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


def _int(x: Any) -> int | None:
    """A sympy bound as an int; None for an infinite one."""
    try:
        return int(x)
    except (TypeError, ValueError, OverflowError):
        return None
