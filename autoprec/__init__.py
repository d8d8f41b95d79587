"""autoprec: a compiler-pass based mixed-precision autotuner for PyTorch training.

Public API (docs/architecture.md#public-api)::

    import autoprec
    gm = autoprec.capture(model, example_batch)
    policy = autoprec.Policy.default(low="bf16")
    mp = autoprec.apply(model, policy, example_batch, compile=True)
    scaler = autoprec.DynamicLossScaler()
    result = autoprec.tune("model.py")
"""

from __future__ import annotations

from typing import Any

from autoprec._version import __version__
from autoprec.capture import capture
from autoprec.errors import (
    AutoprecError,
    CaptureError,
    LossScaleError,
    ModelSpecError,
    PassError,
    PolicyError,
    SearchError,
)
from autoprec.policy import LossScalingConfig, Policy, Rule
from autoprec.runtime.apply import MixedPrecisionModule, apply
from autoprec.runtime.checkpoint import load_checkpoint, save_checkpoint
from autoprec.runtime.monitor import Monitor
from autoprec.runtime.scaler import DynamicLossScaler

__all__ = [
    "__version__", "capture", "apply", "tune", "TuneResult", "Policy", "Rule", "LossScalingConfig",
    "MixedPrecisionModule", "DynamicLossScaler", "Monitor",
    "save_checkpoint", "load_checkpoint", "AutoprecError", "CaptureError", "LossScaleError",
    "ModelSpecError", "PassError", "PolicyError", "SearchError",
]


def __getattr__(name: str) -> Any:
    # The search pulls in Optuna; import it only when asked for.
    if name in ("tune", "TuneResult"):
        from autoprec.search import study

        return getattr(study, name)
    raise AttributeError(f"module 'autoprec' has no attribute {name!r}")
