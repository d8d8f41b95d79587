"""Kernels autoprec's passes can place in a graph: ops of their own, registered with ``torch.library``
so that ``torch.export``, AOTAutograd and Inductor trace through them (docs/architecture.md#layers).

``fp8`` holds the training-capable fp8 linear (``autoprec::fp8_linear``) on torch's ``_scaled_mm``.
"""

from __future__ import annotations

from autoprec.kernels.fp8 import SCALINGS, amax_scale, fp8_linear, fp8_supported, quantize

__all__ = ["SCALINGS", "amax_scale", "fp8_linear", "fp8_supported", "quantize"]
