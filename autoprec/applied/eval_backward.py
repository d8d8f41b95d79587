"""A backward through an applied module called in eval mode (docs/architecture.md#runtime).

In eval mode a call is the model's own fp32 forward (``MixedPrecisionModule.forward``), so a
backward through it trains without the policy, eagerly and uncompiled: a user who switches to eval
mode to train without dropout (policy updates in PPO/RLHF loops, fine-tuning with dropout off)
believed the tuned policy was in effect. :class:`EvalBackwardCheck` warns once when it happens.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from autoprec.modelspec import grad_leaves

__all__ = ["EvalBackwardCheck"]


class EvalBackwardCheck:
    """Called with each eval-mode output of an applied module: while grad mode is on, it hooks the
    output's first floating tensor that requires grad, and the hook warns (``UserWarning``, once per
    module) when a backward reaches it. Evaluation under ``torch.no_grad`` (HF ``Trainer.evaluate``,
    Lightning's validation) is not hooked.

    Args:
        what: How the message names the module (``MixedPrecisionModule.what``).
    """

    def __init__(self, what: str) -> None:
        self.what, self.warned = what, False

    def __call__(self, output: Any) -> None:
        """Hook ``output`` (see the class)."""
        if self.warned or not torch.is_grad_enabled():
            return
        if leaves := grad_leaves(output):
            leaves[0].register_hook(self._warn)

    def _warn(self, grad: torch.Tensor) -> None:
        if not self.warned:
            self.warned = True
            warnings.warn(f"{self.what}: backward through a call in eval mode, which is the model's own fp32 "
                          "forward, not the policy's graph: these gradients are trained without the policy. "
                          "Train in training mode (mp.train()); to train without dropout, set the model's "
                          "dropout probabilities to 0 (its config's *_dropout) and apply the policy then",
                          stacklevel=2)
