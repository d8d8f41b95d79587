"""Drift and timing statistics: how far a run is from its FP32 reference, and the median rule.

Definitions (docs/architecture.md, "Measurements"): ``grad_rel_l2``, ``grad_sqnr_db_min``,
``traj_rel``; :func:`median` is the one median of step times used everywhere.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import torch

__all__ = ["grad_errors", "grad_rel_l2", "grad_sqnr_db_min", "median", "traj_rel"]


def grad_errors(grads: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[list[float], list[float]]:
    """Per parameter, ‖g − g₃₂‖₂² and ‖g₃₂‖₂², computed in fp64 with one device sync.

    Args:
        grads: Gradients (any float dtype), same shapes as ``ref``.
        ref: FP32 reference gradients.

    Returns:
        ``(errors, signals)``: two lists of floats, one entry per parameter (non-finite where
        ``g`` is).
    """
    err: list[torch.Tensor] = []
    sig: list[torch.Tensor] = []
    for g, r in zip(grads, ref, strict=True):
        rd = r.double()
        d = g.double() - rd
        err.append((d * d).sum())
        sig.append((rd * rd).sum())
    if not err:
        return [], []
    both = torch.stack(err + sig).tolist()
    return both[:len(err)], both[len(err):]


def grad_rel_l2(grads: list[torch.Tensor], ref: list[torch.Tensor],
                errors: tuple[list[float], list[float]] | None = None) -> float:
    """‖g − g₃₂‖₂ / ‖g₃₂‖₂ over all gradients concatenated (docs/architecture.md#measurements); inf if
    non-finite.

    Args:
        grads: Gradients (any float dtype; compared in fp64), same shapes as ``ref``.
        ref: FP32 reference gradients.
        errors: :func:`grad_errors` of the two, when already computed.
    """
    err, sig = errors if errors is not None else grad_errors(grads, ref)
    num = math.fsum(err)
    if not math.isfinite(num):
        return math.inf
    return math.sqrt(num) / max(math.sqrt(math.fsum(sig)), 1e-300)


def grad_sqnr_db_min(grads: list[torch.Tensor], ref: list[torch.Tensor],
                     errors: tuple[list[float], list[float]] | None = None) -> float:
    """min over parameters of 20·log₁₀(‖g₃₂‖/‖g − g₃₂‖) in dB (torchao's SQNR); −inf if non-finite.
    ``errors``: :func:`grad_errors` of the two, when already computed."""
    err, sig = errors if errors is not None else grad_errors(grads, ref)
    worst = math.inf
    for e, s in zip(err, sig, strict=True):
        if not math.isfinite(e):
            return -math.inf
        if e == 0.0 or s == 0.0:
            continue
        worst = min(worst, 10.0 * math.log10(s / e))  # 20·log10 of the norms' ratio
    return worst


def traj_rel(losses: list[float], ref: list[float]) -> float:
    """max over steps k of |L_k − L32_k| / |L32_k| (docs/architecture.md#measurements); inf if any loss is
    non-finite.

    Also the "max relative deviation from the FP32 curve" of ``autoprec train --compare``.
    """
    worst = 0.0
    for a, b in zip(losses, ref, strict=True):
        if not (math.isfinite(a) and math.isfinite(b)):
            return math.inf
        worst = max(worst, abs(a - b) / max(abs(b), 1e-30))
    return worst


def median(values: Sequence[float]) -> float:
    """The median of ``values``: for an even count the upper of the two middle values
    (``statistics.median_high``), so the median is always a step time that was measured.

    The one rule for step times (seconds) and throughputs (tokens/s) in ``tune``, ``bench``,
    ``train``, ``train --compare`` and the probe.

    Raises:
        statistics.StatisticsError: ``values`` is empty.
    """
    return statistics.median_high(values)
