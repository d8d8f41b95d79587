"""autoprec: a compiler-pass based mixed-precision autotuner for PyTorch training.

Public API (docs/architecture.md#public-api)::

    import autoprec
    gm = autoprec.capture(model, example_batch)
    policy = autoprec.Policy.default(low="bf16")
    mp = autoprec.apply(model, policy, example_batch, compile=True)
    scaler = autoprec.make_scaler(policy)      # a DynamicLossScaler for fp16 policies, else None
    module = autoprec.ddp(mp)                  # or autoprec.shard(mp): DDP / FSDP2 over ranks
    result = autoprec.tune("model.py")

The reference of every name here is docs/api.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autoprec._version import __version__
from autoprec.applied.apply import MixedPrecisionModule, apply
from autoprec.capture import capture
from autoprec.distributed.wrap import ddp, shard
from autoprec.errors import (
    AutoprecError,
    CaptureError,
    LossScaleError,
    ModelSpecError,
    PassError,
    PolicyError,
    SearchError,
    ShapeLimitError,
)
from autoprec.policy import LossScalingConfig, Policy, Rule
from autoprec.training.checkpoint import load_checkpoint, save_checkpoint
from autoprec.training.monitor import Monitor
from autoprec.training.scaler import DynamicLossScaler
from autoprec.training.train import make_scaler

if TYPE_CHECKING:  # imported on first use (below); named here for type checkers and the API reference
    from autoprec.search.study import TuneResult, tune

__all__ = [
    "__version__", "capture", "apply", "tune", "TuneResult", "Policy", "Rule", "LossScalingConfig",
    "MixedPrecisionModule", "DynamicLossScaler", "make_scaler", "Monitor", "ddp", "shard",
    "save_checkpoint", "load_checkpoint", "AutoprecError", "CaptureError", "LossScaleError",
    "ModelSpecError", "PassError", "PolicyError", "SearchError", "ShapeLimitError",
]


def __getattr__(name: str) -> Any:
    # The search pulls in Optuna; import it only when asked for.
    if name in ("tune", "TuneResult"):
        from autoprec.search import study

        return getattr(study, name)
    raise AttributeError(f"module 'autoprec' has no attribute {name!r}")
