"""The checks of :class:`autoprec.training.scaler.DynamicLossScaler`'s configuration and of the state
dicts it loads (docs/architecture.md#runtime): every value validated before any is set, each error
naming its key.

The scale settings are checked by the policy's loss-scaling rules
(:func:`autoprec.policy.loss_scaling.check_loss_scaling`, the one home of their ranges); the skip
counters and the growth tracker against each other here.
"""

from __future__ import annotations

from typing import Any

from autoprec.policy.loss_scaling import check_fp32_exact, check_loss_scaling

__all__ = ["AUTOPREC_KEYS", "GRADSCALER_KEYS", "Config", "Counters", "check_config", "check_state"]

#: Keys ``GradScaler.state_dict()`` writes (required on load).
GRADSCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
#: Keys autoprec adds (optional on load).
AUTOPREC_KEYS = ("min_scale", "max_scale", "max_skips_at_floor", "skipped_steps", "consecutive_skips",
                 "skips_at_floor")

#: ``(scale, growth_factor, backoff_factor, growth_interval, min_scale, max_scale, max_skips_at_floor)``.
Config = tuple[float, float, float, int, float, float, int]
#: ``(growth_tracker, skipped_steps, consecutive_skips, skips_at_floor)``.
Counters = tuple[int, int, int, int]


def _as_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")  # noqa: TRY004 (bad value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return value


def check_config(scale_name: str, scale: Any, growth_factor: Any, backoff_factor: Any,
                 growth_interval: Any, min_scale: Any, max_scale: Any, max_skips_at_floor: Any) -> Config:
    """The scaler's configuration, validated with the policy's loss-scaling ranges
    (:func:`autoprec.policy.loss_scaling.check_loss_scaling`; the scale named ``scale_name``).

    Raises:
        ValueError: a value is out of range; the message names the argument.
    """
    v = check_loss_scaling({scale_name: scale, "growth_factor": growth_factor,
                            "backoff_factor": backoff_factor, "growth_interval": growth_interval,
                            "min_scale": min_scale, "max_scale": max_scale}, scale_name=scale_name)
    max_skips_at_floor = _as_int("max_skips_at_floor", max_skips_at_floor, 1)
    return (v[scale_name], v["growth_factor"], v["backoff_factor"], v["growth_interval"], v["min_scale"],
            v["max_scale"], max_skips_at_floor)


def check_state(state_dict: dict[str, Any], defaults: dict[str, Any]) -> tuple[Config, Counters]:
    """A state dict's configuration and counters, validated (nothing is set here).

    Args:
        state_dict: A ``DynamicLossScaler.state_dict()`` or a ``GradScaler.state_dict()``.
        defaults: The loading scaler's ``min_scale``, ``max_scale`` and ``max_skips_at_floor``, used
            for keys a ``GradScaler`` state lacks (its skip counters then start at 0).

    Raises:
        ValueError: The dict is empty, has an unknown or missing key, or an invalid value (e.g. a
            scale outside ``[min_scale, max_scale]`` or not a float32 value); the message names the key.
    """
    if not state_dict:
        raise ValueError("the scaler state dict is empty, possibly because it was saved from a "
                         "disabled scaler")
    unknown = sorted(set(state_dict) - set(GRADSCALER_KEYS) - set(AUTOPREC_KEYS))
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} in scaler state dict; valid keys: "
                         f"{list(GRADSCALER_KEYS + AUTOPREC_KEYS)}")
    missing = [k for k in GRADSCALER_KEYS if k not in state_dict]
    if missing:
        raise ValueError(f"missing key {missing[0]!r} in scaler state dict")
    d = {**defaults, "skipped_steps": 0, "consecutive_skips": 0, "skips_at_floor": 0, **state_dict}
    config = check_config("scale", d["scale"], d["growth_factor"], d["backoff_factor"],
                          d["growth_interval"], d["min_scale"], d["max_scale"], d["max_skips_at_floor"])
    check_fp32_exact("scale", config[0])
    return config, _check_counters(d, growth_interval=config[3])


def _check_counters(d: dict[str, Any], growth_interval: int) -> Counters:
    """Validates the tracker and skip counters of a state dict against each other."""
    tracker = _as_int("_growth_tracker", d["_growth_tracker"], 0)
    if tracker >= growth_interval:
        raise ValueError(f"_growth_tracker must be < growth_interval ({growth_interval}), got {tracker}")
    skipped = _as_int("skipped_steps", d["skipped_steps"], 0)
    consecutive = _as_int("consecutive_skips", d["consecutive_skips"], 0)
    if consecutive > skipped:
        raise ValueError(f"consecutive_skips ({consecutive}) must be <= skipped_steps ({skipped})")
    if consecutive and tracker:
        raise ValueError(f"_growth_tracker must be 0 after a skipped step (consecutive_skips={consecutive}), "
                         f"got {tracker}")
    at_floor = _as_int("skips_at_floor", d["skips_at_floor"], 0)
    if at_floor > consecutive:
        raise ValueError(f"skips_at_floor ({at_floor}) must be <= consecutive_skips ({consecutive})")
    return tracker, skipped, consecutive, at_floor
