"""The kernel probe: which low-precision kernels the device runs usefully, at the model's own
matmul shapes (docs/architecture.md#search).

A dtype is not fast or slow by itself; its kernels are. Per low dtype the probe times

- the **native** kernel: the product in that dtype (``a.to(d) @ b.to(d)``; for ``fp8_e4m3``
  the scaled fp8 matmul :func:`autoprec.kernels.fp8.fp8_linear`, which has no other variant);
- the **fp32-compute** kernel: inputs stored in ``d``, upcast to fp32, an fp32 product, the
  result stored in ``d`` again: what ``Rule(dtype=d, compute="fp32")`` runs (the numerics of a
  Tensor Core, which accumulates in fp32);

side by side with fp32 at the same shapes (the model's matmuls, :func:`matmul_shapes`), and keeps
a kernel when it is not slower than fp32 beyond noise (:data:`TOL`). On a CPU without native bf16
(AVX2) the native kernel measures ~90x slower and the fp32-compute one ~1x, so bf16 is searched
with fp32 compute; on AVX512-BF16/AMX CPUs and GPUs the native kernel measures faster and comes
first. Nothing here knows a device: the verdict is the measurement's alone.

Kernel names are the search-space choices: ``"bf16"`` (native), ``"bf16:fp32"`` (bf16 storage,
fp32 compute), ``"fp16"``, ``"fp16:fp32"``, ``"fp8_e4m3"`` (fp32 storage, fp8 compute).
"""

from __future__ import annotations

import functools
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autoprec.device import time_call
from autoprec.dtypes import FP8_COMPUTE, LOW_DTYPES, kernel_name, to_torch
from autoprec.metrics import median
from autoprec.search.gemms import Shape, matmul_shape_counts, matmul_shapes

__all__ = ["BAND_CONFIDENCE", "BAND_RESAMPLES", "KERNELS", "TOL", "KernelProbe", "KernelTime",
           "kernel_fields", "matmul_shape_counts", "matmul_shapes", "probe_kernels", "ratio_band",
           "time_kernel"]

#: Every kernel choice in its fixed order (a resumed study must see the same choices in the same
#: order, whatever a re-run's probe measures): per low storage dtype native, then fp32-compute; fp8 last.
KERNELS: tuple[str, ...] = (*(k for d in LOW_DTYPES for k in (d, kernel_name(d, "fp32"))), FP8_COMPUTE)
#: Noise allowance of the keep rule: a kernel with low-precision storage is kept when its time is
#: at most ``fp32 time * (1 + TOL)``. 10%: the spread of repeated medians of one matmul on a
#: loaded 2-core CPU, measured on this repository's machines. Such a kernel pays in memory even
#: at fp32 speed; a kernel that stores fp32 (``fp8_e4m3``) saves no memory and is kept only when
#: it measures faster than fp32.
TOL = 0.10
#: Bootstrap resamples of a kernel's ratio band (:func:`ratio_band`) and its confidence: a kernel
#: is kept when the band's low end is within the keep rule (unsure: kept, the search decides).
BAND_RESAMPLES = 200
BAND_CONFIDENCE = 0.95
#: Shape timed when the graph has no plain GEMM (convolutions, attention only): the hidden size of
#: the bundled example, compute-bound on a CPU core and milliseconds long.
DEFAULT_SHAPE = (512, 512, 512)

#: ``timer(kernel, (M, K, N), reps, stop_after_s) -> seconds of each timed call``.
Timer = Callable[[str, Shape, int, float], list[float]]


def kernel_fields(kernel: str) -> tuple[str, str | None]:
    """A kernel choice as a rule's ``(dtype, compute)``: ``"bf16"`` -> ``("bf16", None)``,
    ``"bf16:fp32"`` -> ``("bf16", "fp32")``, ``"fp8_e4m3"`` -> ``("fp8_e4m3", None)`` (the rule
    form of fp32 storage with fp8 compute, ``autoprec.policy.Rule``), ``"fp32"`` -> ``("fp32", None)``.

    Raises:
        ValueError: ``kernel`` is not ``"fp32"`` or one of :data:`KERNELS`; the message lists them.
    """
    if kernel != "fp32" and kernel not in KERNELS:
        raise ValueError(f"unknown kernel choice {kernel!r}; valid: fp32, {', '.join(KERNELS)}")
    dtype, _, compute = kernel.partition(":")
    return dtype, compute or None


def time_kernel(kernel: str, shape: Shape, reps: int, stop_after_s: float,
                device: torch.device | str = "cpu") -> list[float]:
    """Seconds of one ``[M, K] @ [K, N]`` product by ``kernel`` on ``device``
    (:func:`autoprec.device.time_call`: a warm-up, up to ``reps`` timed calls, early stop).

    ``"fp32"``: fp32 product. ``d``: inputs stored in ``d``, product in ``d``. ``d:fp32``: inputs
    stored in ``d``, upcast, fp32 product (the store cast of the result is not timed: in compiled
    training Inductor fuses it into the consumer's elementwise kernel, as it fuses the upcasts into
    the producers', so this is the upper end of what the kernel costs there). ``fp8_e4m3``: fp32 inputs
    through :func:`autoprec.kernels.fp8.fp8_linear` (amax, scales and quantisation included).

    Raises:
        ValueError: unknown kernel. Whatever the kernel raises (e.g. RuntimeError: no kernel for a dtype).
    """
    dtype, compute = kernel_fields(kernel)
    m, k, n = shape
    a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
    if dtype == FP8_COMPUTE:
        from autoprec.kernels.fp8 import fp8_linear

        w = b.t().contiguous()
        fn: Callable[[], object] = lambda: fp8_linear(a, w)
    elif compute == "fp32":
        d = to_torch(dtype)
        ad, bd = a.to(d), b.to(d)
        fn = lambda: ad.float() @ bd.float()
    else:
        ad, bd = a.to(to_torch(dtype)), b.to(to_torch(dtype))
        fn = lambda: ad @ bd
    return time_call(fn, device, reps, stop_after_s)


@dataclass(frozen=True)
class KernelTime:
    """One kernel's measurement.

    Attributes:
        kernel: Kernel choice (:data:`KERNELS`). dtype: its low dtype (``bf16``, ``fp16``, ``fp8_e4m3``).
        seconds: Σ over the probed shapes of weight × median seconds of one call (inf if it failed).
        ratio: ``seconds`` / fp32's (< 1 is faster than fp32; inf if it failed).
        kept: Whether the keep rule (:data:`TOL`) keeps it, on the low end of ``band``.
        per_shape_s: Median seconds per probed shape (inf for a shape not timed).
        estimated: The wall-clock cap stopped it before every shape was timed; ``seconds``
            extrapolates from the shapes done at their measured FLOP rate.
        error: Why it failed to run ("" if it ran).
        band: ``(low, high)`` of ``ratio``, its :data:`BAND_CONFIDENCE` bootstrap band from the
            timed repeats (:func:`ratio_band`); inf when it failed.
    """

    kernel: str
    dtype: str
    seconds: float
    ratio: float
    kept: bool
    per_shape_s: tuple[float, ...] = ()
    estimated: bool = False
    error: str = ""
    band: tuple[float, float] = (math.inf, math.inf)

    @property
    def label(self) -> str:
        """``"native"`` or ``"fp32-compute"``."""
        return "fp32-compute" if kernel_fields(self.kernel)[1] == "fp32" else "native"

    def describe(self) -> str:
        """e.g. ``"native 92x slower"``, ``"fp32-compute 1.02x slower"``, ``"native failed: ..."``."""
        if self.error:
            return f"{self.label} failed: {self.error}"
        speed = f"{self.ratio:.3g}x slower" if self.ratio >= 1 else f"{1 / self.ratio:.3g}x faster"
        return f"{self.label} {'~' if self.estimated else ''}{speed}"


@dataclass(frozen=True)
class KernelProbe:
    """What :func:`probe_kernels` measured.

    Attributes:
        shapes: The probed ``(M, K, N)`` shapes. weights: How many times the model runs each.
        fp32_s: Weighted seconds of the fp32 product (the same sum as :attr:`KernelTime.seconds`).
        fp32_per_shape_s: fp32 median seconds per shape.
        kernels: Every kernel measured, in :data:`KERNELS` order.
        tol: The noise allowance used (:data:`TOL`).
    """

    shapes: tuple[Shape, ...]
    weights: tuple[float, ...]
    fp32_s: float
    fp32_per_shape_s: tuple[float, ...]
    kernels: dict[str, KernelTime]
    tol: float = TOL

    def kept(self) -> dict[str, list[str]]:
        """``{dtype: its kept kernels, fastest first}`` for the dtypes kept, fastest dtype first
        (by its fastest kept kernel)."""
        by: dict[str, list[KernelTime]] = {}
        for t in self.kernels.values():
            if t.kept:
                by.setdefault(t.dtype, []).append(t)
        order = sorted(by, key=lambda d: min(t.seconds for t in by[d]))
        return {d: [t.kernel for t in sorted(by[d], key=lambda t: t.seconds)] for d in order}

    def excluded(self) -> dict[str, str]:
        """``{dtype: measured reason}`` for the dtypes probed and not kept, e.g.
        ``{"fp16": "native 92x slower, fp32-compute 1.4x slower"}``."""
        kept = self.kept()
        out: dict[str, list[str]] = {}
        for t in self.kernels.values():
            if t.dtype not in kept:
                out.setdefault(t.dtype, []).append(t.describe())
        return {d: ", ".join(parts) for d, parts in out.items()}

    def describe(self, dtype: str) -> str:
        """One dtype's kernels side by side, e.g. ``"native 0.712 ms (0.22x fp32), fp32-compute
        3.3 ms (1.03x fp32)"`` (``~``: extrapolated after the wall-clock cap)."""
        parts = []
        for t in self.kernels.values():
            if t.dtype != dtype:
                continue
            lo, hi = t.band
            band = f", band {lo:.2f}-{hi:.2f}" if math.isfinite(hi) and hi - lo >= 0.005 else ""
            unsure = ("; kept: within its noise band" if t.kept and not _keeps(t.kernel, t.ratio, self.tol)
                      else "")
            parts.append(f"{t.label} failed ({t.error})" if t.error else
                         f"{t.label} {'~' if t.estimated else ''}{t.seconds * 1e3:.3g} ms "
                         f"({t.ratio:.2f}x fp32{band}{unsure})")
        return ", ".join(parts)

    def low_dtypes(self) -> list[str]:
        """The kept low dtypes, fastest first."""
        return list(self.kept())

    def low_kernels(self, dtypes: Sequence[str] | None = None) -> list[str]:
        """The kernels the search chooses from, fastest first: the kept ones; or with ``dtypes``
        (``--dtypes``: searched whatever they measured) the native kernel of each (the dtype's
        own name, fastest first), then every other kernel of those dtypes that ran, kept or not:
        the choices then do not depend on timing noise, so workers forcing the same ``--dtypes``
        share a study whatever their probes measured."""
        by_time = sorted(self.kernels.values(), key=lambda t: t.seconds)
        if dtypes is None:
            return [t.kernel for t in by_time if t.kept]
        native = sorted(dtypes, key=lambda d: self.kernels[d].seconds if d in self.kernels else 0.0)
        return [*dict.fromkeys(native), *(t.kernel for t in by_time if not t.error and t.dtype in dtypes
                                          and t.kernel not in native)]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: shapes, weights, fp32 ms, per kernel ms/ratio/kept, per dtype the kept
        kernels or the reason (non-finite numbers as None)."""
        ms = lambda s: s * 1e3 if math.isfinite(s) else None
        kept, excluded = self.kept(), self.excluded()
        return {
            "shapes": [list(s) for s in self.shapes], "weights": list(self.weights), "tol": self.tol,
            "fp32": {"ms": ms(self.fp32_s), "per_shape_ms": [ms(s) for s in self.fp32_per_shape_s]},
            "kernels": {k: {"dtype": t.dtype, "ms": ms(t.seconds),
                            "ratio": t.ratio if math.isfinite(t.ratio) else None, "kept": t.kept,
                            "band": [b if math.isfinite(b) else None for b in t.band],
                            "estimated": t.estimated, "per_shape_ms": [ms(s) for s in t.per_shape_s],
                            "error": t.error} for k, t in self.kernels.items()},
            "dtypes": {d: {"kept": kept.get(d, []), "reason": excluded.get(d, "")}
                       for d in dict.fromkeys(t.dtype for t in self.kernels.values())},
        }


def _fp8_available(device: torch.device) -> bool:
    """:func:`autoprec.kernels.fp8.fp8_supported`'s verdict (its ``(ok, reason)``'s ``ok``: the
    tuple itself is always truthy); False when that module is missing."""
    try:
        from autoprec.kernels.fp8 import fp8_supported
    except ImportError:
        return False
    ok, _reason = fp8_supported(device)
    return bool(ok)


def _keeps(kernel: str, ratio: float, tol: float) -> bool:
    """The keep rule (:data:`TOL`) on a kernel's time / fp32's: at most ``1 + tol`` for
    low-precision storage; fp32 storage (fp8 compute) saves no memory, so below 1. The probe
    applies it to the low end of the ratio's band (:func:`ratio_band`)."""
    return ratio < 1.0 if kernel_fields(kernel)[0] == FP8_COMPUTE else ratio <= 1.0 + tol


def ratio_band(kernel_reps: Sequence[Sequence[float]], fp32_reps: Sequence[Sequence[Sequence[float]]],
               shapes: Sequence[Shape], weights: Sequence[float], resamples: int = BAND_RESAMPLES,
               confidence: float = BAND_CONFIDENCE, seed: int = 0) -> tuple[float, float]:
    """The ``confidence`` bootstrap band (percentiles, ``resamples`` draws, seeded) of a kernel's
    weighted time / fp32's, the probe's statistic redrawn from its own repeats: per shape the
    median of the kernel's timed calls resampled, over fp32's the mean of the medians of its runs
    (before and after the kernels), each resampled; weighted as :func:`probe_kernels` weighs them.

    Args:
        kernel_reps: Per shape the kernel's seconds per call (empty: not timed, extrapolated).
        fp32_reps: Per shape fp32's runs, each a list of seconds per call.
        shapes, weights: As :func:`probe_kernels`.

    Returns:
        ``(low, high)``, unitless ratios (inf when nothing was timed).
    """
    rng = random.Random(seed)

    def draw(v: Sequence[float]) -> float:
        return median(rng.choices(v, k=len(v)))

    def ratio() -> float:
        k = _weighted([draw(v) if v else math.inf for v in kernel_reps], shapes, weights)
        return k / _weighted([sum(draw(r) for r in runs) / len(runs) for runs in fp32_reps], shapes, weights)

    ratios = sorted(ratio() for _ in range(resamples))
    alpha, n = (1 - confidence) / 2, len(ratios)
    return ratios[min(int(alpha * n), n - 1)], ratios[max(math.ceil((1 - alpha) * n) - 1, 0)]


def _measure(timer: Timer, kernels: Sequence[str], shapes: Sequence[Shape], weights: Sequence[float],
             reps: int, budget_s: float, tol: float
             ) -> tuple[list[list[list[float]]], dict[str, list[list[float]]], set[str], dict[str, str]]:
    """Seconds per call per shape: shape by shape, fp32 before and after the kernels (the mean of
    their medians is fp32's time there), so each kernel is compared with fp32 under the same load.
    A kernel gets ``budget_s`` of wall clock over all shapes; once it is spent and the kernel is
    already slower than the keep rule allows over the shapes done (its medians), its remaining
    shapes are skipped (not timed: extrapolated).

    Returns:
        ``(fp32 per shape [before, after] seconds per call, {kernel: per shape seconds per call
        (empty: not timed)}, kernels cut short, {kernel: error})``.
    """
    fp32: list[float] = []
    fp32_reps: list[list[list[float]]] = []
    meds: dict[str, list[float]] = {k: [] for k in kernels}
    raw: dict[str, list[list[float]]] = {k: [] for k in kernels}
    spent, cut, errors = dict.fromkeys(kernels, 0.0), set(), {}
    for i, shape in enumerate(shapes):
        fp32_reps.append([list(timer("fp32", shape, reps, budget_s))])
        for k in kernels:
            raw[k].append([])
            left = budget_s - spent[k]
            if left <= 0 and i and k not in errors and not _keeps(k, _weighted(meds[k], shapes[:i], weights)
                                                                 / _weighted(fp32, shapes[:i], weights), tol):
                cut.add(k)
            if k in errors or k in cut:
                meds[k].append(math.inf)
                continue
            t0 = time.perf_counter()
            try:
                raw[k][-1] = list(timer(k, shape, reps, max(left, 0.0)))
                meds[k].append(median(raw[k][-1]))
            except Exception as e:  # no kernel for this dtype on this device/build
                errors[k] = f"{type(e).__name__}: {e}"
                meds[k].append(math.inf)
            spent[k] += time.perf_counter() - t0
        fp32_reps[-1].append(list(timer("fp32", shape, reps, budget_s)))
        fp32.append(sum(median(r) for r in fp32_reps[-1]) / 2)
    return fp32_reps, raw, cut, errors


def _weighted(meds: Sequence[float], shapes: Sequence[Shape], weights: Sequence[float]) -> float:
    """Σ weight × seconds; untimed (inf) shapes extrapolated at the timed shapes' FLOP rate."""
    flops = [w * m * k * n for (m, k, n), w in zip(shapes, weights)]
    timed = [(s, f, w) for s, f, w in zip(meds, flops, weights) if math.isfinite(s)]
    total = sum(w * s for s, _f, w in timed)
    done_flops = sum(f for _s, f, _w in timed)
    return total * sum(flops) / done_flops if timed and done_flops else math.inf


def probe_kernels(device: torch.device, shapes: Sequence[Shape] = (), reps: int = 5, budget_s: float = 1.0,
                  fp8: bool | None = None, weights: Sequence[float] | None = None, tol: float = TOL,
                  timer: Timer | None = None) -> KernelProbe:
    """Time every low-precision kernel against fp32 at ``shapes`` on ``device``; apply the keep rule.

    Args:
        device: Target device.
        shapes: ``(M, K, N)`` GEMM shapes (:func:`matmul_shapes`); empty: :data:`DEFAULT_SHAPE`.
        reps: Timed calls per shape and kernel after a warm-up (median taken).
        budget_s: Wall-clock cap per kernel over all shapes, so an emulated dtype (bf16 on an AVX2
            CPU, ~90x slower) costs about this: once spent, each further shape is called once, or
            skipped (its time extrapolated) when the kernel is already too slow.
        fp8: Probe ``fp8_e4m3``; None asks :func:`autoprec.kernels.fp8.fp8_supported` (a missing
            module counts as unsupported).
        weights: How many times the model runs each shape (default 1 each:
            :func:`matmul_shape_counts`); the probe's time is Σ weight × median seconds.
        tol: Noise allowance of the keep rule (:data:`TOL`): a kernel is kept when the low end of
            its ratio's band (:func:`ratio_band`, which contains the ratio) is at most 1 + tol, i.e.
            when it may be within noise of fp32 × (1 + tol): unsure is kept, the search decides;
            an fp8 kernel (fp32 storage) only when that low end is below 1.
        timer: ``timer(kernel, shape, reps, stop_after_s) -> [seconds]``; default
            :func:`time_kernel` on ``device`` (tests inject a mock).

    Returns:
        :class:`KernelProbe`. A kernel that raises is recorded with its error and not kept.

    Raises:
        Whatever the fp32 product raises (a device that cannot run fp32 matmuls).
    """
    shapes = tuple(tuple(s) for s in shapes) or (DEFAULT_SHAPE,)
    weights = tuple(weights) if weights is not None else (1.0,) * len(shapes)
    timer = timer or functools.partial(time_kernel, device=device)
    use_fp8 = _fp8_available(device) if fp8 is None else fp8
    kernels = [k for k in KERNELS if use_fp8 or k != FP8_COMPUTE]
    fp32_reps, raw, cut, errors = _measure(timer, kernels, shapes, weights, reps, budget_s, tol)
    fp32_meds = [sum(median(r) for r in runs) / len(runs) for runs in fp32_reps]
    fp32_s = _weighted(fp32_meds, shapes, weights)
    out = {}
    for k in kernels:
        meds = [median(v) if v else math.inf for v in raw[k]]
        dtype, s = kernel_fields(k)[0], _weighted(meds, shapes, weights)
        if k in errors:
            out[k] = KernelTime(k, dtype, math.inf, math.inf, False, error=errors[k])
            continue
        lo, hi = ratio_band(raw[k], fp32_reps, shapes, weights)
        band = (min(lo, s / fp32_s), max(hi, s / fp32_s))
        out[k] = KernelTime(k, dtype, s, s / fp32_s, _keeps(k, band[0], tol), tuple(meds), k in cut,
                            band=band)
    return KernelProbe(shapes, weights, fp32_s, tuple(fp32_meds), out, tol)
