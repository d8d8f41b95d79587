"""Drift and timing statistics: how far a run is from its FP32 reference, and the median rule.

Definitions (docs/architecture.md, "Measurements"): ``grad_rel_l2``, ``grad_sqnr_db_min``,
``traj_rel``; :func:`median` is the one median of step times used everywhere.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import torch

__all__ = ["grad_errors", "grad_rel_l2", "grad_sqnr_db_min", "median", "t95", "t975", "traj_rel"]

#: One-sided 95% quantiles t_{0.95, ν} of Student's t distribution for ν = 1..30 degrees of freedom
#: (standard tables, e.g. NIST/SEMATECH e-Handbook of Statistical Methods §1.3.6.7.2, 3 decimals;
#: scipy is not a dependency). Beyond 30 the normal quantile 1.645 is used.
_T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812,
        1.796, 1.782, 1.771, 1.761, 1.753, 1.746, 1.740, 1.734, 1.729, 1.725,
        1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697)
_Z95 = 1.645
#: The 97.5% quantiles t_{0.975, ν} (two-sided 95%), same table and source; 1.960 beyond 30.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
         2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
         2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
_Z975 = 1.960


def t95(df: int) -> float:
    """The one-sided 95% quantile of Student's t with ``df`` ≥ 1 degrees of freedom (:data:`_T95`;
    1.645, the normal's, beyond 30).

    Raises:
        ValueError: ``df`` < 1.
    """
    if df < 1:
        raise ValueError(f"t quantile needs df >= 1, got {df}")
    return _T95[df - 1] if df <= len(_T95) else _Z95


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with ``df`` ≥ 1 degrees of freedom, the half-width factor
    of a two-sided 95% interval (:data:`_T975`; 1.960 beyond 30).

    Raises:
        ValueError: ``df`` < 1.
    """
    if df < 1:
        raise ValueError(f"t quantile needs df >= 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else _Z975


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
