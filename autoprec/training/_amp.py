"""GradScaler's kernels in Python: the scale update rule, the fused unscale, the gradient norm.

Helpers of :class:`autoprec.training.scaler.DynamicLossScaler` (``docs/architecture.md#runtime``).

Sources:
    * ``torch.amp.GradScaler`` (torch/amp/grad_scaler.py) and its ATen kernels
      ``_amp_foreach_non_finite_check_and_unscale_`` / ``_amp_update_scale_`` (the fused unscale is
      called through :func:`autoprec._torch_compat.amp_unscale_`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import torch

from autoprec._torch_compat import amp_unscale_, sparse_values
from autoprec.policy.loss_scaling import to_fp32

__all__ = ["amp_update_scale", "unscale_grads_", "unscaled_grad_norm"]


def amp_update_scale(scale: float, tracker: int, found_inf: bool, growth_factor: float,
                      backoff_factor: float, growth_interval: int) -> tuple[float, int]:
    """One step of GradScaler's ATen kernel ``_amp_update_scale_``, bit for bit.

    The kernel multiplies the float32 scale by the (double) factor in double precision and rounds the
    product to float32; a growth that would overflow float32 to ``inf`` is dropped (the scale is kept)
    but still resets the tracker.
    """
    if found_inf:
        return to_fp32(scale * backoff_factor), 0
    tracker += 1
    if tracker == growth_interval:
        grown = to_fp32(scale * growth_factor)
        return (grown if math.isfinite(grown) else scale), 0
    return scale, tracker


def grads_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The dense gradient tensors of every parameter in ``optimizer.param_groups`` (coalesced if sparse)."""
    grads = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is None:
                continue
            if param.grad.is_sparse:
                if not param.grad.is_coalesced():
                    param.grad = param.grad.coalesce()  # duplicates are summed before the check
                grads.append(sparse_values(param.grad))
            else:
                grads.append(param.grad)
    return grads


def unscale_grads_(optimizer: torch.optim.Optimizer, inv_scale: float) -> bool:
    """Multiplies every gradient by ``inv_scale`` in place (computed in fp32); True if any is inf/NaN."""
    by_device_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for grad in grads_of(optimizer):
        by_device_dtype[(grad.device, grad.dtype)].append(grad)
    found = []
    with torch.no_grad():
        for (device, _), grads in by_device_dtype.items():
            found_inf = torch.zeros((), dtype=torch.float32, device=device)
            inv = torch.full((), inv_scale, dtype=torch.float32, device=device)
            # GradScaler's fused kernel: flags non-finite values, then grad = float(grad) * inv.
            amp_unscale_(grads, found_inf, inv)
            found.append(found_inf)
    return any(bool(f.item()) for f in found)


def unscaled_grad_norm(parameters: torch.Tensor | Iterable[torch.Tensor]) -> float:
    """Total L2 norm of the parameters' gradients, computed in fp32; ``inf`` if any is inf/NaN.

    Call it after ``DynamicLossScaler.unscale_`` so the norm is that of the true gradients (as
    ``torch.nn.utils.clip_grad_norm_`` would see them). Parameters without a gradient are ignored.

    Args:
        parameters: A tensor or an iterable of tensors (e.g. ``model.parameters()``).

    Returns:
        ``sqrt(sum_i ||grad_i||_2^2)`` as a Python float (0.0 if no parameter has a gradient);
        ``math.inf`` if any gradient element is non-finite (or the fp32 norm overflows).
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    norms = []
    for p in parameters:
        grad = p.grad
        if grad is None:
            continue
        if grad.is_sparse:
            grad = sparse_values(grad.coalesce())
        norms.append(torch.linalg.vector_norm(grad.detach(), 2, dtype=torch.float32))
    if not norms:
        return 0.0
    device = norms[0].device
    total = float(torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), 2))
    return total if math.isfinite(total) else math.inf
