"""Which kernels a ``tune`` searches (docs/architecture.md#search): phase 2's probe on the model's own
matmul shapes, or, when it resumes or joins a study, the kernels that study was created with. The
probe phase returns a frozen :class:`KernelChoice`; a study's kernels give a new one. How
torch.autocast's baseline runs given what the probe measured of its GEMMs is
:class:`autoprec.search.autocast_baseline.AutocastBaseline`'s."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from autoprec.device import autocast_dtype
from autoprec.dtypes import LOW_DTYPES, NAMES, to_torch
from autoprec.search.autocast_baseline import AutocastBaseline, autocast_gemms_in_fp32
from autoprec.search.gemms import Shape, native_low_counts
from autoprec.search.probe import kernel_fields, matmul_shape_counts, matmul_shapes, probe_kernels
from autoprec.search.progress import log
from autoprec.search.space import SearchSpace, find_blocks, has_attention, outside_matmuls

__all__ = ["KernelChoice", "adopt_study_kernels", "autocast_usable", "native_gemm_floor_s", "probe_decision",
           "probe_phase", "sensitivity_gemms", "trial_cannot_win"]


@dataclass(frozen=True)
class KernelChoice:
    """What the probe phase decided: the kernels searched and the space over them, and
    torch.autocast's dtype.

    Attributes:
        probes: ``KernelProbe.to_dict()`` of this run's probe (ratios to fp32, bands, verdicts).
        space: The search space (its kernels fastest first).
        ac_dtype: torch.autocast's low dtype (:func:`autoprec.device.autocast_dtype` over
            :func:`autocast_usable`).
        forced: ``--dtypes`` when given, else None (the probe decided).
    """

    probes: dict[str, Any]
    space: SearchSpace
    ac_dtype: torch.dtype
    forced: list[str] | None = None

    def autocast(self, slow_s: float) -> AutocastBaseline:
        """torch.autocast as the baseline on this device, under the slow-step limit ``slow_s``
        (seconds): :meth:`AutocastBaseline.from_probes` of this probe."""
        return AutocastBaseline.from_probes(self.probes, self.ac_dtype, slow_s)


def probe_phase(gm: torch.fx.GraphModule, dev: torch.device, clock: Callable[[str], AbstractContextManager],
                forced: list[str] | None, saved: tuple[str, ...] = (), quiet: bool = False) -> KernelChoice:
    """Phase 2: time each low dtype's kernels (native, fp32-compute, fp8) against fp32 at the
    model's own matmul shapes (:mod:`autoprec.search.probe`, on ``dev``; its seconds go to
    ``clock("probe_s")``); the kernels searched (fastest first; ``forced``: ``--dtypes``), the search
    space over them (``saved``: the memory levers searched) and torch.autocast's dtype
    (:func:`autoprec.device.autocast_dtype` over :func:`autocast_usable`)."""
    counts = matmul_shape_counts(gm)
    shapes = matmul_shapes(gm)
    with clock("probe_s"):
        probe = probe_kernels(dev, shapes, weights=[counts[s] for s in shapes])
    where = (", ".join(f"{m}x{k}x{n} x{counts[(m, k, n)]}" for m, k, n in shapes)
             or "512x512x512 (no GEMM found)")
    log(f"probe fp32: {probe.fp32_s * 1e3:.3g} ms of matmuls at the model's shapes (MxKxN x count: {where})",
        quiet)
    kept, excluded = probe.kept(), probe.excluded()
    for dtype in dict.fromkeys(t.dtype for t in probe.kernels.values()):
        if forced is not None:
            verdict = "searched (--dtypes)" if dtype in forced else "not searched (--dtypes)"
        else:
            verdict = (f"searched: {', '.join(kept[dtype])}" if dtype in kept
                       else f"excluded: {excluded[dtype]}")
        log(f"probe {dtype}: {probe.describe(dtype)} -> {verdict}", quiet)
    kernels = probe.low_kernels(forced)
    blocks = find_blocks(gm)
    ac_dtype = autocast_dtype(dev, autocast_usable(kernels, forced))
    space = SearchSpace(kernels, blocks, outside_matmuls(gm, blocks), saved=saved,
                        attention=has_attention(gm), twin_dtype=NAMES[ac_dtype])
    return KernelChoice(probe.to_dict(), space, ac_dtype, forced)


def autocast_usable(kernels: list[str], forced: list[str] | None = None) -> list[str]:
    """The low dtypes torch.autocast may run as the budget's baseline, given the ``kernels``
    searched (fastest first): with ``forced`` (``--dtypes``) the storage dtypes of those kernels,
    as the user named them; otherwise only the dtypes whose *native* kernel is searched. torch.autocast
    runs native GEMMs, so a kept fp32-compute kernel (``"fp16:fp32"``) says nothing about it; and
    such a kernel measures ~1.0-1.4x fp32 on an AVX2-only CPU, kept or not from one probe to the
    next, which switched torch.autocast (and so the drift budget, ~9x apart) between bf16 and fp16
    with the same command. Passed as ``usable`` to :func:`autoprec.device.autocast_dtype`; empty:
    torch's default."""
    if forced is not None:
        return list(dict.fromkeys(kernel_fields(k)[0] for k in kernels if kernel_fields(k)[0] in LOW_DTYPES))
    return [k for k in kernels if k in LOW_DTYPES]


def adopt_study_kernels(kc: KernelChoice, gm: torch.fx.GraphModule, dev: torch.device,
                        choices: list[str] | None, quiet: bool = False) -> KernelChoice:
    """Search the kernels an existing study was created with (its :data:`attrs.SPACE` stamp) when
    this run's probe (``--dtypes auto``) kept others, and say so: the study's name does not depend
    on the probe (:func:`autoprec.search.storage.default_study_name`), so a resumed or joining run
    reuses the first run's decision; Optuna cannot change a parameter's choices within a study,
    and a kernel near the keep rule's 10% line (fp32-compute kernels measure ~1.0–1.2x) falls on
    either side from one probe to the next. Every kernel runs on every device; the trials measure
    its speed. The order (fastest first, for the baselines) is this run's probe's, and
    torch.autocast's dtype is chosen over the study's kernels (:func:`autocast_usable`, on
    ``dev``). Returns ``kc`` itself when there is nothing to adopt, else the study's choice
    (``gm``: the captured graph, for the blocks of a space that had no low kernels)."""
    if kc.forced is not None or choices is None or choices == kc.space.dtypes:
        return kc  # --dtypes forces the space: check_study refuses a study of other choices
    ms = {k: (v.get("ms") or math.inf) for k, v in kc.probes.get("kernels", {}).items()}
    lows = sorted(choices[1:], key=lambda k: ms.get(k, math.inf))
    log(f"resuming a study created searching {', '.join(choices)}; this run's probe kept "
        f"{', '.join(kc.space.dtypes)}: searching the study's kernels (its probe's decision)", quiet)
    blocks = kc.space.blocks or find_blocks(gm)  # a space without low kernels holds no blocks
    nodes = kc.space.nodes or outside_matmuls(gm, blocks)
    ac_dtype = autocast_dtype(dev, autocast_usable(lows))
    # the graph's attention, not this run's space's: a space without low kernels has no attention choice
    space = SearchSpace(lows, blocks, nodes, saved=kc.space.saved[1:],
                        attention=has_attention(gm), twin_dtype=NAMES[ac_dtype])
    return KernelChoice(kc.probes, space, ac_dtype, kc.forced)


def probe_decision(probes: dict[str, Any]) -> dict[str, Any]:
    """What a new study records of the probe that chose its kernels (``KernelProbe.to_dict``):
    the keep rule's tolerance and per kernel its ratio to fp32's time, band and verdict."""
    return {"tol": probes.get("tol"), "kernels": {k: {f: v.get(f) for f in ("ratio", "band", "kept", "error")}
                                                  for k, v in probes.get("kernels", {}).items()}}


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


def sensitivity_gemms(kc: KernelChoice, quiet: bool = False) -> torch.dtype | None:
    """The dtype whose GEMMs phase 4's sensitivity computes as fp32 products rounded to it
    (:func:`autoprec.search.trials.region_sensitivity`'s ``fp32_gemms``), said in the log: its
    kernel, the first searched (``kc.space.low_dtypes[0]``), is native and the probe measured it
    :data:`~autoprec.search.autocast_baseline.EMULATE_AT` or more times the fp32-compute kernel's time
    (:func:`~autoprec.search.autocast_baseline.autocast_gemms_in_fp32`, torch.autocast's rule). None
    otherwise (the sensitivity then runs the kernel itself)."""
    low = kc.space.low_dtypes[0] if kc.space.low_dtypes else None
    dtype, compute = kernel_fields(low) if low is not None else (None, None)
    if dtype not in LOW_DTYPES or compute is not None:
        return None
    why = autocast_gemms_in_fp32(kc.probes, to_torch(dtype))
    if why is not None:
        log(f"sensitivity: {dtype} GEMMs computed as fp32 products rounded once to {dtype}, the same "
            f"roundings ({why})", quiet)
    return to_torch(dtype) if why is not None else None


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


