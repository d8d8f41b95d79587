"""Measurements (DESIGN §5): training-step throughput, drift against FP32, memory.

One :class:`Harness` holds the model, its captured graph, a snapshot of the initial weights and
the FP32 reference gradients; every configuration (FP32, torch.autocast, a policy, eager or
compiled) is measured on the same weights and batches, and the weights are restored after each.
``autoprec tune`` and ``autoprec bench`` use the same code.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from autoprec.capture import capture
from autoprec.modelspec import ModelSpec
from autoprec.runtime.scaler import DynamicLossScaler
from autoprec.runtime.train import TrainStep

__all__ = ["MEASURE_SEED", "Measurement", "Harness", "describe_machine", "grad_rel_l2", "grad_sqnr_db_min", "traj_rel",
           "resolve_device", "same_rng", "sync", "time_matmul"]

#: Seed of the global RNG (CPU, and the CUDA device when on CUDA) at the start of every drift
#: forward/backward (the FP32 reference's and each candidate's) and of every trajectory step
#: (step k: ``MEASURE_SEED + k``), so a model with dropout or other random ops draws the same
#: random numbers in the reference and in every eager candidate (DESIGN §5 compares
#: gradients "on the same weights and batch"; different dropout masks would make even FP32 differ
#: from itself by grad_rel_l2 ~1). Timing steps are not reseeded.
MEASURE_SEED = 0


@contextlib.contextmanager
def same_rng(device: torch.device, seed: int = MEASURE_SEED) -> Iterator[None]:
    """Run the body from a fixed RNG state and give the caller its RNG state back afterwards.

    Forks the CPU RNG and, on CUDA, ``device``'s RNG (``torch.random.fork_rng``), then seeds
    exactly those generators with ``seed`` (``torch.manual_seed`` would also reseed every other
    CUDA device, whose state ``fork_rng(devices=[device])`` does not restore).

    Eager random ops (``aten.dropout``/``native_dropout``, ``rand``, ``bernoulli``) then draw
    identical numbers in every configuration. Inductor-compiled graphs draw theirs from seeds
    they take from the same generators (``inductor_prims.seeds`` -> ``torch.randint``), so they
    are reproducible run to run but use Inductor's Philox stream, not eager's
    (``torch._inductor.config.fallback_random`` is False): a compiled graph's dropout masks
    differ from an eager graph's even from the same seed.
    """
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else [], device_type="cuda" if cuda else None):
        torch.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield


def resolve_device(device: str = "auto") -> torch.device:
    """``"auto"`` -> ``cuda`` when available else ``cpu``; otherwise ``torch.device(device)``.

    Raises:
        ValueError: ``device`` is ``cuda`` but no CUDA device is available, or is unknown.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"unknown device {device!r}; valid: auto, cpu, cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but torch.cuda.is_available() is False")
    return torch.device(device)


def sync(device: torch.device) -> None:
    """Wait for queued device work (CUDA) so wall-clock timings cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def describe_machine(device: torch.device) -> dict[str, Any]:
    """Where the numbers come from: device name, CPU model and bf16/fp16-relevant flags, load.

    Returns:
        ``{"device", "cpu", "cpu_count", "cpu_flags", "loadavg_1m", "gpu"}``; ``cpu_flags`` maps
        ``avx512_bf16``, ``amx_bf16``, ``avx512_fp16``, ``amx_fp16``, ``avx512f`` and ``avx2`` to
        whether ``/proc/cpuinfo`` lists them.
    """
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16", "avx512f", "avx2")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "device": gpu or f"{cpu} ({os.cpu_count()} cores)",
        "cpu": cpu, "cpu_count": os.cpu_count(),
        "cpu_flags": {k: k in flags for k in wanted},
        "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "gpu": gpu,
    }


def time_matmul(dtype: torch.dtype, device: torch.device, n: int, reps: int, stop_after_s: float) -> list[float]:
    """Wall-clock seconds of ``n×n @ n×n`` matmuls in ``dtype`` on ``device``.

    One warm-up, then up to ``reps`` timed runs (device-synchronised), stopping early once
    ``stop_after_s`` seconds have passed, so a dtype the device emulates slowly costs little.

    Returns:
        The timed durations (the warm-up's alone if the budget ran out before any).

    Raises:
        RuntimeError: the device has no kernel for ``dtype``.
    """
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    times = []
    start = time.perf_counter()
    for _ in range(reps + 1):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > stop_after_s:
            break
    return times[1:] or times


def grad_rel_l2(grads: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """‖g − g₃₂‖₂ / ‖g₃₂‖₂ over all gradients concatenated (DESIGN §5); inf if non-finite.

    Args:
        grads: Gradients (any float dtype; compared in fp64), same shapes as ``ref``.
        ref: FP32 reference gradients.
    """
    num = 0.0
    den = 0.0
    for g, r in zip(grads, ref, strict=True):
        d = g.double() - r.double()
        num += float((d * d).sum())
        den += float((r.double() ** 2).sum())
    if not math.isfinite(num):
        return math.inf
    return math.sqrt(num) / max(math.sqrt(den), 1e-300)


def grad_sqnr_db_min(grads: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """min over parameters of 20·log₁₀(‖g₃₂‖/‖g − g₃₂‖) in dB (torchao's SQNR); −inf if non-finite."""
    worst = math.inf
    for g, r in zip(grads, ref, strict=True):
        err = float((g.double() - r.double()).norm())
        sig = float(r.double().norm())
        if not math.isfinite(err):
            return -math.inf
        if err == 0.0 or sig == 0.0:
            continue
        worst = min(worst, 20.0 * math.log10(sig / err))
    return worst


@dataclass
class Measurement:
    """One configuration measured on the harness's weights and batches.

    Attributes:
        step_s: Median wall-clock seconds of a full training step after warm-up (inf if not timed).
        tokens_per_s: Tokens per batch / ``step_s``.
        grad_rel_l2: ‖g − g₃₂‖/‖g₃₂‖ on batch 0 (inf if non-finite).
        loss_rel: |L − L₃₂| / |L₃₂| on batch 0.
        grad_sqnr_db_min: Minimum per-parameter gradient SQNR in dB.
        peak_bytes: CUDA peak allocated bytes; on CPU (DESIGN §5) bytes of the distinct tensors
            saved for backward (``saved_tensors_hooks``; a saved parameter allocates nothing and
            is not counted again) + parameter, gradient and optimizer-state bytes (16 per fp32
            parameter with AdamW).
        step_times: All timed step durations (seconds).
        error: Why the measurement failed (non-finite values, compile error, out of memory).
        note: Remarks that do not invalidate it (e.g. timed on fewer steps because too slow).
    """

    step_s: float = math.inf
    tokens_per_s: float = 0.0
    grad_rel_l2: float = math.inf
    loss_rel: float = math.inf
    grad_sqnr_db_min: float = -math.inf
    peak_bytes: int = 0
    step_times: list[float] = field(default_factory=list)
    error: str | None = None
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (JSON-ready except for inf, which callers map to None)."""
        return asdict(self)


class _SavedBytes:
    """Counts bytes of distinct tensors saved for backward (``saved_tensors_hooks``).

    A saved tensor that shares storage with a parameter (e.g. a weight a matmul keeps for its
    input gradient) allocates nothing: it is counted once, with the parameters, not here.
    """

    def __init__(self, params: list[torch.Tensor] = ()) -> None:
        self.seen: set[int] = {p.untyped_storage().data_ptr() for p in params}
        self.total = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            key = t.untyped_storage().data_ptr()
        except Exception:  # tensors without storage (fake/meta)
            key = id(t)
        if key not in self.seen:
            self.seen.add(key)
            self.total += t.numel() * t.element_size()
        return t


def draws_random(gm: nn.Module) -> bool:
    """Whether the graph (or any graph inside it) has an op that draws random numbers.

    ATen marks such ops ``Tag.nondeterministic_seeded`` (``dropout``, ``native_dropout``,
    ``bernoulli``, ``rand*``, ...; native_functions.yaml). Attention ops carry the tag too and
    count only with ``dropout_p`` ≠ 0; ``dropout(x, p, train=False)`` and ``p == 0`` do not count.
    """
    for sub in gm.modules():
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        for node in graph.nodes:
            t = node.target
            if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
                continue
            if torch.Tag.nondeterministic_seeded not in t.tags:
                continue
            args = t._schema.arguments

            def arg(name: str, node=node, args=args) -> Any:
                i = next((k for k, a in enumerate(args) if a.name == name), None)
                if i is None:
                    return None
                if name in node.kwargs:
                    return node.kwargs[name]
                return node.args[i] if i < len(node.args) else args[i].default_value

            if arg("train") is False or arg("dropout_p") == 0 or (
                    "dropout" in t._schema.name and arg("p") == 0):
                continue
            return True
    return False


def _is_compiled(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` runs through ``torch.compile``: what ``compile_graph`` returns (an
    ``OptimizedModule``, or apply's activation-memory-budget wrapper holding one as ``.fn``)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return any(isinstance(f, OptimizedModule) or hasattr(f, "_torchdynamo_orig_callable")
               for f in (fn, getattr(fn, "fn", None)) if f is not None)


class Harness:
    """The model, its captured FP32 graph, initial weights and the FP32 reference gradients.

    Every drift forward/backward (the reference's included) and every trajectory step runs from
    a fixed RNG state (:func:`same_rng`), so random ops such as dropout see the same draws in the
    reference and the candidates; the caller's RNG state is left as it was.

    Compiled graphs draw random numbers from Inductor's own generator, not eager's
    (``torch._inductor.config.fallback_random`` is False, as in training), so with a random op in
    the graph (:func:`draws_random`) a compiled ``fn`` is compared against the FP32 graph compiled
    the same way (:meth:`reference_fn`; one extra compile, cached) instead of the eager FP32
    reference: same seed, same Inductor random stream, same masks. Without random ops every ``fn``
    is compared against the eager reference, as before.

    Args:
        spec: Loaded model file.
        device: Where to run.
        warmup: Untimed steps before timing (the first compiles, when compiled).
        steps: Timed steps; the median is reported (DESIGN §5: ≥ 5).

    Raises:
        CaptureError: the model cannot be captured.
    """

    def __init__(self, spec: ModelSpec, device: torch.device, warmup: int = 2, steps: int = 5) -> None:
        self.spec, self.device, self.warmup, self.steps = spec, device, warmup, steps
        self.model: nn.Module = spec.build_model().to(device)
        self.model.train()
        self.batches = [spec.get_batch(i, device) for i in range(max(steps, 1))]
        t0 = time.perf_counter()
        self.graph_module = capture(self.model, self.batches[0])
        self.capture_s = time.perf_counter() - t0
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.initial = [p.detach().clone() for p in self.params]
        self.tokens = spec.tokens_per_batch(self.batches[0])
        self.ref_loss, self.ref_grads = self._grads(self.graph_module, None, None)
        self.random = draws_random(self.graph_module)
        self._compiled_fp32: Callable[..., Any] | None = None
        self._compiled_ref: tuple[float, list[torch.Tensor]] | None = None

    def reference_fn(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """The FP32 function whose random draws match ``fn``'s: the captured graph, or, when
        ``fn`` is compiled and the graph draws random numbers, that graph compiled with
        ``compile_graph`` (compiled on first use, then cached). Use it for ``traj_rel``'s
        reference trajectory too."""
        if not (self.random and _is_compiled(fn)):
            return self.graph_module
        if self._compiled_fp32 is None:
            from autoprec.runtime.apply import compile_graph  # apply imports the passes

            self._compiled_fp32 = compile_graph(self.graph_module)
        return self._compiled_fp32

    def _reference(self, fn: Callable[..., Any]) -> tuple[float, list[torch.Tensor]]:
        """FP32 loss and gradients on batch 0 from :meth:`reference_fn` (``fn``'s RNG stream)."""
        ref = self.reference_fn(fn)
        if ref is self.graph_module:
            return self.ref_loss, self.ref_grads
        if self._compiled_ref is None:
            self._compiled_ref = self._grads(ref, None, None)
        return self._compiled_ref

    def restore(self) -> None:
        """Put the initial weights back and drop gradients."""
        with torch.no_grad():
            for p, p0 in zip(self.params, self.initial, strict=True):
                p.copy_(p0)
                p.grad = None

    def _grads(self, fn: Callable[..., Any], scaler: DynamicLossScaler | None,
               autocast_dtype: torch.dtype | None, counter: _SavedBytes | None = None):
        self.restore()
        step = TrainStep(fn, self.params, _NoOpt(), self.spec.loss_fn, scaler=scaler,
                         autocast_dtype=autocast_dtype, device_type=self.device.type)
        hooks = (torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t) if counter is not None
                 else contextlib.nullcontext())
        with same_rng(self.device), hooks:
            loss = step.forward_backward(self.batches[0])
        inv = 1.0 / scaler.get_scale() if scaler is not None else 1.0
        grads = [(p.grad.float() * inv) if p.grad is not None else torch.zeros_like(p) for p in self.params]
        self.restore()
        return float(loss), grads

    def drift(self, fn: Callable[..., Any], scaler: DynamicLossScaler | None = None,
              autocast_dtype: torch.dtype | None = None) -> Measurement:
        """Drift of ``fn`` against the FP32 reference on batch 0 (no timing).

        Both run from RNG seed :data:`MEASURE_SEED`; the reference is :meth:`reference_fn`'s
        (the compiled FP32 graph for a compiled ``fn`` on a graph with random ops)."""
        ref_loss, ref_grads = self._reference(fn)  # before the peak reset: may compile and run
        counter = _SavedBytes(self.params)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        loss, grads = self._grads(fn, scaler, autocast_dtype, counter)
        m = Measurement()
        m.grad_rel_l2 = grad_rel_l2(grads, ref_grads)
        m.loss_rel = abs(loss - ref_loss) / max(abs(ref_loss), 1e-30) if math.isfinite(loss) else math.inf
        m.grad_sqnr_db_min = grad_sqnr_db_min(grads, ref_grads)
        m.peak_bytes = counter.total + self.state_bytes
        if not (math.isfinite(m.grad_rel_l2) and math.isfinite(m.loss_rel)):
            m.grad_rel_l2, m.error = math.inf, "non-finite loss or gradients"
        return m

    @property
    def state_bytes(self) -> int:
        """Bytes of the parameters, their gradients and AdamW's two moments: 4 x the parameter
        bytes (fp32 master weights and optimizer state, DESIGN §7)."""
        return sum(p.numel() * p.element_size() for p in self.params) * 4

    def measure(self, fn: Callable[..., Any], scaler_factory: Callable[[], DynamicLossScaler | None] = lambda: None,
                autocast_dtype: torch.dtype | None = None, timing: bool = True,
                max_step_s: float | None = None) -> Measurement:
        """Drift, memory and (optionally) median step time of full training steps of ``fn``.

        Args:
            fn: Module to train (lowered graph, compiled graph or the FP32 graph).
            scaler_factory: Makes a fresh loss scaler per phase (``None`` for bf16/fp32).
            autocast_dtype: Wrap forward in ``torch.autocast`` (the AMP baseline).
            timing: Also time ``warmup + steps`` optimizer steps.
            max_step_s: Abort timing after two consecutive steps longer than this, or one step
                4x longer (e.g. a dtype the device emulates slowly); the measurement then
                reports the last step. Compilation happens in
                the drift pass, before timing, so it never counts here.

        Returns:
            A :class:`Measurement`; on failure ``error`` says why (never raises for numerics).
        """
        try:
            m = self.drift(fn, scaler_factory(), autocast_dtype)
        except Exception as e:  # compile errors, OOM, kernels missing for a dtype
            self.restore()
            return Measurement(error=_describe_failure(e))
        if m.error is not None or not timing:
            return m
        try:
            m.step_times = self._time(fn, scaler_factory(), autocast_dtype, max_step_s)
        except _TooSlow as e:
            m.step_times, m.note = [e.seconds], str(e)
        except Exception as e:
            m.error = _describe_failure(e)
            return m
        finally:
            self.restore()
        m.step_s = statistics.median(m.step_times)
        m.tokens_per_s = self.tokens / m.step_s
        if self.device.type == "cuda":
            m.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
        return m

    def _time(self, fn, scaler, autocast_dtype, max_step_s) -> list[float]:
        self.restore()
        opt = self.spec.make_optimizer(self.params)
        step = TrainStep(fn, self.params, opt, self.spec.loss_fn, scaler=scaler,
                         autocast_dtype=autocast_dtype, device_type=self.device.type, stats=False)
        times, slow_in_a_row = [], 0
        for i in range(self.warmup + self.steps):
            batch = self.batches[i % len(self.batches)]
            _stats, dt = step.timed(batch)
            if max_step_s is not None:
                # Two slow steps in a row (one noisy step is not enough), or one far too slow.
                slow_in_a_row = slow_in_a_row + 1 if dt > max_step_s else 0
                if slow_in_a_row >= 2 or dt > 4 * max_step_s:
                    raise _TooSlow(dt, max_step_s)
            if i >= self.warmup:
                times.append(dt)
        return times


    def trajectory(self, fn: Callable[..., Any], scaler_factory: Callable[[], DynamicLossScaler | None] = lambda: None,
                   autocast_dtype: torch.dtype | None = None, steps: int = 20) -> list[float]:
        """Losses of ``steps`` optimizer steps on batches ``get_batch(0..steps-1)`` from the
        initial weights (the weights are restored afterwards). Non-finite losses are kept as-is.

        Step k runs from RNG seed ``MEASURE_SEED + k`` (:func:`same_rng`), so every configuration
        sees the same dropout masks at step k whatever earlier steps drew; the caller's RNG state
        is left as it was."""
        while len(self.batches) < steps:
            self.batches.append(self.spec.get_batch(len(self.batches), self.device))
        self.restore()
        opt = self.spec.make_optimizer(self.params)
        step = TrainStep(fn, self.params, opt, self.spec.loss_fn, scaler=scaler_factory(),
                         autocast_dtype=autocast_dtype, device_type=self.device.type, stats=False)
        losses = []
        try:
            for i in range(steps):
                with same_rng(self.device, MEASURE_SEED + i):
                    losses.append(step(self.batches[i]).loss)
            return losses
        finally:
            self.restore()


def traj_rel(losses: list[float], ref: list[float]) -> float:
    """max over steps k of |L_k − L32_k| / |L32_k| (DESIGN §5); inf if any loss is non-finite.

    Also the "max relative deviation from the FP32 curve" of ``autoprec train --compare``.
    """
    worst = 0.0
    for a, b in zip(losses, ref, strict=True):
        if not (math.isfinite(a) and math.isfinite(b)):
            return math.inf
        worst = max(worst, abs(a - b) / max(abs(b), 1e-30))
    return worst


def _describe_failure(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    kind = "out of memory" if "out of memory" in str(e).lower() else type(e).__name__
    return f"{kind}: {text[:300]}"


class _TooSlow(Exception):
    def __init__(self, seconds: float, limit: float) -> None:
        super().__init__(f"timed on one step: it took {seconds:.2f} s (> {limit:.2f} s)")
        self.seconds = seconds


class _NoOpt:
    """Stands in for an optimizer where only gradients are wanted."""

    param_groups: list[dict[str, Any]] = []

    def step(self) -> None:  # pragma: no cover - never called
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:  # pragma: no cover
        pass
