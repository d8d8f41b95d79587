"""Drift against FP32 over K batches (docs/architecture.md#measurements): the FP32 reference
gradients cached per batch, one candidate's per-batch ``grad_rel_l2`` / ``loss_rel`` / SQNR, and
the loss-scale back-off of training's first steps.

:class:`autoprec.measure.harness.Harness` runs the forward/backward passes (its ``_grads``) and
hands them to :func:`measure_drift`; this module only decides what is run on which batch and
how the per-batch numbers are formed. One drift measurement is K = :data:`DRIFT_BATCHES`
forward/backward passes of the candidate (plus back-offs), each on its own batch and each from
the same RNG state as that batch's reference (:func:`autoprec.training.rng.same_rng`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from autoprec._torch_compat import amp_unscale_, is_dynamo_optimized
from autoprec.applied.compile import CompiledGraph
from autoprec.measure.backoff import search_back_off
from autoprec.measure.measurement import Measurement
from autoprec.metrics import grad_errors, grad_rel_l2, grad_sqnr_db_min
from autoprec.training.scaler import DynamicLossScaler

__all__ = ["DRIFT_BATCHES", "MAX_BACKOFFS", "BatchDrift", "Drift", "References", "as_measurement",
           "batch_drift", "is_compiled", "measure_drift", "take_grads"]

#: One forward/backward's ``(loss, unscaled gradients, saved bytes)`` (:func:`measure_drift`'s ``step``).
_Pass = tuple[float, list[torch.Tensor], int]

#: K, the batches ``get_batch(0..K-1)`` every drift measurement runs on (``Harness(...,
#: drift_batches=K)`` overrides it). Four gives the paired t-test of
#: :class:`autoprec.search.drift_budget.DriftBudget` three degrees of freedom (t₀.₉₅ = 2.353) for four
#: forward/backward passes a trial, where one batch alone could not tell a policy from noise.
DRIFT_BATCHES = 4
#: Loss-scale backoffs a drift measurement tries per batch (2^16, the default, halves to 1 in 16).
MAX_BACKOFFS = 24

#: A forward/backward's (loss, fp32 unscaled gradients, one per trainable parameter).
Grads = tuple[float, list[torch.Tensor]]


class References:
    """FP32 reference losses and gradients, each computed once per (reference kind, batch index).

    Kinds are ``"eager"`` (the captured FP32 graph) and ``"compiled:<id>"`` (that graph compiled, for
    compiled candidates of graphs with random ops: ``Harness.reference_fn``). Memory: one fp32
    gradient set (4 bytes per parameter) per cached (kind, batch), i.e. 4·K·P bytes eagerly.
    """

    def __init__(self) -> None:
        self._store: dict[tuple[str, int], Grads] = {}

    def get(self, kind: str, batch: int, compute: Callable[[], Grads]) -> Grads:
        """The cached ``(loss, grads)`` of ``(kind, batch)``, calling ``compute()`` the first time.

        Raises:
            Exception: whatever ``compute`` raises (nothing is cached then).
        """
        key = (kind, batch)
        if key not in self._store:
            self._store[key] = compute()
        return self._store[key]


@dataclass
class BatchDrift:
    """A candidate's drift on one batch (docs/architecture.md#measurements; all dimensionless).

    Attributes:
        grad_rel_l2: ‖g − g₃₂‖₂/‖g₃₂‖₂ (:func:`autoprec.metrics.grad_rel_l2`); inf if non-finite.
        loss_rel: |L − L₃₂| / |L₃₂| (denominator floored at 1e-30); inf if the loss is non-finite.
        grad_sqnr_db_min: min per-parameter SQNR in dB (:func:`autoprec.metrics.grad_sqnr_db_min`).
    """

    grad_rel_l2: float
    loss_rel: float
    grad_sqnr_db_min: float

    @property
    def finite(self) -> bool:
        """Both ``grad_rel_l2`` and ``loss_rel`` are finite."""
        return math.isfinite(self.grad_rel_l2) and math.isfinite(self.loss_rel)


@dataclass
class Drift:
    """What :func:`measure_drift` measured.

    Attributes:
        batches: One :class:`BatchDrift` per batch measured, in batch order: K of them, or fewer
            when a batch stayed non-finite (measuring stops there; it is the last one).
        backoffs: Loss-scale backoffs over all batches (the scale carries over from batch to batch).
        first_backoffs: Those of batch 0, from the scaler's initial scale (the next measurement's
            ``backoff_hint``: later batches start from batch 0's scale and back off little or not).
        saved_bytes: Bytes saved for backward in batch 0's (last) pass, as ``step`` counted them.
        stopped: ``measure_drift``'s ``stop`` ended the measurement before the last batch.
        unmeasured: The batch whose gradients overflowed at the current loss scale when ``stop``
            ended the measurement before its back-off search (its pass was run and timed, its
            drift is not in ``batches``); None otherwise.
    """

    batches: list[BatchDrift] = field(default_factory=list)
    backoffs: int = 0
    first_backoffs: int = 0
    saved_bytes: int = 0
    stopped: bool = False
    unmeasured: int | None = None

    @property
    def finite(self) -> bool:
        """Every batch measured is finite (and at least one was)."""
        return bool(self.batches) and all(b.finite for b in self.batches)


def batch_drift(loss: float, grads: list[torch.Tensor], ref_loss: float,
                ref_grads: list[torch.Tensor]) -> BatchDrift:
    """One batch's :class:`BatchDrift` of ``(loss, grads)`` against the FP32 ``(ref_loss, ref_grads)``.

    Args:
        loss: The candidate's loss (a Python float, may be non-finite).
        grads: Its unscaled gradients, any float dtype, same shapes as ``ref_grads``.
        ref_loss, ref_grads: The FP32 reference on the same batch, weights and RNG state.
    """
    errors = grad_errors(grads, ref_grads)  # one fp64 pass and one sync for both metrics
    g = grad_rel_l2(grads, ref_grads, errors)
    loss_rel = abs(loss - ref_loss) / max(abs(ref_loss), 1e-30) if math.isfinite(loss) else math.inf
    sqnr = grad_sqnr_db_min(grads, ref_grads, errors)
    return BatchDrift(g if math.isfinite(loss_rel) else math.inf, loss_rel, sqnr)


def measure_drift(step: Callable[[int, bool], tuple[float, list[torch.Tensor], int]], refs: list[Grads],
                  scaler: DynamicLossScaler | None, backoff_hint: int = 1,
                  stop: Callable[[Drift], bool] | None = None) -> Drift:
    """A candidate's drift on batches ``0..len(refs)-1`` against the per-batch FP32 references.

    ``step(k, count)`` runs the candidate's forward/backward on batch k from the weights the
    harness restores and the batch's fixed RNG state and returns ``(loss, unscaled gradients,
    saved bytes)`` (bytes counted only when ``count``, i.e. on batch 0; else 0). The gradients
    of one batch are dropped once its scalars are taken, so at most one candidate gradient set is
    alive at a time.

    With a dynamic loss scaler, scaled gradients that overflow are what training's first steps skip
    while the scale backs off (``torch.amp.GradScaler``'s rule): the batch is measured at the scale
    where that back-off stops (at most :data:`MAX_BACKOFFS` back-offs, found by an exponential
    search, on batch 0 from ``backoff_hint`` back-offs (the previous measurement's
    ``first_backoffs``; its first pass one back-off short of them: :func:`_first_pass`), on later
    batches from one: :func:`autoprec.measure.backoff.search_back_off`); only gradients non-finite
    at the scaler's floor count as a failure, and measuring stops at that batch. A non-finite loss
    is a failure at once: the scale multiplies the loss after the forward, so no back-off can
    change it.

    ``stop(drift so far)``, when given, is asked after each finite batch but the last, and before
    each back-off search (with ``unmeasured`` set to the overflowing batch, whose pass is timed:
    the search costs about ``2·log2(back-offs + 1)`` forward/backward passes, which a trial cut
    for its speed need not run); True ends the measurement there (``stopped``), as a search
    trial's screening cut does.

    Raises:
        Exception: whatever ``step`` raises (compile errors, out of memory).
    """
    out = Drift()
    for k, (ref_loss, ref_grads) in enumerate(refs):
        first, over = _first_pass(step, scaler, backoff_hint) if k == 0 else (step(k, False), 0)
        if k == 0:
            out.saved_bytes = first[2]
        if scaler is not None and math.isfinite(first[0]) and not _finite(first[0], first[1]):
            out.unmeasured = k
            if stop is not None and stop(out):
                out.stopped = True
                break
            out.unmeasured = None
            first, tries = search_back_off(
                scaler, lambda k=k: step(k, k == 0), lambda r: _finite(r[0], r[1]), first,
                MAX_BACKOFFS, hint=backoff_hint if k == 0 else 1, overflowed=over)  # later: batch 0's scale
            out.backoffs += tries
            if k == 0:
                out.first_backoffs = tries
        loss, grads, nbytes = first
        if k == 0:
            out.saved_bytes = nbytes  # the pass at the scale the back-off stopped at
        out.batches.append(batch_drift(loss, grads, ref_loss, ref_grads))
        del grads, first  # keep only the scalars
        if not out.batches[-1].finite:
            break
        if stop is not None and k < len(refs) - 1 and stop(out):
            out.stopped = True
            break
    return out


def _first_pass(step: Callable[[int, bool], _Pass], scaler: DynamicLossScaler | None,
                hint: int) -> tuple[_Pass, int]:
    """Batch 0's first pass and its scale's back-offs: at the scaler's scale, or, where the hint
    says 2 or more back-offs, one back-off short of the hint (the scaler's state restored after).
    Overflowing there, the pass stands for the scaler's own scale, which overflows too (overflow
    grows with the scale), and the search starts past it: the hint's pass settles it, 2 passes
    where 3 were run (a 24-layer Qwen2's fp16 trials back off 4 times each). Finite there, the
    policy backs off less than the hint: that pass is spent and batch 0 runs at the scaler's scale."""
    scales = scaler.back_off_scales(MAX_BACKOFFS) if scaler is not None and hint >= 2 else []
    over = min(hint - 1, len(scales) - 2)
    if over < 1:
        return step(0, True), 0
    state = scaler.state_dict()
    scaler.load_state_dict({**state, "scale": scales[over]})
    try:
        first = step(0, True)
    finally:
        scaler.load_state_dict(state)
    if not math.isfinite(first[0]) or not _finite(first[0], first[1]):
        return first, over  # a non-finite loss fails whatever the scale
    del first
    return step(0, True), 0


def as_measurement(d: Drift, seconds: dict[int, float], scaler: DynamicLossScaler | None,
                   state_bytes: int) -> Measurement:
    """The :class:`Measurement` of the batches ``d`` holds (all of them, or those run so far):
    per-batch ``grad_rel_l2`` and their mean, mean ``loss_rel``, min SQNR, ``peak_bytes`` (batch
    0's saved bytes + ``state_bytes``), ``pass_times`` from ``seconds`` (batch -> forward+backward
    seconds), a ``note`` counting loss-scale back-offs, and ``error`` when a batch was non-finite
    (``"non-finite loss (drift batch k)"``, or ``gradients`` when the loss was finite).

    With ``d.unmeasured`` set (stopped before a back-off search), the drift fields hold the
    batches before it (none: ``grad_rel_l2`` and ``loss_rel`` inf, as :class:`Measurement`'s
    defaults), ``pass_times`` its overflowing pass too, ``note`` says so, and ``error`` stays None."""
    m = Measurement(pass_times=[seconds[k] for k in sorted(seconds)])
    if d.backoffs:
        m.note = (f"{d.backoffs} loss-scale backoff{'s' if d.backoffs > 1 else ''} before finite "
                  f"gradients (scale {scaler.get_scale():g}), as training skips its first steps")
    if d.unmeasured is not None:
        m.note = (f"{m.note}; " if m.note else "") + (
                  f"gradients overflowed at loss scale {scaler.get_scale():g} on drift batch "
                  f"{d.unmeasured}; stopped before the loss-scale back-off, so "
                  + (f"drift is of batches 0-{d.unmeasured - 1} only" if d.batches
                     else "drift is not measured"))
    m.grad_rel_l2_batches = [b.grad_rel_l2 for b in d.batches]
    if d.batches:
        m.grad_rel_l2 = sum(m.grad_rel_l2_batches) / len(d.batches)
        m.loss_rel = sum(b.loss_rel for b in d.batches) / len(d.batches)
        m.grad_sqnr_db_min = min(b.grad_sqnr_db_min for b in d.batches)
    m.peak_bytes = d.saved_bytes + state_bytes
    if not d.finite and d.unmeasured is None:
        m.grad_rel_l2 = math.inf
        what = "loss" if not math.isfinite(d.batches[-1].loss_rel) else "gradients"
        m.fail(f"non-finite {what} (drift batch {len(d.batches) - 1})")
    return m


def take_grads(params: list[torch.Tensor], scale: float) -> list[torch.Tensor]:
    """The gradients of a forward/backward without an optimizer step, unscaled (``grad · (1/scale)``,
    in fp32), zeros where a parameter got none; each parameter's ``grad`` is dropped. An fp32
    gradient at scale 1 is taken as it is, not copied: the weights are not touched by such a pass,
    so only the gradients need clearing (a 24-layer Qwen2 has 17.6M parameters: a copy of its
    gradients and a restore of its weights took 8 and 7 ms of each 0.5 s pass on one core)."""
    out = []
    for p in params:
        g = p.grad
        if g is None:
            out.append(torch.zeros_like(p))
        else:
            out.append(g if scale == 1.0 and g.dtype == torch.float32 else g.float() * (1.0 / scale))
        p.grad = None
    return out


def is_compiled(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` runs through ``torch.compile``: a
    :class:`~autoprec.applied.compile.CompiledGraph` (what ``compile_graph`` returns), or what
    ``torch.compile`` itself returned (an ``OptimizedModule``:
    :func:`autoprec._torch_compat.is_dynamo_optimized`)."""
    return isinstance(fn, CompiledGraph) or is_dynamo_optimized(fn)


def _finite(loss: float, grads: list[torch.Tensor]) -> bool:
    """Whether ``loss`` and every one of ``grads`` (``Harness._grads``'s fresh tensors) is finite,
    in one fused pass and one sync per device and dtype: GradScaler's check
    (:func:`autoprec._torch_compat.amp_unscale_` with an unscale factor of 1.0, which leaves the
    values as they are). A check per tensor cost 80 ms of a 24-layer Qwen2's 0.5 s pass on one core
    (220 synchronising ``isfinite(g).all()``); the fused one 7 ms."""
    if not math.isfinite(loss):
        return False
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:  # the fused check takes one device and dtype, as GradScaler groups them
        groups.setdefault((g.device, g.dtype), []).append(g)
    found = [torch.zeros(1, device=dev) for dev, _dtype in groups]
    for f, ((dev, _dtype), group) in zip(found, groups.items(), strict=True):
        amp_unscale_(group, f, torch.ones(1, device=dev))
    return not any(bool(f.item()) for f in found)
