"""The refusal of an fp16 policy trained without loss scaling (case C07; docs/architecture.md#runtime).

A policy that computes in fp16 needs its loss scaled before backward (``policy.needs_loss_scaling``):
fp16 gradients below 2^-24 (6e-8) flush to zero, and training stalls without a word. autoprec's own
training paths scale it (``TrainStep`` with ``make_scaler``, ``AutoprecTrainer``, the Lightning
plugin, ``autoprec train``); a module handed to a stock trainer, or a loop that forgets the scaler,
does not. The loss the module outputs tells the two apart in backward: the gradient flowing into it
is the loss scale (``d(scale * loss) / d(loss)``; 2^16 to start by default, ``DynamicLossScaler``),
and 1 (or ``1 / accumulation steps``) when nothing scaled it.
"""

from __future__ import annotations

from typing import Any

import torch

from autoprec.errors import ModelSpecError
from autoprec.modelspec import default_loss_fn, scalar_items
from autoprec.policy import Policy

__all__ = ["UnscaledBackwardCheck"]


class UnscaledBackwardCheck:
    """Called with each training-mode output of an applied module: until one backward has passed
    through the output's loss, it hooks the loss (``output.loss``, a ``"loss"`` key, or a
    one-element output: :func:`autoprec.modelspec.default_loss_fn`'s rule; for a tuple or list output,
    each one-element floating item, :func:`autoprec.modelspec.scalar_items`: Hugging Face's
    ``return_dict=False`` puts the loss first), and the hook raises when
    the gradient arriving there is at most 1 in magnitude: nothing scaled the loss. One check per
    module, on its first backward: a scaler's first scale is its initial one (far above 1), so a
    later back-off to a small scale after overflows is never taken for a missing scaler.

    A policy without fp16 (``needs_loss_scaling`` False), a call under ``torch.no_grad``, or an output
    without a loss (logits only: the loss is computed outside, where its scaling cannot be seen) is
    not checked.

    Args:
        policy: The applied policy.
        what: How error messages name the module (``MixedPrecisionModule.what``).
    """

    def __init__(self, policy: Policy, what: str) -> None:
        self.pending, self.what = policy.needs_loss_scaling, what

    def __call__(self, output: Any) -> None:
        """Hook the loss of ``output`` while no backward has been checked (see the class)."""
        if not self.pending or not torch.is_grad_enabled():
            return
        try:
            losses = [default_loss_fn(output, None)]
        except ModelSpecError:  # a tuple (HF return_dict=False: (loss, logits)): its scalar items
            losses = scalar_items(output)
        for loss in losses:
            if loss.requires_grad:
                loss.register_hook(self._check)

    def _check(self, grad: torch.Tensor) -> None:
        """The hook: raise ``ValueError`` when ``grad`` (d(what backward started from) / d(loss)) is at
        most 1 in magnitude."""
        if not self.pending:
            return
        self.pending = False
        g = float(grad.detach().abs().max())
        if g <= 1.0:
            raise ValueError(
                f"{self.what}: its policy computes in fp16, and backward reached its loss unscaled "
                f"(d/d loss = {g:.3g}): fp16 gradients below 6e-8 flush to zero and training stalls "
                "silently (case C07). Scale the loss: scaler = autoprec.make_scaler(mp.policy), then "
                "scaler.scale(loss).backward(), scaler.step(optimizer), scaler.update(); with Hugging "
                "Face use autoprec.integrations.transformers.AutoprecTrainer, with Lightning "
                "autoprec.integrations.lightning.AutoprecPrecision (docs/integrations.md)")
