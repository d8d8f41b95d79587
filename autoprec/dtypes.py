"""The dtype names used in policy files and their torch dtypes (docs/architecture.md#policy-file)."""

from __future__ import annotations

import torch

#: Policy dtype name -> torch dtype (fp8 is not among them yet: a policy naming it is refused at load).
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
#: torch dtype -> policy dtype name.
NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
#: The low-precision dtypes: those the search may choose from and fp32 accumulation rewrites.
LOW_DTYPES: tuple[str, ...] = ("bf16", "fp16")


def to_torch(name: str) -> torch.dtype:
    """Map a policy dtype name (``"fp32"``, ``"bf16"``, ``"fp16"``) to a ``torch.dtype``.

    Raises:
        ValueError: ``name`` is not one of :data:`DTYPES`; the message lists the valid names.
    """
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; valid: {sorted(DTYPES)}") from None
