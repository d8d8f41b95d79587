"""The MFU of ``autoprec bench``'s rows (docs/architecture.md#measurements).

MFU counts model FLOPs per step as ``6 · N · tokens`` (N: trainable parameters except embedding
tables, whose forward is a gather, not a matmul; Kaplan et al. 2020, PaLM appendix B) plus
attention ``12 · layers · seq · hidden · tokens`` (QKᵀ and AV, forward + backward, full
non-causal count as in PaLM), read from ``model.config`` when the model has one; it divides
FLOP/s by the device's matmul peak measured in the same run with a large square matmul in the
row's dtype (fp32 rows against fp32's peak, the torch.autocast and pure low-precision rows
against the low dtype's, a policy's rows against its main dtype's: the dtype most of its matmuls
run in), and never below fp32's peak (:func:`row_peak`: a device that emulates the low dtype
computes the same FLOPs at fp32's rate, so fp32's is the peak it offers that work; one peak for
every row gave an fp32 row 970% MFU against the emulated bf16 peak of an AVX2-only CPU), measured
before and again after the configurations (the higher of the two counts: a busy moment on a
shared machine understates it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from autoprec.device import time_matmul
from autoprec.dtypes import to_torch

__all__ = ["matmul_peak_flops", "measure_peaks", "model_flops", "remeasure_peaks", "row_peak"]


def matmul_peak_flops(dtype: torch.dtype, device: torch.device, max_n: int | None = None,
                      target_s: float = 0.25, reps: int = 3) -> tuple[float, int]:
    """Measured matmul peak: the best FLOP/s of square ``n×n @ n×n`` matmuls, growing ``n``.

    ``n`` doubles from 512 until one matmul takes ``target_s`` or ``n`` reaches ``max_n``
    (default 8192 on CUDA, 2048 on CPU), so a dtype the device emulates slowly costs little.

    Args:
        dtype: Element dtype of both operands (the output is the same dtype).
        device: Where to run.
        max_n: Largest matrix size tried.
        target_s: Stop growing once one matmul takes at least this many seconds.
        reps: Timed repetitions per size after one warm-up; the fastest counts.

    Returns:
        ``(flops_per_s, n)``: the best rate (2·n³ FLOPs per matmul) and the size that reached it.
    """
    max_n = max_n or (8192 if device.type == "cuda" else 2048)
    best, best_n, n = 0.0, 0, 512
    while n <= max_n:
        dt = min(time_matmul(dtype, device, n, reps, 4 * target_s))  # emulated dtype: stops early
        if 2 * n**3 / dt > best:
            best, best_n = 2 * n**3 / dt, n
        if dt >= target_s:
            break
        n *= 2
    return best, best_n


def model_flops(model: nn.Module, batch: Any, tokens: int) -> dict[str, Any]:
    """Training FLOPs per step: ``6·N·tokens`` plus attention ``12·layers·seq·hidden·tokens``.

    Args:
        model: The fp32 model (``model.config`` with ``num_hidden_layers`` and ``hidden_size``
            enables the attention term).
        batch: One batch (``input_ids`` or the first tensor gives the sequence length, last dim).
        tokens: Tokens per batch.

    Returns:
        ``{"flops_per_step", "params_matmul", "params_embedding", "layers", "seq", "hidden",
        "formula"}`` (FLOPs, counts).
    """
    emb = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    params = [p for p in model.parameters() if p.requires_grad]
    n_emb = sum(p.numel() for p in params if id(p) in emb)
    n_mm = sum(p.numel() for p in params) - n_emb
    cfg = getattr(model, "config", None)
    layers = int(getattr(cfg, "num_hidden_layers", 0) or 0)
    hidden = int(getattr(cfg, "hidden_size", 0) or 0)
    x = (batch.get("input_ids") if isinstance(batch, dict)
         else batch[0] if isinstance(batch, (tuple, list)) else batch)
    seq = int(x.shape[-1]) if isinstance(x, torch.Tensor) and x.dim() >= 1 else 0
    flops = 6 * n_mm * tokens + 12 * layers * seq * hidden * tokens
    return {"flops_per_step": float(flops), "params_matmul": n_mm, "params_embedding": n_emb,
            "layers": layers, "seq": seq, "hidden": hidden,
            "formula": "6*params_matmul*tokens + 12*layers*seq*hidden*tokens"}


def measure_peaks(dtypes: Sequence[str], dev: torch.device, log: Callable[[str], None]) -> dict[str, float]:
    """The matmul peak (FLOP/s, :func:`matmul_peak_flops`) of each distinct dtype name, logged."""
    peaks = {}
    for dn in dict.fromkeys(dtypes):
        peaks[dn], n = matmul_peak_flops(to_torch(dn), dev)
        log(f"matmul peak {dn}: {peaks[dn] / 1e12:.3f} TFLOP/s (n={n})")
    return peaks


def remeasure_peaks(result: dict[str, Any], dev: torch.device, log: Callable[[str], None]) -> None:
    """Measure the matmul peaks again after the configurations and keep the higher value.

    On a shared machine one measurement can catch a busy moment and understate the peak (MFU
    then overstates); the best of two, before and after, is the better estimate of the peak.
    MFU of every row is recomputed against its dtype's.
    """
    mp = result["matmul_peak"]
    mp["before_run"] = dict(mp["by_dtype"])
    mp["after_run"] = {dn: matmul_peak_flops(to_torch(dn), dev)[0] for dn in mp["by_dtype"]}
    mp["by_dtype"] = {dn: max(mp["before_run"][dn], mp["after_run"][dn]) for dn in mp["by_dtype"]}
    old, mp["flops_per_s"] = mp["flops_per_s"], mp["by_dtype"][mp["dtype"]]
    log(f"matmul peak {mp['dtype']} re-measured: {mp['after_run'][mp['dtype']] / 1e12:.3f} TFLOP/s "
        f"(before {old / 1e12:.3f}); MFU uses the higher")
    for r in result["configs"].values():
        if r.get("mfu") is not None and row_peak(mp, r["dtype"]) > 0:
            r["mfu"] = r["mfu"] * row_peak(mp, r["dtype"], "before_run") / row_peak(mp, r["dtype"])


def row_peak(mp: dict[str, Any], dtype: str, which: str = "by_dtype") -> float:
    """The matmul peak (FLOP/s) a row in ``dtype`` divides its FLOP/s by for MFU: its dtype's
    measured peak (the main dtype's when ``dtype`` was not measured), or fp32's if that is higher
    (a device that emulates the low dtype runs the same GEMMs with fp32 compute at fp32's rate;
    autoprec's fp32-compute kernels do).

    Args:
        mp: The result's ``matmul_peak`` (``by_dtype``, ``before_run``: dtype name -> FLOP/s).
        dtype: The row's dtype name (``"fp32"``, ``"bf16"``, ...).
        which: Which peaks of ``mp``: ``"by_dtype"`` (the higher of before and after the run) or
            ``"before_run"``.
    """
    peaks = mp[which]
    return max(peaks.get(dtype, peaks.get(mp["dtype"], 0.0)), peaks.get("fp32", 0.0))
