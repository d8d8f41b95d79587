"""Loss scaling: the defaults, the valid ranges and the policy's :class:`LossScalingConfig`.

The one home of these rules (``docs/architecture.md#policy-file``): the policy file's
``loss_scaling`` block is checked by :func:`check_loss_scaling`, and
:class:`autoprec.training.scaler.DynamicLossScaler` takes its defaults from the constants below
and checks its arguments with the same function, so a policy that loads always builds a scaler.

Defaults: ``init_scale``, ``growth_factor``, ``backoff_factor`` and ``growth_interval`` are those of
``torch.amp.GradScaler`` (https://pytorch.org/docs/stable/amp.html#torch.amp.GradScaler:
``init_scale=2.**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000``).
``min_scale`` and ``max_scale`` are autoprec additions (GradScaler has neither): a floor at which a
persisting overflow is an error (DeepSpeed's ``min_loss_scale``) and a cap so a tiny loss cannot
grow the scale towards inf (cases C09).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autoprec.policy.fields import check_choice, fail, join

__all__ = [
    "BACKOFF_FACTOR", "FP32_MAX", "GROWTH_FACTOR", "GROWTH_INTERVAL", "INIT_SCALE", "LOSS_SCALING_KEYS",
    "LOSS_SCALING_MODES", "LossScalingConfig", "LossScalingValueError", "MAX_SCALE", "MIN_SCALE",
    "check_fp32_exact", "check_loss_scaling", "to_fp32",
]

#: ``torch.amp.GradScaler`` defaults (PyTorch AMP docs, see the module docstring).
INIT_SCALE: float = 2.0**16
GROWTH_FACTOR: float = 2.0
BACKOFF_FACTOR: float = 0.5
GROWTH_INTERVAL: int = 2000
#: autoprec's floor and cap of the scale (exactly representable in float32).
MIN_SCALE: float = 1.0
MAX_SCALE: float = 2.0**24
#: Largest finite float32, ``torch.finfo(torch.float32).max``: the scale is held in float32.
FP32_MAX: float = struct.unpack("<f", b"\xff\xff\x7f\x7f")[0]

LOSS_SCALING_MODES: tuple[str, ...] = ("dynamic", "none")
LOSS_SCALING_KEYS: tuple[str, ...] = (
    "mode", "init_scale", "growth_factor", "backoff_factor", "growth_interval", "min_scale", "max_scale",
)


class LossScalingValueError(ValueError):
    """A loss-scaling setting is out of range; ``str()`` is ``"<field>: <reason>"``.

    Attributes:
        field: The setting's name, e.g. ``"growth_factor"``.
        reason: What is wrong with it, e.g. ``"must be > 1, got 1.0"``.
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


def to_fp32(x: float) -> float:
    """``x`` rounded to the nearest float32 (C ``static_cast<float>``; overflow gives ``±inf``)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def check_fp32_exact(name: str, value: float) -> None:
    """Raises: LossScalingValueError: ``value`` is not exactly a float32 value."""
    if to_fp32(value) != value:
        raise LossScalingValueError(name, f"{value!r} is not exactly representable in float32 "
                                          "(use e.g. a power of 2)")


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LossScalingValueError(name, f"expected a number, got {_type(value)} {value!r}")
    if not math.isfinite(value):
        raise LossScalingValueError(name, f"{value!r} is not a finite number")
    return float(value)


def _type(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def check_loss_scaling(values: Mapping[str, Any], scale_name: str = "init_scale") -> dict[str, Any]:
    """Check the numeric loss-scaling settings against their valid ranges.

    Ranges: ``growth_factor > 1``; ``0 < backoff_factor < 1``; ``growth_interval`` an integer
    ``>= 1`` (optimizer steps); ``0 < min_scale <= scale <= max_scale <= FP32_MAX``; ``min_scale``
    and ``max_scale`` exactly representable in float32 (the scale is a float32 value, clamped to
    them). All values are finite numbers (bool is not a number).

    Args:
        values: ``scale_name``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
            ``min_scale`` and ``max_scale``; other keys are ignored.
        scale_name: The key of the scale: ``"init_scale"`` (a config) or ``"scale"`` (a
            scaler state dict).

    Returns:
        Those six settings normalised (floats as ``float``, ``growth_interval`` as ``int``).

    Raises:
        LossScalingValueError: the first setting out of range, named.
    """
    names = (scale_name, "growth_factor", "backoff_factor", "min_scale", "max_scale")
    out: dict[str, Any] = {name: _number(name, values[name]) for name in names}
    gi = values["growth_interval"]
    if isinstance(gi, bool) or not isinstance(gi, int):
        raise LossScalingValueError("growth_interval", f"expected an integer, got {_type(gi)} {gi!r}")
    if gi < 1:
        raise LossScalingValueError("growth_interval", f"must be >= 1 (optimizer steps), got {gi}")
    out["growth_interval"] = int(gi)
    scale, lo, hi = out[scale_name], out["min_scale"], out["max_scale"]
    if scale <= 0:
        raise LossScalingValueError(scale_name, f"must be > 0, got {scale!r}")
    if out["growth_factor"] <= 1:
        raise LossScalingValueError("growth_factor", f"must be > 1, got {out['growth_factor']!r}")
    if not 0 < out["backoff_factor"] < 1:
        raise LossScalingValueError("backoff_factor", f"must be in (0, 1), got {out['backoff_factor']!r}")
    if lo <= 0:
        raise LossScalingValueError("min_scale", f"must be > 0, got {lo!r}")
    if lo > scale:
        raise LossScalingValueError("min_scale", f"{lo!r} is above {scale_name} {scale!r}")
    if hi < scale:
        raise LossScalingValueError("max_scale", f"{hi!r} is below {scale_name} {scale!r}")
    if hi > FP32_MAX:
        raise LossScalingValueError("max_scale", f"must be <= float32 max ({FP32_MAX!r}), got {hi!r}")
    check_fp32_exact("min_scale", lo)
    check_fp32_exact("max_scale", hi)
    return out


@dataclass(frozen=True)
class LossScalingConfig:
    """Dynamic loss-scaling settings (consumed by ``training.scaler.DynamicLossScaler``).

    The defaults are those of ``torch.amp.GradScaler``
    (https://pytorch.org/docs/stable/amp.html#torch.amp.GradScaler): ``init_scale=2**16``,
    ``growth_factor=2.0``, ``backoff_factor=0.5``, ``growth_interval=2000``. ``min_scale`` and
    ``max_scale`` are autoprec additions (GradScaler has neither): a floor at which a persisting
    overflow is an error, and a cap so a tiny loss cannot grow the scale to inf (cases C09).
    Ranges: :func:`check_loss_scaling`.

    Attributes:
        mode: ``"dynamic"`` or ``"none"``. ``"none"`` is refused for policies that use fp16
            (fp16 gradients underflow without scaling, cases C07).
        init_scale: Initial scale, > 0 (a multiplier, unitless).
        growth_factor: Scale multiplier after ``growth_interval`` clean steps, > 1.
        backoff_factor: Scale multiplier on a step with inf/NaN gradients, in (0, 1).
        growth_interval: Consecutive clean optimizer steps before growing, integer >= 1.
        min_scale: Floor, 0 < min_scale <= init_scale, exactly representable in float32.
        max_scale: Cap, init_scale <= max_scale <= float32 max, exactly representable in float32.

    Raises:
        PolicyError: a field has a wrong type, is non-finite or out of range.
    """

    mode: str = "dynamic"
    init_scale: float = INIT_SCALE
    growth_factor: float = GROWTH_FACTOR
    backoff_factor: float = BACKOFF_FACTOR
    growth_interval: int = GROWTH_INTERVAL
    min_scale: float = MIN_SCALE
    max_scale: float = MAX_SCALE

    def __post_init__(self) -> None:
        self._validate("LossScalingConfig", "")

    def _validate(self, source: str, path: str) -> None:
        """Check every field once, naming ``source`` and ``path``; normalise the numbers."""
        check_choice(self.mode, LOSS_SCALING_MODES, "mode", source, join(path, "mode"))
        try:
            normalised = check_loss_scaling({k: getattr(self, k) for k in LOSS_SCALING_KEYS[1:]})
        except LossScalingValueError as e:
            raise fail(source, join(path, e.field), e.reason) from None
        for name, value in normalised.items():
            object.__setattr__(self, name, value)

    def to_dict(self) -> dict[str, Any]:
        """The config as a JSON object in field order."""
        return {k: getattr(self, k) for k in LOSS_SCALING_KEYS}
