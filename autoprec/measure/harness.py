"""Measurements (docs/architecture.md#measurements): training-step throughput, drift against FP32, memory.

One :class:`Harness` holds the model, its captured graph, a snapshot of the initial weights and the FP32
reference gradients; every configuration (FP32, torch.autocast, a policy, eager or compiled) is measured
on the same weights and batches, restored after each (``autoprec tune`` and ``autoprec bench`` alike).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from autoprec.applied.compile import CompiledGraph, compile_graph
from autoprec.capture import PROBE_BATCHES, batch_shapes, capture_for, warmup_steps
from autoprec.device import sync
from autoprec.kernels.fp32_gemms import Fp32ComputeGemms
from autoprec.measure import screening
from autoprec.measure.drift import (
    DRIFT_BATCHES,
    Drift,
    Grads,
    References,
    as_measurement,
    is_compiled,
    measure_drift,
    take_grads,
)
from autoprec.measure.measurement import Measurement, describe_failure
from autoprec.measure.memory import CudaPeak, SavedBytes, module_bytes, training_state_bytes
from autoprec.measure.outcome import Outcome, Stage
from autoprec.metrics import grad_rel_l2, median
from autoprec.modelspec import ModelSpec
from autoprec.randomness import draws_random
from autoprec.training.rng import MEASURE_SEED, StepRng, same_rng
from autoprec.training.scaler import DynamicLossScaler
from autoprec.training.steps import StepHook, StepsTooSlow, run_steps, slow_step_guard
from autoprec.training.train import GradientsOnly, TrainStep

__all__ = ["MIN_TIMED_STEPS", "TIMED_BUDGET_S", "Harness"]

#: Timed steps a measurement always runs (their median is the step time), and the seconds of timed
#: steps after which it runs no more of its ``steps``: screening ranks policies, and the finalists
#: are timed again head to head (:mod:`autoprec.measure.timing`), so a deep model's 0.5-1 s steps
#: need not be timed 5 times each. With 0.1 s steps all 5 run, as before.
MIN_TIMED_STEPS = 3
TIMED_BUDGET_S = 2.0


class Harness:
    """The model, its captured FP32 graph, initial weights and the FP32 reference gradients on
    each drift batch ``get_batch(0..K-1)`` (:mod:`autoprec.measure.drift`, computed once and cached).

    Every drift forward/backward (the reference's included, each batch's from the same state) and every
    trajectory step runs from a fixed RNG state (:func:`autoprec.training.rng.same_rng`, seed
    ``MEASURE_SEED`` and ``MEASURE_SEED + k`` for trajectory step k: the fixed-per-step rule of
    :mod:`autoprec.training.rng`), so random ops such as dropout see the same draws in the reference
    and the candidates; the caller's RNG state is left as it was. Timing steps draw from the global
    stream. All steps run through :func:`autoprec.training.steps.run_steps`.

    With a random op in the graph (:func:`draws_random`) a compiled ``fn`` is compared against the
    FP32 graph compiled the same way (:meth:`reference_fn`; one extra compile, cached), and its drift
    passes and trajectory steps run under ``torch._inductor.config.fallback_random=True`` (issue
    19.2; :meth:`_eager_random`, for the torch.autocast + torch.compile module: a graph that
    :func:`autoprec.applied.compile.compile_graph` compiled has it among its options, so training
    runs what was measured). Inductor's own dropout rounds ``rand_like(x)`` to x's dtype before
    comparing it with p, so a bf16 graph drew other masks than the FP32 one (GPT-2, dropout 0.1:
    compiled torch.autocast 1.09e-2 against eager's 5.41e-3); with eager's random ops every dtype,
    compiled or not, draws eager's masks. A compiled ``fn`` compiles on its first call (its first
    drift pass wherever a measurement starts with drift) and Dynamo does not recompile for a changed
    Inductor config: its later timed steps run the same eager random ops. Without random ops every
    ``fn`` is compared against the eager reference.

    Args:
        spec: Loaded model file.
        device: Where to run.
        warmup: Untimed steps before timing (the first compiles, when compiled).
        steps: Timed steps; the median is reported (docs/architecture.md#measurements: ≥ 5).
        drift_batches: K, the batches each drift measurement runs on (default
            :data:`autoprec.measure.drift.DRIFT_BATCHES`, 4; ≥ 1). The FP32 reference of each is
            computed here: K forward/backward passes and K fp32 gradient sets kept (4·K bytes per
            parameter).

    Attributes:
        drift_batches: K (see Args). ref_loss, ref_grads: eager FP32's loss and gradients on batch 0.
        optimizer_name: Class name of the model file's optimizer (e.g. ``"AdamW"``), whose state
            :attr:`state_bytes` counts.
        backoff_hint: Batch 0's loss-scale back-offs in the last drift measurement that made any (1
            before any did): where the next one's back-off search starts.
        update_s: :meth:`update_seconds`'s cache, by ``scaled``.

    Raises:
        CaptureError: the model cannot be captured.
        ValueError: ``drift_batches`` < 1.
        Exception: whatever the model file's ``make_optimizer`` or its optimizer's first step
            raises (:func:`autoprec.measure.memory.training_state_bytes`).
    """

    def __init__(self, spec: ModelSpec, device: torch.device, warmup: int = 2, steps: int = 5,
                 drift_batches: int = DRIFT_BATCHES) -> None:
        if drift_batches < 1:
            raise ValueError(f"drift_batches must be >= 1, got {drift_batches}")
        self.spec, self.device, self.warmup, self.steps = spec, device, warmup, steps
        self.drift_batches = int(drift_batches)
        self.model: nn.Module = spec.build_model().to(device)
        self.model.train()
        n = max(steps, PROBE_BATCHES, self.drift_batches)
        self.batches = [spec.get_batch(i, device) for i in range(n)]
        self.graph_module = capture_for(self.model, self.batches[:PROBE_BATCHES], self.batches, spec.path)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.initial = [p.detach().clone() for p in self.params]
        optimizer = spec.make_optimizer(self.params)
        self.optimizer_name: str = type(optimizer).__name__
        self._state_bytes = training_state_bytes(self.params, optimizer)
        self._cuda_peak = CudaPeak(device, module_bytes(self.model))  # read on CUDA only
        self.shapes = batch_shapes(self.batches)
        # warm-up: up to every shape's first batch at least, so compiled graphs meet each before
        # timing; an eager fn needs one (its first step creates the optimizer's state): warmup_steps
        self._warm = warmup_steps(self.batches, warmup)
        self._warm_eager = warmup_steps(self.batches, min(warmup, 1))
        self.tokens = self._timed_tokens(steps, self._warm)  # mean per timed step
        self.random = draws_random(self.graph_module)
        self._compiled_fp32: CompiledGraph | None = None
        self.backoff_hint = 1  # batch 0's back-offs in the last drift that made any (measure_drift)
        self.update_s: dict[bool, float] = {}  # update_seconds, by "a loss scaler unscales"
        # eager references now, with this harness's parameters (bench's low-precision copies share them)
        self._refs = References()
        for k in range(self.drift_batches):
            self._reference(self.graph_module, k)
        self.ref_loss, self.ref_grads = self._reference(self.graph_module, 0)

    def reference_fn(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """The FP32 function whose random draws match ``fn``'s: the captured graph, or, when
        ``fn`` is compiled and the graph draws random numbers, that graph compiled with
        ``compile_graph`` (compiled on first use, then cached). Use it for ``traj_rel``'s
        reference trajectory too."""
        if not (self.random and is_compiled(fn)):
            return self.graph_module
        if self._compiled_fp32 is None:
            self._compiled_fp32 = compile_graph(self.graph_module)
        return self._compiled_fp32

    def _reference(self, fn: Callable[..., Any], batch: int) -> Grads:
        """FP32 loss and gradients on ``batch`` from :meth:`reference_fn` (``fn``'s RNG stream),
        computed once per batch and reference (eager, compiled) and cached. A compiled reference is
        keyed by its object (the harness keeps it alive): a shallow copy of the harness (bench's
        low-precision copies) that compiles its own shares the eager references only."""
        ref = self.reference_fn(fn)
        kind = "eager" if ref is self.graph_module else f"compiled:{id(ref)}"
        return self._refs.get(kind, batch, lambda: self._grads(ref, None, None, batch=batch))

    def restore(self) -> None:
        """Put the initial weights back and drop gradients."""
        with torch.no_grad():
            for p, p0 in zip(self.params, self.initial, strict=True):
                p.copy_(p0)
                p.grad = None

    def _eager_random(self, fn: Callable[..., Any]) -> contextlib.AbstractContextManager[Any]:
        """``torch._inductor.config.patch(fallback_random=True)`` for a compiled ``fn`` on a graph with
        random ops, else a no-op: drift passes and trajectory steps run under it, so a compiled graph
        compiled there draws eager's masks whatever its dtypes (class docstring)."""
        if not (self.random and is_compiled(fn)):
            return contextlib.nullcontext()
        import torch._inductor.config as inductor_config  # loaded lazily, by a compiled fn's first call

        return inductor_config.patch(fallback_random=True)

    def _grads(self, fn: Callable[..., Any], scaler: DynamicLossScaler | None,
               autocast_dtype: torch.dtype | None, counter: SavedBytes | None = None,
               batch: int = 0, seconds: dict[int, float] | None = None, fp32_gemms: bool = False) -> Grads:
        """Loss and unscaled fp32 gradients of one forward/backward of ``fn`` on ``batch`` from the
        initial weights and RNG seed ``MEASURE_SEED`` (``counter`` counts what it saves for backward;
        ``seconds[batch]`` gets the forward/backward's wall-clock seconds, device synchronised;
        ``fp32_gemms``: ``autocast_dtype``'s GEMMs as fp32 products, :class:`Fp32ComputeGemms`)."""
        self.restore()
        step = TrainStep(fn, self.params, GradientsOnly(), self.spec.loss_fn, scaler=scaler,
                         autocast_dtype=autocast_dtype, device_type=self.device.type)
        hooks = (torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t) if counter is not None
                 else contextlib.nullcontext())
        gemms = Fp32ComputeGemms(autocast_dtype) if fp32_gemms else contextlib.nullcontext()
        with same_rng(self.device), hooks, self._eager_random(fn), gemms:
            sync(self.device)
            t0 = time.perf_counter()
            loss = step.forward_backward(self.batches[batch])
            if seconds is not None:
                sync(self.device)
                seconds[batch] = time.perf_counter() - t0
        return float(loss), take_grads(self.params, scaler.get_scale() if scaler is not None else 1.0)

    def drift(self, fn: Callable[..., Any], scaler: DynamicLossScaler | None = None,
              autocast_dtype: torch.dtype | None = None,
              stop: Callable[[Measurement], Outcome] | None = None,
              fp32_gemms: bool = False) -> Measurement:
        """Drift of ``fn`` against the FP32 reference on the K drift batches (fewer: ``stop``).

        Per batch k (:func:`autoprec.measure.drift.measure_drift`): ``grad_rel_l2`` against that
        batch's FP32 gradients, both from RNG seed :data:`autoprec.training.rng.MEASURE_SEED`
        (same dropout masks), the reference being :meth:`reference_fn`'s (the compiled FP32 graph
        for a compiled ``fn`` on a graph with random ops). The Measurement holds the per-batch
        values (``grad_rel_l2_batches``), their mean (``grad_rel_l2``, ``loss_rel``) and the
        min SQNR; ``peak_bytes`` counts batch 0's pass.

        With a dynamic loss scaler, overflowing scaled gradients back off as training's first
        steps do (per batch, at most :data:`autoprec.measure.drift.MAX_BACKOFFS` times); the count
        goes in ``note``; only gradients non-finite at the scaler's floor count as a failure
        (``error`` set, ``grad_rel_l2`` inf).

        ``stop``, when given, sees the Measurement of the batches run so far after each finite
        batch but the last, and before a back-off search (:func:`~autoprec.measure.drift.measure_drift`);
        an :class:`~autoprec.measure.outcome.Outcome` other than ``CONTINUE`` (cut or accepted) ends
        the passes there and becomes the Measurement's ``outcome``.
        ``fp32_gemms``: the passes compute ``autocast_dtype``'s GEMMs as fp32 products rounded to
        it (:class:`autoprec.kernels.fp32_gemms.Fp32ComputeGemms`: the same roundings where the
        native kernel is slow; an ``fn`` compiled runs eagerly under it).

        Raises:
            Exception: whatever running ``fn`` raises (compile errors, out of memory).
        """
        # the references first, before the peak reset: the compiled one compiles and runs on first use
        refs = [self._reference(fn, k) for k in range(self.drift_batches)]
        if self.device.type == "cuda":
            self._cuda_peak.start()

        seconds: dict[int, float] = {}

        def step(k: int, count: bool) -> tuple[float, list[torch.Tensor], int]:
            counter = SavedBytes(self.params) if count else None
            loss, grads = self._grads(fn, scaler, autocast_dtype, counter, k, seconds, fp32_gemms)
            return loss, grads, counter.total if counter is not None else 0

        ended: list[Outcome] = []

        def stopped(d: Drift) -> bool:
            ended.append(stop(as_measurement(d, seconds, scaler, self.state_bytes)))
            return not ended[-1].going_on

        d = measure_drift(step, refs, scaler, self.backoff_hint, stopped if stop is not None else None)
        if d.first_backoffs:  # the next policy likely backs off about as far
            self.backoff_hint = d.first_backoffs
        m = as_measurement(d, seconds, scaler, self.state_bytes)
        if d.stopped and m.outcome.going_on:
            m.outcome = ended[-1]
        return m

    def global_drift(self, fn: Callable[..., Any], accumulation: int,
                     scaler_factory: Callable[[], DynamicLossScaler | None] = lambda: None,
                     autocast_dtype: torch.dtype | None = None, global_steps: int = 2,
                     fp32_gemms: bool = False) -> list[float]:
        """``grad_rel_l2`` of ``fn``'s accumulated gradients on each of ``global_steps`` global
        batches against the FP32 reference's (:meth:`reference_fn`), accumulated the same way: on
        a harness whose batches are micro-batches (``MicroBatches.micro_spec()``), global batch g is
        micro-batches ``g*A .. g*A + A-1`` (``A = accumulation``), each loss weighted by 1/A, the
        gradients summed in the fp32 ``.grad`` of the master weights (``tune --global-batch``'s drift,
        docs/architecture.md#measurements). Micro-batch j of every global batch runs from RNG seed
        ``MEASURE_SEED + j`` in both. References are cached per (reference, A, g).

        Returns:
            One value per global batch (dimensionless; inf where the gradients are non-finite).

        Raises:
            Exception: whatever running ``fn`` raises (compile errors, out of memory).
        """
        ref_fn = self.reference_fn(fn)
        kind = "eager" if ref_fn is self.graph_module else f"compiled:{id(ref_fn)}"
        out = []
        for g in range(global_steps):
            ref = self._refs.get(f"{kind}/A{accumulation}", g, lambda g=g: self._accumulated(
                ref_fn, None, None, accumulation, g, False))
            grads = self._accumulated(fn, scaler_factory(), autocast_dtype, accumulation, g, fp32_gemms)
            out.append(grad_rel_l2(grads[1], ref[1]))
        return out

    def _accumulated(self, fn: Callable[..., Any], scaler: DynamicLossScaler | None,
                     autocast_dtype: torch.dtype | None, accumulation: int, g: int,
                     fp32_gemms: bool) -> Grads:
        """Mean loss and unscaled fp32 gradients of global batch ``g`` (:meth:`global_drift`)."""
        self.restore()
        step = TrainStep(fn, self.params, GradientsOnly(), self.spec.loss_fn, scaler=scaler,
                         autocast_dtype=autocast_dtype, device_type=self.device.type)
        gemms = Fp32ComputeGemms(autocast_dtype) if fp32_gemms else contextlib.nullcontext()
        losses = []
        with self._eager_random(fn), gemms:
            for j in range(accumulation):
                with same_rng(self.device, MEASURE_SEED + j):
                    batch = self.spec.get_batch(g * accumulation + j, self.device)
                    losses.append(float(step.forward_backward(batch, 1.0 / accumulation)))
        scale = scaler.get_scale() if scaler is not None else 1.0
        return sum(losses) / accumulation, take_grads(self.params, scale)

    @property
    def state_bytes(self) -> int:
        """Bytes of the parameters, their gradients and the state of the model file's optimizer
        (:func:`autoprec.measure.memory.training_state_bytes`, counted once when the harness is
        built): what every policy needs whatever it computes in (fp32 master weights,
        docs/architecture.md#runtime)."""
        return self._state_bytes

    def measure(self, fn: Callable[..., Any],
                scaler_factory: Callable[[], DynamicLossScaler | None] = lambda: None,
                autocast_dtype: torch.dtype | None = None, timing: bool = True,
                max_step_s: float | None = None, screen: bool = False,
                cut: Callable[[Measurement], Outcome] | None = None,
                fp32_gemms: bool = False) -> Measurement:
        """Drift, memory and (optionally) median step time of full training steps of ``fn``.

        Args:
            fn: Module to train (lowered graph, compiled graph or the FP32 graph).
            scaler_factory: Makes a fresh loss scaler per phase (``None`` for bf16/fp32).
            autocast_dtype: Wrap forward in ``torch.autocast`` (the AMP baseline).
            timing: Also time ``warmup + steps`` optimizer steps.
            max_step_s: Stop timing (warm-up steps included) after two consecutive steps longer
                than this, or one step 4x longer (e.g. a dtype the device emulates slowly;
                :func:`autoprec.training.steps.slow_step_guard`); the measurement is then timed on
                that last step only and ``note`` says why. Compilation happens in the drift pass,
                before timing, so it never counts here.
            screen: A screening measurement (a search trial): for an eager ``fn`` on the CPU
                with K ≥ 2, the step times are the drift passes' (batches 0..K-1) plus the
                update's, so no step runs twice (:func:`autoprec.measure.screening.from_drift_passes`);
                elsewhere it times steps as ``timing`` does.
            cut: A screening cut: given the measurement so far (step times filled as ``screen``
                fills them) after each drift batch but the last, and before a back-off search;
                an outcome other than ``CONTINUE`` stops the passes there (:meth:`drift`'s ``stop``).
            fp32_gemms: The drift passes compute ``autocast_dtype``'s GEMMs as fp32 products (its
                numerics, where its native GEMMs are slow: :meth:`drift`); the steps are timed
                natively (``timing``), never from those passes.

        Returns:
            A :class:`Measurement`; on failure ``error`` says why (never raises for numerics).
        """
        scaler = scaler_factory()

        def screened(m: Measurement) -> Measurement:  # every drift pass timed, batch 0's too
            if screen and timing and not fp32_gemms and not m.failed and m.pass_times and \
                    screening.applies(self.device, fn, self.drift_batches):
                screening.from_drift_passes(m, self._timed_tokens(len(m.pass_times), 0),
                                            self.update_seconds(scaled=scaler is not None))
            return m

        try:
            stop = (lambda m: cut(screened(m))) if cut else None
            m = self.drift(fn, scaler, autocast_dtype, stop, fp32_gemms)
        except Exception as e:  # compile errors, OOM, kernels missing for a dtype
            self.restore()
            return Measurement(outcome=Outcome.failed(describe_failure(e)))
        if m.failed or not timing or screened(m).step_times or m.outcome.stage is Stage.CUT:
            return m  # screened(m) fills m's step times where the timed passes give them
        try:
            m.step_times = self._time(fn, scaler_factory(), autocast_dtype, max_step_s)
        except StepsTooSlow as e:
            m.step_times, m.note = [e.seconds], f"{e}; timed on that last step only"
        except Exception as e:
            m.fail(describe_failure(e))
            return m
        finally:
            self.restore()
        m.step_s = median(m.step_times)
        m.tokens_per_s = self._timed_tokens(len(m.step_times), self.warmup_steps(fn)) / m.step_s
        if self.device.type == "cuda":
            m.peak_bytes = self._cuda_peak.read()
        return m

    def update_seconds(self, scaled: bool) -> float:
        """Seconds of a training step's update on these parameters, with (``scaled``) or without a
        default :class:`DynamicLossScaler`: :func:`autoprec.measure.screening.time_update` on batch
        0's FP32 reference gradients with the model file's optimizer; measured on first use per
        ``scaled``, then cached (:attr:`update_s`); the weights are restored afterwards."""
        if scaled not in self.update_s:
            step = self.train_step(self.graph_module, DynamicLossScaler() if scaled else None, None)
            try:
                self.update_s[scaled] = screening.time_update(step, self.ref_grads, self.device)
            finally:
                self.restore()
        return self.update_s[scaled]

    def train_step(self, fn: Callable[..., Any], scaler: DynamicLossScaler | None,
                   autocast_dtype: torch.dtype | None) -> TrainStep:
        """A training step of ``fn`` from the initial weights (restored now) with a fresh optimizer
        of the model file's, ``scaler`` and ``autocast_dtype``, computing no per-step statistics."""
        self.restore()
        return TrainStep(fn, self.params, self.spec.make_optimizer(self.params), self.spec.loss_fn,
                         scaler=scaler, autocast_dtype=autocast_dtype, device_type=self.device.type,
                         stats=False)

    def _time(self, fn, scaler, autocast_dtype, max_step_s) -> list[float]:
        """Seconds of the timed steps after the untimed warm-up (batches reused cyclically);
        raises :class:`StepsTooSlow` as :func:`slow_step_guard` says (warm-up steps count).

        The warm-up is ``warmup`` steps, or one per distinct batch shape when there are more
        (:attr:`shapes`), so a compiled graph meets every shape (and recompiles, if it must)
        before timing starts; an eager ``fn`` (not compiled) gets one warm-up step per shape
        (:meth:`warmup_steps`). Timing stops after ``steps`` timed steps, or after
        :data:`MIN_TIMED_STEPS` once the timed steps have taken :data:`TIMED_BUDGET_S` in all."""
        guard = [slow_step_guard(max_step_s)] if max_step_s is not None else []
        step = self.train_step(fn, scaler, autocast_dtype)

        def run(start: int, stop: int) -> list[float]:
            done = run_steps(step, lambda k: self.batches[k % len(self.batches)], start, stop,
                             device=self.device, after=guard)
            return [seconds for _stats, seconds in done]

        warm = self.warmup_steps(fn)
        seconds = run(0, warm + min(MIN_TIMED_STEPS, self.steps))[warm:]
        while len(seconds) < self.steps and sum(seconds) < TIMED_BUDGET_S:
            seconds += run(warm + len(seconds), warm + len(seconds) + 1)
        return seconds

    def warmup_steps(self, fn: Callable[..., Any]) -> int:
        """Untimed steps before timing ``fn``: ``warmup`` (one per batch shape at least) for a compiled
        ``fn``, whose first calls per shape compile; one (per shape) for an eager one, whose first step
        only creates the optimizer's state (a second cost 0.65 s per trial of a 24-layer Qwen2)."""
        return self._warm if is_compiled(fn) else self._warm_eager

    def extend_batches(self, n: int) -> None:
        """Make ``batches`` hold at least ``n``: ``get_batch(k)`` for each k missing."""
        while len(self.batches) < n:
            self.batches.append(self.spec.get_batch(len(self.batches), self.device))

    def _timed_tokens(self, n: int, warm: int) -> float:
        """Mean tokens per step of the ``n`` timed steps after ``warm`` warm-up steps (their batches)."""
        timed = [self.batches[k % len(self.batches)] for k in range(warm, warm + n)]
        return sum(self.spec.tokens_per_batch(b) for b in timed) / max(len(timed), 1)

    def trajectory(self, fn: Callable[..., Any], scaler_factory: Callable[[], DynamicLossScaler | None]
                   = lambda: None, autocast_dtype: torch.dtype | None = None, steps: int = 20,
                   fp32_gemms: bool = False, after: Sequence[StepHook] = ()) -> list[float]:
        """Losses of ``steps`` optimizer steps on batches ``get_batch(0..steps-1)`` from the initial
        weights (restored afterwards; ``fp32_gemms`` as :meth:`measure`'s; ``after``: hooks of
        :func:`run_steps`, whose exception ends the run early). Non-finite losses are kept.

        Step k runs from RNG seed ``MEASURE_SEED + k`` (``StepRng(MEASURE_SEED, per_step=True)``,
        :mod:`autoprec.training.rng`), so every configuration sees the same dropout masks at step k
        whatever earlier steps drew; the caller's RNG state is left as it was."""
        self.extend_batches(steps)
        try:
            step = self.train_step(fn, scaler_factory(), autocast_dtype)
            gemms = Fp32ComputeGemms(autocast_dtype) if fp32_gemms else contextlib.nullcontext()
            with self._eager_random(fn), gemms:  # a first call compiles here too: eager's masks, as drift's
                done = run_steps(step, self.batches.__getitem__, 0, steps,
                                 rng=StepRng(MEASURE_SEED, per_step=True), device=self.device, after=after)
            return [stats.loss for stats, _seconds in done]
        finally:
            self.restore()
