"""Which capture a model gets for the batches it will run: one graph with dynamic batch/sequence
dimensions, or one for the example's shapes (docs/architecture.md#runtime, #data-flow).

:func:`capture_for` is the rule ``autoprec tune`` and ``autoprec train`` share for a model file's
first :data:`PROBE_BATCHES` batches: their :class:`~autoprec.capture.dims.DimPlan` is made once,
from all of them, and passed down to the one export. :func:`capture_dynamic` is the same choice for
one example batch (``autoprec.apply(..., dynamic=True)``). Where the model cannot be exported with
dynamic dimensions the static capture is returned, with one INFO line on the ``autoprec`` logger:
the caller then runs one graph per input shape (``autoprec.applied.shape_cache.ShapeCache``, at most
:data:`MAX_SHAPES`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from torch import fx, nn

from autoprec.capture.dims import DimPlan, largest_batch, largest_sizes, plan_dims, shapes_vary, tensor_shapes
from autoprec.capture.shapes import DIMS_META, PLAN_META
from autoprec.capture.trace import capture, capture_planned
from autoprec.errors import CaptureError
from autoprec.modelspec import split_batch

__all__ = ["MAX_SHAPES", "PROBE_BATCHES", "autocast_dynamic", "batch_shapes", "capture_dynamic",
           "capture_for", "check_one_graph", "warmup_steps"]

_log = logging.getLogger("autoprec")

#: How many of the model file's first batches (``get_batch(0..4)``) ``tune`` and ``train`` look at
#: to decide between a dynamic and a one-shape capture (:func:`capture_for`).
PROBE_BATCHES = 5

#: Most per-shape graphs a ``ShapeCache`` (``autoprec.applied.shape_cache``) holds. Each costs one
#: capture and lowering (seconds) plus one compile (10-90 s on a 2-core CPU for a small transformer)
#: and its kernels' memory; 16 covers a bucketed loader (e.g. lengths padded to multiples of 64 up to
#: 512, two batch sizes) while bounding the compile time of a loader that pads to the longest sequence.
MAX_SHAPES = 16


def capture_for(model: nn.Module, batches: list[Any], one_graph_for: list[Any] | None = None,
                source: str | os.PathLike = "the model file") -> fx.GraphModule:
    """The capture ``autoprec tune`` and ``autoprec train`` share for a model file's first batches.

    When their shapes vary (:func:`autoprec.capture.dims.shapes_vary`), one capture with dynamic
    dimensions on the largest batch (:func:`~autoprec.capture.dims.largest_batch`), its ranges
    reaching every batch's largest sizes (:func:`~autoprec.capture.dims.largest_sizes`): the plan is
    made once here and passed down to the export; else, or where that export fails, the capture
    for ``batches[0]``'s shapes (a module applied to it meets the other shapes through the
    per-shape cache, which it seeds with batch 0's: the static graph must be batch 0's). One
    rule, so the tuned graph and the trained graph (and their fingerprints) are the same.

    Args:
        model: The fp32 model.
        batches: The first batches as ``get_batch(0..)`` returns them (at least one).
        one_graph_for: The batches the caller runs on the one graph returned (``tune`` and
            ``bench``: :func:`check_one_graph`); None: the caller serves other shapes itself
            (``train``'s per-shape graphs).
        source: The model file, which a refusal names.

    Returns:
        A graph with symbolic dimensions, or the static capture (as :func:`capture_dynamic`).

    Raises:
        CaptureError: as :func:`autoprec.capture.trace.capture`; or ``one_graph_for`` varies in shape
            and the model cannot be captured with dynamic dimensions (:func:`check_one_graph`).
    """
    gm = _capture_for(model, batches)
    if one_graph_for is not None:
        check_one_graph(gm, one_graph_for, os.fspath(source))
    return gm


def _capture_for(model: nn.Module, batches: list[Any]) -> fx.GraphModule:
    """:func:`capture_for`'s choice of capture."""
    if not shapes_vary(batches):
        return capture(model, batches[0])
    example = largest_batch(batches)
    # static: the graph of batch 0, whose shape train's per-shape cache files it under (the largest
    # batch's graph ran batch 0 there and failed its shape guard)
    return _dynamic_or_static(model, example, plan_dims(model, *split_batch(example),
                                                        largest_sizes(model, batches)), batches[0])


def check_one_graph(gm: fx.GraphModule, batches: list[Any], source: str) -> None:
    """Refuse to measure ``batches`` of several shapes on ``gm`` when it serves one shape only (the
    model cannot be exported with dynamic dimensions: :func:`capture_for` fell back to a static
    capture): ``tune`` and ``bench`` run every batch through one graph, and such a graph met the
    next shape with a raw ``AssertionError: Guard failed``.

    Args:
        gm: The capture of :func:`capture_for`.
        batches: The batches it will run.
        source: The model file (named in the message).

    Raises:
        CaptureError: the batches vary in shape and ``gm`` is static; the message says what to do.
    """
    if gm.meta.get(DIMS_META) or not shapes_vary(batches):
        return
    raise CaptureError(
        f"{source}: get_batch(0..{len(batches) - 1}) gives batches of {len(batch_shapes(batches))} shapes, "
        "and the model cannot be captured with dynamic batch/sequence dimensions (the INFO line above says "
        "why); tune and bench measure each policy on one graph for all their batches.\n  What to do: make "
        "get_batch return one shape (pad to a fixed length) for tuning, or make the model exportable with "
        "dynamic shapes; autoprec train and autoprec.apply run such a model with one graph per shape.")


def capture_dynamic(model: nn.Module, example_batch: Any,
                    at_least: Mapping[str, int] | None = None) -> fx.GraphModule:
    """``capture(model, batch, dynamic=True)``, else the per-shape capture with one INFO log line.

    Args:
        model: The fp32 model.
        example_batch: The example batch, the largest the module will be called with (see
            :mod:`autoprec.capture.dims`), unless ``at_least`` says how large the others get.
        at_least: Largest size per role the ranges must reach
            (:func:`autoprec.capture.dims.largest_sizes`).

    Returns:
        A graph with symbolic dimensions (``gm.meta[DIMS_META]`` set), or the static capture when
        the model has no dimension that can vary or cannot be exported with them; when the dynamic
        export failed, the static capture's ``gm.meta[PLAN_META]`` holds the plan it was made under.

    Raises:
        CaptureError: the model cannot be captured even for the example's shape.
    """
    return _dynamic_or_static(model, example_batch, plan_dims(model, *split_batch(example_batch), at_least))


def _dynamic_or_static(model: nn.Module, example_batch: Any, plan: DimPlan,
                       static_batch: Any = None) -> fx.GraphModule:
    """The capture with ``plan``'s dynamic dimensions; the static one, of ``static_batch`` (default:
    ``example_batch``), when it has none or the dynamic export fails (logged, with the first line
    of the reason)."""
    static_batch = example_batch if static_batch is None else static_batch
    if not plan.dynamic:
        return capture(model, static_batch)
    try:
        return capture_planned(model, example_batch, plan)
    except CaptureError as e:
        gm = capture(model, static_batch)  # raises the model's own error if the static capture fails too
        gm.meta[PLAN_META] = plan  # the per-shape cache's ranges: made here once, not planned again
        reason = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        _log.info("%s cannot be captured with dynamic batch/sequence dimensions (%s); using one "
                  "graph per input shape instead (at most %d)", type(model).__name__, reason[:300],
                  MAX_SHAPES)
        return gm


def batch_shapes(batches: list[Any]) -> list[str]:
    """The distinct shapes of ``batches``, in order of first appearance, one line each:
    ``"input_ids (4, 128), labels (4, 128)"`` (inputs named as :func:`autoprec.capture.tensor_shapes`
    names them; the report lists them)."""
    out: list[str] = []
    for batch in batches:
        text = ", ".join(f"{name} {shape}" for name, shape in tensor_shapes(*split_batch(batch)))
        if text not in out:
            out.append(text)
    return out


def warmup_steps(batches: list[Any], warmup: int) -> int:
    """Untimed steps that meet every distinct shape of ``batches`` (cycled from batch 0), so a
    compiled function has compiled for each (and Dynamo's automatic dynamic shapes have settled)
    before a step is timed: at least ``warmup``, and at least up to and including the first batch
    of the last shape to appear (``[4, 4, 5, 4, 6]`` tokens per row: 5, not the 3 distinct shapes).

    Args:
        batches: The batches, in the order steps take them.
        warmup: The warm-up asked for (``--warmup``).

    Returns:
        The warm-up step count.
    """
    seen: set[tuple[Any, ...]] = set()
    last = -1
    for i, b in enumerate(batches):
        key = tuple(tensor_shapes(*split_batch(b)))
        if key not in seen:
            seen.add(key)
            last = i
    return max(int(warmup), last + 1)


def autocast_dynamic(batches: list[Any]) -> bool | None:
    """``torch.compile``'s ``dynamic`` for the torch.autocast + torch.compile baseline (the model's
    ``nn.Module``) over ``batches``: True when they vary in shape, so one compile serves them all
    as it would in a user's training run (Dynamo's default, ``None``, recompiles per shape until
    its automatic dynamic shapes settle, and a Hugging Face Llama with padded batches hit
    ``recompile_limit`` (8) and ran its timed steps compiling: 15 tok/s against 12581 fp32 eager);
    else None (one static compile)."""
    return True if shapes_vary(batches) else None
