"""The dtype names used in policy files and their torch dtypes (docs/architecture.md#policy-file).

Three families, by what a policy may use them for:

- storage dtypes (:data:`DTYPES`): what a node's output is stored as and its neighbours read;
- compute dtypes (:data:`COMPUTE_DTYPES`): what a node's op runs in (a rule's ``compute``), the
  storage dtypes plus ``fp8_e4m3`` (matmuls only: ``autoprec.kernels.fp8``, a scaled matmul);
- saved dtypes (:data:`SAVED_DTYPES`): what a node's output is saved as for backward (a rule's
  ``saved``), the storage dtypes plus ``fp8_e5m2`` (with a per-tensor scale).

fp8 names are never storage dtypes: an fp8 tensor means nothing without its scale.
"""

from __future__ import annotations

import torch

#: Storage dtype name -> torch dtype.
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
#: The fp8 names -> torch dtypes (OCP FP8 formats: e4m3 for forward operands, e5m2 for gradients
#: and saved activations; Micikevicius et al. 2022, "FP8 Formats for Deep Learning").
FP8_DTYPES: dict[str, torch.dtype] = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
#: The fp8 compute dtype of matmuls (a rule's ``dtype`` or ``compute``).
FP8_COMPUTE = "fp8_e4m3"
#: Names a rule's ``compute`` may take.
COMPUTE_DTYPES: tuple[str, ...] = (*DTYPES, FP8_COMPUTE)
#: Names a rule's ``saved`` may take.
SAVED_DTYPES: tuple[str, ...] = (*DTYPES, "fp8_e5m2")
#: torch dtype -> policy dtype name (storage dtypes and fp8).
NAMES: dict[torch.dtype, str] = {v: k for k, v in {**DTYPES, **FP8_DTYPES}.items()}
#: The low-precision storage dtypes: those the search may choose from and fp32 accumulation rewrites.
LOW_DTYPES: tuple[str, ...] = ("bf16", "fp16")


def kernel_name(dtype: str, compute: str | None) -> str:
    """The ``storage:compute`` name of a node's or rule's kernel, e.g. ``"bf16:fp32"``; just the
    storage dtype when the compute dtype is the same or not given (``"bf16"``). The search's kernel
    choices (``autoprec.search.probe.KERNELS``) are written the same way."""
    return dtype if compute in (None, dtype) else f"{dtype}:{compute}"


def to_torch(name: str) -> torch.dtype:
    """Map a policy dtype name (``"fp32"``, ``"bf16"``, ``"fp16"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``)
    to a ``torch.dtype``.

    Raises:
        ValueError: ``name`` is not one of :data:`DTYPES` or :data:`FP8_DTYPES`; the message lists
            the valid names.
    """
    try:
        return DTYPES[name] if name in DTYPES else FP8_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; valid: {sorted(DTYPES) + sorted(FP8_DTYPES)}") from None
