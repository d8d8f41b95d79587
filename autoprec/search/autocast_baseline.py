"""torch.autocast as the baseline, built in one place (docs/architecture.md#how-a-policy-is-chosen):
how it runs on this device, decided once from the kernel probe, and its measurements.

The device decides two things, both read off the probe's timings of torch.autocast's native GEMMs
at the model's own matmul shapes (:mod:`autoprec.search.probe`), never from a device rule:

- **Emulated drift** (:attr:`AutocastBaseline.emulated`): where its dtype's native GEMMs take
  :data:`EMULATE_AT` or more times the fp32-compute kernel's time (an AVX2-only CPU: ~30-90x),
  its drift passes and its trajectory compute those GEMMs as fp32 products rounded as the native
  kernel rounds (:class:`autoprec.kernels.fp32_gemms.Fp32ComputeGemms`: the same numbers at fp32's
  speed); its speed is timed natively.
- **Cannot win** (:attr:`AutocastBaseline.cannot_win`): where the native GEMMs of one forward alone
  take longer than the slow-step limit, its native steps are not run at all: it cannot be the
  baseline to beat (fp32 + torch.compile is), so it is neither compiled nor timed, and the autocast
  twin is not forced among the finalists.

No other module asks the device: the contest (:mod:`autoprec.search.contest`), the trajectory check
and the report ask this object.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from autoprec.dtypes import NAMES, kernel_name
from autoprec.measure import Harness, Measurement, Outcome
from autoprec.search.drift_budget import DriftBudget
from autoprec.search.progress import log
from autoprec.training.train import autocast_scaler

__all__ = ["EMULATE_AT", "AutocastBaseline", "autocast_cannot_win", "autocast_gemms_in_fp32"]

#: torch.autocast's drift passes compute its GEMMs as fp32 products
#: (:class:`autoprec.kernels.fp32_gemms.Fp32ComputeGemms`, the same roundings) when the probe
#: measured its dtype's native kernel at least this many times the fp32-compute kernel's time
#: (band against band): below that, native passes cost little more and run as users run them.
#: An AVX2-only CPU measures ~60-90x (``benchmarks/results/avx2_autocast_2026-12-05``).
EMULATE_AT = 2.0


def autocast_gemms_in_fp32(probes: dict[str, Any], ac_dtype: Any) -> str | None:
    """Why torch.autocast's drift passes (and the sensitivity's,
    :func:`autoprec.search.kernel_choice.sensitivity_gemms`) compute its GEMMs in fp32 (the probe
    measured the native ``ac_dtype`` kernel :data:`EMULATE_AT` or more times slower than the
    fp32-compute one: the low end of the native band over the high end of the other's), e.g.
    ``"native bf16 GEMMs measured 63.9x fp32's time, fp32-compute 1.06x"``; None when they run
    natively (or either kernel failed or was not probed). ``probes`` is ``KernelProbe.to_dict()``;
    its speed is always timed natively."""
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


def autocast_cannot_win(probes: dict[str, Any], ac_dtype: Any, slow_s: float) -> str | None:
    """Why torch.autocast cannot be the baseline to beat, eager or compiled, so its native steps are
    not run: the probe's native ``ac_dtype`` GEMMs at the model's forward matmul shapes alone take
    longer than ``slow_s`` seconds, the slow-step limit past which a configuration stops being timed
    because it cannot win (``autoprec.search.study.SLOW_RATIO`` fp32 eager steps). None otherwise,
    or when the native kernel failed or was not probed.

    The bound is fp32's GEMM seconds (``probes["fp32"]["ms"]``) times the low end of the native
    kernel's ratio band; torch.compile keeps those GEMMs (Inductor's default mode calls the same
    ATen GEMM kernels; its own GEMM templates are max-autotune's). An AVX2-only CPU measured native
    bf16 GEMMs 39-61x fp32's (``benchmarks/results/depth_2026-12-05f_schemas``): a 24-layer Qwen2's
    forward GEMMs alone ~6.7 s against a 1.70 s limit. ``probes`` is ``KernelProbe.to_dict()``.
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


@dataclass(frozen=True)
class AutocastBaseline:
    """torch.autocast at ``dtype`` on this device: what a user gets with ``torch.autocast`` (+
    ``torch.compile``), and how autoprec measures it here.

    Build it with :meth:`from_probes`. Frozen: the probe's decision does not change within a tune.

    Attributes:
        dtype: torch.autocast's low dtype (:func:`autoprec.device.autocast_dtype`).
        emulated: Why its drift passes and trajectory compute its GEMMs in fp32, rounded as native
            ones round (:func:`autocast_gemms_in_fp32`), or None: they run natively.
        cannot_win: Why its native steps are not run at all (:func:`autocast_cannot_win`), or None.
    """

    dtype: torch.dtype
    emulated: str | None = None
    cannot_win: str | None = None

    @classmethod
    def from_probes(cls, probes: dict[str, Any], dtype: torch.dtype,
                    slow_s: float = math.inf) -> AutocastBaseline:
        """The baseline as the kernel probe (``KernelProbe.to_dict()``) says it runs here, under the
        slow-step limit ``slow_s`` (seconds)."""
        return cls(dtype, autocast_gemms_in_fp32(probes, dtype), autocast_cannot_win(probes, dtype, slow_s))

    def scaler_factory(self) -> Any:
        """A factory of torch.autocast's loss scaler (``torch.amp.GradScaler``'s rule for fp16,
        :func:`autoprec.training.train.autocast_scaler`)."""
        return autocast_scaler(self.dtype)

    def in_contest(self, random: bool) -> bool:
        """Whether torch.autocast + torch.compile (eager without compile) is built and measured in
        the finalists' contest: unless it cannot win on a graph that draws no random numbers (on
        one that does, its compiled drift is the budget: :meth:`compiled_budget`)."""
        return not (self.cannot_win and not random)

    def drift_on_batch_0(self, compile: bool, timed: bool, random: bool) -> str | None:
        """Why torch.autocast + torch.compile's drift stops after batch 0 (:attr:`emulated`: its
        native GEMMs are slow; batch 0 compiles it and gives its peak), or None: all K batches run
        when it is not compiled, when ``timed`` (its timed steps would be skipped) and when the
        graph draws random numbers (its drift over every batch is then the compiled budget)."""
        if not (compile and self.emulated) or timed or random:
            return None
        return f"drift on batch 0 only ({self.emulated})"

    def trajectory_emulated(self, random: bool) -> bool:
        """Whether its trajectory (the trajectory check's budget) runs eagerly with its GEMMs in fp32
        (:attr:`emulated`), instead of K native steps; not on a graph that draws random numbers,
        whose compiled reference needs torch.autocast compiled (Inductor's masks)."""
        return bool(self.emulated) and not random

    def measure_eager(self, h: Harness, slow_s: float, quiet: bool) -> Measurement:
        """Phase 3's torch.autocast eager baseline, screened as the fp32 one is: its drift (the
        budget's reference) and memory, and its speed from its drift passes. Without compile the
        head-to-head times it again; with compile its speed is only the table's "autocast eager"
        row. Emulated drift passes (:attr:`emulated`) take one native step, stopped by the slow-step
        guard at ``slow_s``, to time it; where it :attr:`cannot_win` it is not timed at all and its
        note says why. Never raises for numerics: a failure is the measurement's ``outcome``."""
        if self.emulated:
            log(f"torch.autocast's drift is measured with its GEMMs computed in fp32, rounded as native ones "
                f"round ({self.emulated}); its speed " + (
                    "is not timed: it cannot win" if self.cannot_win else "is timed natively"), quiet)
        m = h.measure(h.model, self.scaler_factory(), autocast_dtype=self.dtype,
                      timing=not self.cannot_win, max_step_s=slow_s, screen=True,
                      fp32_gemms=bool(self.emulated))
        if self.emulated:
            m.add_note("drift with its GEMMs in fp32", first=True)
        if self.cannot_win:
            m.add_note(f"not timed: {self.cannot_win}")
        return m

    def measure_in_contest(self, h: Harness, fn: Any, compile: bool, slow_s: float) -> Measurement:
        """torch.autocast's measurement in the contest: ``fn`` (its module, compiled unless
        ``compile`` is False) measured for drift and memory (its speed is taken in the
        head-to-head's rounds; on CUDA also timed now, whose peak is read after timed steps), its
        drift cut after batch 0 where :meth:`drift_on_batch_0` says so (the note says why)."""
        timed = h.device.type == "cuda"
        one = self.drift_on_batch_0(compile, timed, h.random)
        m = h.measure(fn, self.scaler_factory(), autocast_dtype=self.dtype, timing=timed,
                      max_step_s=slow_s, cut=(lambda _m: Outcome.cut(one)) if one else None)
        m.add_note(m.cut)
        return m

    def not_run(self) -> Measurement:
        """The empty measurement of torch.autocast + torch.compile where it is not run (not
        :meth:`in_contest`): its table row, whose note says why."""
        return Measurement(note=f"not compiled: {self.cannot_win}")

    @staticmethod
    def compiled_budget(m: Measurement, budget: DriftBudget, random: bool) -> DriftBudget | None:
        """On a graph that draws random numbers (dropout), the drift budget compiled finalists are
        judged by: ``--max-drift auto``'s rule against torch.autocast + torch.compile's drift ``m``
        (both sides measured compiled against the compiled FP32 graph,
        :meth:`Harness.reference_fn`; torch.autocast with Inductor's defaults as users compile it,
        the finalists with ``INDUCTOR_OPTIONS``, whose ``emulate_precision_casts`` rounds their
        casts as eager's do). Written when compiled graphs drew Inductor's own masks (T5, dropout
        0.1: compiled autocast 7.0e-2 against eager autocast's 3.3e-2); the rule still compares
        compiled with compiled. None where it does not apply: no random numbers, a ``--max-drift
        X`` budget (the hard number stays), or ``m`` failed or is not finite."""
        if not (random and budget.rule == "auto" and not m.failed and m.grad_rel_l2_batches
                and all(math.isfinite(g) for g in m.grad_rel_l2_batches)):
            return None
        return DriftBudget.auto(m.grad_rel_l2_batches, budget.margin)

