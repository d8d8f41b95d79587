"""Capture: a model's forward as an ATen ``GraphModule``, and the dynamic dimensions it is captured
with (docs/architecture.md#data-flow, #layers).

One capture, top to bottom:

- :mod:`~autoprec.capture.batches`: which capture the batches get (:func:`capture_for`,
  :func:`capture_dynamic`): dynamic when their shapes vary, with one :class:`DimPlan` made once;
- :mod:`~autoprec.capture.dims`: the plan (:func:`plan_dims`: batch, sequence and target
  dimensions and their ranges);
- :mod:`~autoprec.capture.trace`: :func:`capture` itself (training kwargs, node keys, regions);
- :mod:`~autoprec.capture.export`: the one ``torch.export`` call, with its refinement retry;
- :mod:`~autoprec.capture.causal`: causal masks built from shapes become SDPA's ``is_causal``;
- :mod:`~autoprec.capture.diagnose`: the ``CaptureError`` message when the export fails;
- :mod:`~autoprec.capture.shapes`: :class:`InputShapes`, a call checked against the captured
  shapes and ranges.
"""

from __future__ import annotations

from autoprec.capture.batches import (
    MAX_SHAPES,
    PROBE_BATCHES,
    autocast_dynamic,
    batch_shapes,
    capture_dynamic,
    capture_for,
    check_one_graph,
    warmup_steps,
)
from autoprec.capture.dims import (
    BATCH,
    SEQ,
    TARGET,
    DimPlan,
    DimRange,
    largest_batch,
    largest_sizes,
    leaf_name,
    max_positions,
    maxima,
    plan_dims,
    role_sizes,
    shapes_vary,
    tensor_shapes,
)
from autoprec.capture.export import export_program, export_ranges, quiet_pytree_deprecation
from autoprec.capture.shapes import DIMS_META, PLAN_META, RANGE_ADVICE, InputShapes, unserved
from autoprec.capture.trace import CALL_KWARGS_META, capture, capture_planned

__all__ = ["BATCH", "CALL_KWARGS_META", "DIMS_META", "MAX_SHAPES", "PLAN_META", "PROBE_BATCHES",
           "RANGE_ADVICE", "SEQ", "TARGET", "DimPlan", "DimRange", "InputShapes", "autocast_dynamic",
           "batch_shapes", "capture", "capture_dynamic", "capture_for", "capture_planned", "check_one_graph",
           "export_program",
           "export_ranges", "largest_batch", "largest_sizes", "leaf_name", "max_positions", "maxima",
           "plan_dims",
           "quiet_pytree_deprecation", "role_sizes", "shapes_vary", "tensor_shapes", "unserved",
           "warmup_steps"]
