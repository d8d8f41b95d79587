"""The batch a policy trains at (``Policy.batching``; docs/architecture.md#policy-file): the micro-batch
each forward/backward sees and how many micro-batches accumulate into one optimizer step.

``tune --global-batch N`` chooses the micro-batch ``m`` (a divisor of ``N``) with the precision
policy and its memory lever, and records ``micro_batch = m`` and ``accumulation = N / m``; the global
batch, the batch one optimizer step averages over, is their product. Both count in the model file's
batch unit (its ``get_batch``'s leading dimension: sequences or examples). A policy without
``batching`` trains at the model file's batch, one micro-batch per optimizer step, as before the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autoprec.policy.fields import check_keys, check_mapping, described, fail, join

__all__ = ["BATCHING_KEYS", "Batching"]

#: The keys of a policy file's ``batching`` object (both required).
BATCHING_KEYS: tuple[str, ...] = ("micro_batch", "accumulation")


@dataclass(frozen=True)
class Batching:
    """Micro-batch and gradient accumulation of a policy (the module docstring).

    Attributes:
        micro_batch: Examples per forward/backward (the model file's batch unit), >= 1.
        accumulation: Micro-batches whose gradients accumulate (fp32, into the master weights'
            ``.grad``) before one optimizer step, >= 1. Each micro-batch's loss is divided by it, so
            the step's gradient is the mean over the global batch, as ``GradScaler`` with
            accumulation and HF Trainer's ``gradient_accumulation_steps`` do.

    Raises:
        PolicyError: a value is not an integer >= 1 (names the field).
    """

    micro_batch: int
    accumulation: int = 1

    def __post_init__(self) -> None:
        self._validate("Batching", "")

    def _validate(self, source: str, path: str) -> None:
        for name in BATCHING_KEYS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise fail(source, join(path, name), f"expected an integer >= 1, got {described(value)}")

    @property
    def global_batch(self) -> int:
        """Examples per optimizer step: ``micro_batch * accumulation``."""
        return self.micro_batch * self.accumulation

    def describe(self) -> str:
        """``"micro-batch 8 x 2 accumulated (global batch 16)"``, or ``"micro-batch 16"``."""
        if self.accumulation == 1:
            return f"micro-batch {self.micro_batch}"
        return (f"micro-batch {self.micro_batch} x {self.accumulation} accumulated "
                f"(global batch {self.global_batch})")

    def to_dict(self) -> dict[str, int]:
        """The policy file's ``batching`` object."""
        return {"micro_batch": self.micro_batch, "accumulation": self.accumulation}

    @classmethod
    def from_dict(cls, d: Any, source: str, path: str = "batching") -> Batching:
        """Inverse of :meth:`to_dict`. Raises: PolicyError: not an object, an unknown or missing key,
        or a value that is not an integer >= 1 (naming ``source`` and the field)."""
        m: Mapping = check_mapping(d, source, path)
        check_keys(m, BATCHING_KEYS, "batching", source, path)
        for key in BATCHING_KEYS:
            if key not in m:
                raise fail(source, join(path, key), "missing (batching names the micro-batch and the "
                           "accumulation)")
        obj = object.__new__(cls)
        for key in BATCHING_KEYS:
            object.__setattr__(obj, key, m[key])
        obj._validate(source, path)
        return obj
