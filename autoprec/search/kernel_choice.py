"""Which kernels a ``tune`` searches: phase 2's probe on the model's own matmul shapes, or, when
it resumes or joins a study, the kernels that study was created with; and how torch.autocast's
baseline runs given what the probe measured of its GEMMs (docs/architecture.md#search). Functions
of :func:`autoprec.search.study.tune`'s run state (``_Run``: its graph, device, clock, space,
probes, harness, ``slow``)."""

from __future__ import annotations

import math
from typing import Any

from autoprec.device import autocast_dtype
from autoprec.dtypes import LOW_DTYPES, NAMES, kernel_name, to_torch
from autoprec.measure import Measurement
from autoprec.search.gemms import Shape, native_low_counts
from autoprec.search.probe import kernel_fields, matmul_shape_counts, matmul_shapes, probe_kernels
from autoprec.search.progress import log
from autoprec.search.space import SearchSpace, find_blocks, has_attention, outside_matmuls
from autoprec.training.train import autocast_scaler

__all__ = ["EMULATE_AT", "adopt_study_kernels", "autocast_cannot_win", "autocast_gemms_in_fp32",
           "measure_autocast_eager", "native_gemm_floor_s", "probe_decision", "probe_phase",
           "sensitivity_gemms", "trial_cannot_win"]

#: torch.autocast's drift passes compute its GEMMs as fp32 products
#: (:class:`autoprec.kernels.fp32_gemms.Fp32ComputeGemms`, the same roundings) when the probe
#: measured its dtype's native kernel at least this many times the fp32-compute kernel's time
#: (band against band): below that, native passes cost little more and run as users run them.
#: An AVX2-only CPU measures ~60-90x (``benchmarks/results/avx2_autocast_2026-12-05``).
EMULATE_AT = 2.0


def probe_phase(run: Any, forced: list[str] | None, saved: tuple[str, ...] = ()) -> None:
    """Phase 2: time each low dtype's kernels (native, fp32-compute, fp8) against fp32 at the
    model's own matmul shapes (:mod:`autoprec.search.probe`); the kernels searched (fastest
    first), the search space over them, and torch.autocast's dtype
    (:func:`autoprec.device.autocast_dtype` over the kept storage dtypes, fastest first)."""
    run.forced = forced
    counts = matmul_shape_counts(run.gm)
    shapes = matmul_shapes(run.gm)
    with run.clock("probe_s"):
        probe = probe_kernels(run.dev, shapes, weights=[counts[s] for s in shapes])
    where = (", ".join(f"{m}x{k}x{n} x{counts[(m, k, n)]}" for m, k, n in shapes)
             or "512x512x512 (no GEMM found)")
    log(f"probe fp32: {probe.fp32_s * 1e3:.3g} ms of matmuls at the model's shapes (MxKxN x count: {where})",
        run.quiet)
    kept, excluded = probe.kept(), probe.excluded()
    for dtype in dict.fromkeys(t.dtype for t in probe.kernels.values()):
        if forced is not None:
            verdict = "searched (--dtypes)" if dtype in forced else "not searched (--dtypes)"
        else:
            verdict = (f"searched: {', '.join(kept[dtype])}" if dtype in kept
                       else f"excluded: {excluded[dtype]}")
        log(f"probe {dtype}: {probe.describe(dtype)} -> {verdict}", run.quiet)
    kernels = probe.low_kernels(forced)
    storage_lows = list(dict.fromkeys(kernel_fields(k)[0] for k in kernels
                                      if kernel_fields(k)[0] in LOW_DTYPES))
    blocks = find_blocks(run.gm)
    run.probes = probe.to_dict()
    run.ac_dtype = autocast_dtype(run.dev, storage_lows)
    run.space = SearchSpace(kernels, blocks, outside_matmuls(run.gm, blocks), saved=saved,
                            attention=has_attention(run.gm), twin_dtype=NAMES[run.ac_dtype])


def adopt_study_kernels(run: Any, choices: list[str] | None) -> None:
    """Search the kernels an existing study was created with (its :data:`attrs.SPACE` stamp) when
    this run's probe (``--dtypes auto``) kept others, and say so: the study's name does not depend
    on the probe (:func:`autoprec.search.storage.default_study_name`), so a resumed or joining run
    reuses the first run's decision; Optuna cannot change a parameter's choices within a study,
    and a kernel near the keep rule's 10% line (fp32-compute kernels measure ~1.0–1.2x) falls on
    either side from one probe to the next. Every kernel runs on every device; the trials measure
    its speed. The order (fastest first, for the baselines) is this run's probe's, and
    torch.autocast's dtype is chosen over the study's storage dtypes."""
    if run.forced is not None or choices is None or choices == run.space.dtypes:
        return  # --dtypes forces the space: check_study refuses a study of other choices
    ms = {k: (v.get("ms") or math.inf) for k, v in run.probes.get("kernels", {}).items()}
    lows = sorted(choices[1:], key=lambda k: ms.get(k, math.inf))
    log(f"resuming a study created searching {', '.join(choices)}; this run's probe kept "
        f"{', '.join(run.space.dtypes)}: searching the study's kernels (its probe's decision)", run.quiet)
    blocks = run.space.blocks or find_blocks(run.gm)  # a space without low kernels holds no blocks
    nodes = run.space.nodes or outside_matmuls(run.gm, blocks)
    storage_lows = list(dict.fromkeys(kernel_fields(k)[0] for k in lows if kernel_fields(k)[0] in LOW_DTYPES))
    run.ac_dtype = autocast_dtype(run.dev, storage_lows)
    run.space = SearchSpace(lows, blocks, nodes, saved=run.space.saved[1:],
                            attention=bool(run.space.attention), twin_dtype=NAMES[run.ac_dtype])


def probe_decision(probes: dict[str, Any]) -> dict[str, Any]:
    """What a new study records of the probe that chose its kernels (``KernelProbe.to_dict``):
    the keep rule's tolerance and per kernel its ratio to fp32's time, band and verdict."""
    return {"tol": probes.get("tol"), "kernels": {k: {f: v.get(f) for f in ("ratio", "band", "kept", "error")}
                                                  for k, v in probes.get("kernels", {}).items()}}


def autocast_gemms_in_fp32(probes: dict[str, Any], ac_dtype: Any) -> str | None:
    """Why torch.autocast's drift passes (and the sensitivity's, :func:`sensitivity_gemms`) compute
    its GEMMs in fp32 (the probe measured the native
    ``ac_dtype`` kernel :data:`EMULATE_AT` or more times slower than the fp32-compute one: the low
    end of the native band over the high end of the other's), e.g. ``"native bf16 GEMMs measured
    63.9x fp32's time, fp32-compute 1.06x"``; None when they run natively (or either kernel failed
    or was not probed). ``probes`` is ``KernelProbe.to_dict()``; its speed is always timed natively."""
    name = NAMES.get(ac_dtype)
    ks = probes.get("kernels", {})
    native, fp32c = ks.get(name or ""), ks.get(kernel_name(name, "fp32") if name else "")
    if not native or not fp32c or native.get("error") or fp32c.get("error"):
        return None
    low, high = native["band"][0], fp32c["band"][1]
    if low is None or high is None or not low >= EMULATE_AT * high:
        return None
    return (f"native {name} GEMMs measured {native['ratio']:.3g}x fp32's time, "
            f"fp32-compute {fp32c['ratio']:.3g}x")


def native_gemm_floor_s(probes: dict[str, Any], native: dict[str, dict[Shape, int]]) -> float:
    """A lower bound, in seconds per training step, of the native low-precision GEMMs ``native``
    (``{dtype name: {(M, K, N): count}}``, e.g. :func:`autoprec.search.gemms.native_low_counts`):
    Σ count × fp32's median seconds of one call at that shape (the probe's ``per_shape_ms``) × the
    low end of the native kernel's ratio band. Shapes the probe did not time count 0, and only
    the forward's GEMMs are given (a training step runs them once forward and twice as many in
    backward), so it stays a bound. 0.0 where a kernel failed or was not probed.
    ``probes`` is ``KernelProbe.to_dict()``."""
    shapes = [tuple(s) for s in probes.get("shapes", [])]
    per_shape = (probes.get("fp32") or {}).get("per_shape_ms") or []
    total = 0.0
    for name, counts in native.items():
        k = probes.get("kernels", {}).get(name)
        if not k or k.get("error") or k["band"][0] is None:
            continue
        total += sum(counts.get(s, 0) * ms / 1e3 * k["band"][0]
                     for s, ms in zip(shapes, per_shape, strict=False) if ms is not None)
    return total


def sensitivity_gemms(run: Any) -> Any:  # torch.dtype | None
    """The dtype whose GEMMs phase 4's sensitivity computes as fp32 products rounded to it
    (:func:`autoprec.search.trials.region_sensitivity`'s ``fp32_gemms``), said in the log: its
    kernel, the first searched (``run.space.low_dtypes[0]``), is native and the probe measured it
    :data:`EMULATE_AT` or more times the fp32-compute kernel's time (:func:`autocast_gemms_in_fp32`,
    torch.autocast's rule). None otherwise (the sensitivity then runs the kernel itself)."""
    low = run.space.low_dtypes[0] if run.space.low_dtypes else None
    dtype, compute = kernel_fields(low) if low is not None else (None, None)
    if dtype not in LOW_DTYPES or compute is not None:
        return None
    why = autocast_gemms_in_fp32(run.probes, to_torch(dtype))
    if why is not None:
        log(f"sensitivity: {dtype} GEMMs computed as fp32 products rounded once to {dtype}, the same "
            f"roundings ({why})", run.quiet)
    return to_torch(dtype) if why is not None else None


def autocast_cannot_win(probes: dict[str, Any], ac_dtype: Any, slow_s: float) -> str | None:
    """Why torch.autocast cannot be the baseline to beat, eager or compiled, so its native steps are
    not run: the probe's native ``ac_dtype`` GEMMs at the model's forward matmul shapes alone take
    longer than ``slow_s`` seconds, the slow-step limit past which a configuration stops being timed
    because it cannot win (``autoprec.search.study.SLOW_RATIO`` fp32 eager steps). None otherwise,
    or when the native kernel failed or was not probed.

    The bound is fp32's GEMM seconds (``probes["fp32"]["ms"]``) times the low end of the native
    kernel's ratio band (:func:`native_gemm_floor_s` with every GEMM native); torch.compile
    keeps those GEMMs (Inductor's default mode calls the same ATen GEMM kernels; its own GEMM
    templates are max-autotune's). An AVX2-only CPU measured native bf16 GEMMs 39-61x fp32's
    (``benchmarks/results/depth_2026-12-05f_schemas``): a 24-layer Qwen2's forward GEMMs alone
    ~6.7 s against a 1.70 s limit. ``probes`` is ``KernelProbe.to_dict()``.
    """
    name = NAMES.get(ac_dtype)
    native = probes.get("kernels", {}).get(name or "")
    fp32_ms = (probes.get("fp32") or {}).get("ms")
    if not native or native.get("error") or not fp32_ms or native["band"][0] is None:
        return None
    low_s, ratio = fp32_ms * native["band"][0] / 1e3, native["band"][0]
    if not low_s > slow_s:
        return None
    return (f"its native {name} GEMMs alone take {low_s:.3g} s or more per step (>= {ratio:.3g}x fp32's "
            f"{fp32_ms:.3g} ms at the model's forward shapes), over the {slow_s:.3g} s slow-step limit")


def trial_cannot_win(probes: dict[str, Any], gm: Any, slow_s: float) -> str | None:
    """Why a search trial is not run at all: the native low-precision GEMMs of its assigned graph
    ``gm`` (:func:`autoprec.search.gemms.native_low_counts`) alone take longer than ``slow_s``
    seconds per step by the probe's bound (:func:`native_gemm_floor_s`), so its first drift pass
    would trip the slow-step limit the screening cut applies from batch 0
    (:mod:`autoprec.search.screen_cut`), after seconds of native GEMMs (``tune --dtypes bf16`` on an
    AVX2 CPU: 9.3 s for one pass of a 24-layer Qwen2 in native bf16 against a 1.7 s limit). None
    when the bound is within the limit (or no native kernel was probed). E.g. ``"its 169 native bf16
    GEMMs alone take 6.9 s or more per step (the kernel probe's bound), over the 1.7 s slow-step
    limit"``."""
    native = native_low_counts(gm)
    floor = native_gemm_floor_s(probes, native)
    if not floor > slow_s:
        return None
    n = sum(sum(c.values()) for c in native.values())
    return (f"its {n} native {'/'.join(native)} GEMMs alone take {floor:.3g} s or more per step "
            f"(the kernel probe's bound), over the {slow_s:.3g} s slow-step limit")


def measure_autocast_eager(run: Any) -> Measurement:
    """Phase 3's torch.autocast eager baseline (``run.ac_dtype``), screened as the fp32 one is: its
    drift (the budget's reference) and memory, and its speed from its drift passes. Without compile
    the head-to-head times it again; with compile its speed is only the table's "autocast eager"
    row. Sets ``run.slow_gemms`` (:func:`autocast_gemms_in_fp32`: its drift passes then compute the
    GEMMs in fp32, same roundings, and one native step, stopped by the slow-step guard at
    ``run.slow``, times it) and ``run.ac_cannot_win`` (:func:`autocast_cannot_win`: not timed at
    all; its note says why). Never raises for numerics: a failure is the measurement's ``error``."""
    h = run.harness
    run.slow_gemms = autocast_gemms_in_fp32(run.probes, run.ac_dtype)
    run.ac_cannot_win = autocast_cannot_win(run.probes, run.ac_dtype, run.slow)
    if run.slow_gemms:
        log(f"torch.autocast's drift is measured with its GEMMs computed in fp32, rounded as native ones "
            f"round ({run.slow_gemms}); its speed " + (
                "is not timed: it cannot win" if run.ac_cannot_win else "is timed natively"), run.quiet)
    m = h.measure(h.model, autocast_scaler(run.ac_dtype), autocast_dtype=run.ac_dtype,
                  timing=not run.ac_cannot_win, max_step_s=run.slow, screen=True,
                  fp32_gemms=bool(run.slow_gemms))
    if run.slow_gemms:
        m.add_note("drift with its GEMMs in fp32", first=True)
    if run.ac_cannot_win:
        m.add_note(f"not timed: {run.ac_cannot_win}")
    return m
