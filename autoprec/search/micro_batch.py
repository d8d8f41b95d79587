"""The micro-batch searched with the policy and its memory lever (``tune --global-batch N``;
docs/architecture.md#micro-batch-and-memory-budget).

Memory a policy saves buys a larger micro-batch, and a larger micro-batch buys throughput: a
candidate here is a configuration (a baseline, the contest's policy, the policy with a memory
lever) at a micro-batch ``m`` dividing the global batch ``N``, trained with ``A = N / m`` micro-batches
accumulated per optimizer step (:mod:`autoprec.modelspec.micro_batches`).

- **Fit.** Each configuration runs at the largest micro-batch whose measured peak fits the memory
  budget (without one: ``N`` itself), as a user finds it by raising the batch until out of memory
  (Lightning's ``BatchSizeFinder``, accelerate's ``find_executable_batch_size``). Peaks are
  measured at the largest divisor of ``N`` not above the model file's batch and the next one
  above; the peak is close to affine in the micro-batch (activations scale with it, the fp32
  state does not), so the line through them predicts the largest fitting divisor, which is measured
  next. A prediction decides nothing: the micro-batch chosen fits, measured, and the next divisor of
  ``N`` does not, measured (or it is ``N``); a smaller divisor is measured when the predicted one is
  over, a larger one while the measured ones fit.
- **Drift.** Each fitted configuration's gradients accumulated over its ``A`` micro-batches are
  compared with the FP32 reference's on the same global batches (:meth:`Harness.global_drift`);
  with ``--max-drift auto`` the rule is the tune's rule against torch.autocast's accumulated drift
  measured the same way (:class:`~autoprec.search.drift_budget.DriftBudget`).
- **Speed.** Configurations are timed in interleaved rounds (:func:`autoprec.measure.time_interleaved`),
  each on its own micro-batches. A timed step is one micro-batch's forward/backward and an optimizer
  update, so one global step takes ``t_global = A * t_step - (A - 1) * t_update`` seconds
  (``t_update``: :meth:`Harness.update_seconds`, the update alone), and throughput is the global
  batch's tokens over ``t_global``; ``tests/search/test_micro_batch.py`` checks the formula against
  a timed global step.
- **Choice.** The fastest policy configuration within the drift and memory budgets is written with
  its ``Policy.batching`` (a tie within the noise: the lower-drift, simpler one, :func:`pick`; with
  compile fp32 + torch.compile takes part, written as all-fp32); the baseline to beat is the faster
  of torch.autocast + torch.compile and fp32 + torch.compile, each at its own largest fitting
  micro-batch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from autoprec.applied.compile import compile_graph
from autoprec.applied.saved import saved_eager
from autoprec.capture import autocast_dynamic
from autoprec.errors import SearchError
from autoprec.measure import Config, Harness, Outcome, time_interleaved
from autoprec.modelspec import ModelSpec
from autoprec.modelspec.micro_batches import MicroBatches, count_tokens, divisors
from autoprec.passes import run_pipeline
from autoprec.policy import REGIONAL_EMULATED, TORCH_COMPILE, Batching, Policy
from autoprec.search.autocast_baseline import AutocastBaseline
from autoprec.search.budgets import format_bytes
from autoprec.search.drift_budget import DriftBudget
from autoprec.search.gates import Role
from autoprec.search.progress import log
from autoprec.search.race import tie_key
from autoprec.search.space import with_saved, without_saved
from autoprec.training.train import make_scaler

__all__ = ["GLOBAL_DRIFT_STEPS", "LEVER_ORDER", "BatchConfig", "BatchPoint", "BatchSearch", "faster",
           "global_step_seconds", "pick"]

#: Global batches each fitted configuration's accumulated drift is measured on.
GLOBAL_DRIFT_STEPS = 2


def global_step_seconds(step_s: float, update_s: float, accumulation: int) -> float:
    """Seconds of one optimizer step over ``accumulation`` micro-batches, from the median seconds of
    a timed step (one micro-batch's forward/backward and an update, ``step_s``) and of the update
    alone (``update_s``): ``A * step_s - (A - 1) * update_s`` (the update runs once per global step)."""
    return accumulation * step_s - (accumulation - 1) * update_s


@dataclass(frozen=True)
class BatchConfig:
    """A configuration whose micro-batch is searched.

    Attributes:
        name: Its label (``"fp32 + torch.compile"``, ``"policy + saved bf16"``).
        role: BASELINE (a user's torch.compile, with or without torch.autocast) or POLICY.
        policy: The policy (POLICY), else None: the model compiled as a user compiles it.
        autocast_dtype: torch.autocast's dtype for the torch.autocast baseline, else None.
    """

    name: str
    role: Role
    policy: Policy | None = None
    autocast_dtype: torch.dtype | None = None


@dataclass
class BatchPoint:
    """A configuration measured at one micro-batch.

    Attributes:
        config: The :class:`BatchConfig`.
        micro_batch, accumulation: m and N / m.
        peak_bytes: Peak memory of a micro-step (bytes; docs/architecture.md#measurements).
        error: Why it failed, else None.
        drift: Accumulated ``grad_rel_l2`` per global batch (empty until measured).
        step_s, update_s: Median timed micro-step and the update alone (seconds; inf until timed).
        global_step_s: :func:`global_step_seconds` (seconds).
        tokens_per_s: Tokens of a global batch / ``global_step_s`` (0.0 until timed).
        tokens_per_s_band: The same from the ends of the timed step's 95% band (``Timing.band_s``).
        fits: Within the memory budget (always, without one).
        note: Why it is not a candidate (over the budget, over the drift budget), else "".
    """

    config: BatchConfig
    micro_batch: int
    accumulation: int
    peak_bytes: int = 0
    error: str | None = None
    drift: list[float] = field(default_factory=list)
    step_s: float = math.inf
    update_s: float = math.inf
    global_step_s: float = math.inf
    tokens_per_s: float = 0.0
    tokens_per_s_band: tuple[float, float] = (0.0, 0.0)
    fits: bool = True
    note: str = ""

    @property
    def label(self) -> str:
        """``"<config> @ micro-batch m x A"``."""
        return f"{self.config.name} @ {self.micro_batch}x{self.accumulation}"

    def row(self) -> dict[str, Any]:
        """The report's row (JSON-ready; inf as None)."""
        fin = lambda x: x if math.isfinite(x) else None  # noqa: E731
        return {"config": self.config.name, "role": self.config.role.value, "micro_batch": self.micro_batch,
                "accumulation": self.accumulation, "peak_bytes": self.peak_bytes, "fits": self.fits,
                "grad_rel_l2": fin(sum(self.drift) / len(self.drift)) if self.drift else None,
                "global_step_s": fin(self.global_step_s), "tokens_per_s": self.tokens_per_s,
                "tokens_per_s_band": list(self.tokens_per_s_band),
                "error": self.error, "note": self.note}


class BatchSearch:
    """Searches the micro-batch of each configuration and picks the fastest policy (module docstring).

    Args:
        spec: The model file. device: Where to run.
        global_batch: N (the model file's batch unit).
        memory_budget: Bytes, or None (every divisor fits).
        compile: Compile every configuration (else all run eagerly; baselines are then the eager model).
        autocast: torch.autocast on this device (:class:`AutocastBaseline`).
        budget: The tune's drift budget: its rule (auto: re-based on torch.autocast's accumulated
            drift; fixed: as it is).
        slow: The slow-step limit of a timed micro-step, seconds (None: none): a configuration over
            it (an emulated dtype) is dropped from the timing rounds.
        quiet: No log lines.
        file_harness: A harness over the model file itself (the tune's), used as the micro-batch
            harness where the micro-batches are the file's own batches
            (:attr:`MicroBatches.file_stream`): no second capture, model and FP32 references.

    Raises:
        ModelSpecError: the model file cannot give micro-batches (:class:`MicroBatches`).
    """

    def __init__(self, spec: ModelSpec, device: torch.device, global_batch: int, memory_budget: float | None,
                 compile: bool, autocast: AutocastBaseline, budget: DriftBudget, slow: float | None = None,
                 quiet: bool = False, file_harness: Harness | None = None) -> None:
        self.spec, self.device, self.n = spec, device, int(global_batch)
        self.memory_budget, self.compile, self.autocast = memory_budget, compile, autocast
        self.budget, self.slow, self.quiet = budget, slow, quiet
        self.file_batch = MicroBatches(spec, self.n, 1, device).file_batch  # checks the file once
        self._harness: dict[int, Harness] = {}
        self._file_harness = file_harness
        self._fn: dict[tuple[str, int], Any] = {}
        self.points: list[BatchPoint] = []

    @property
    def base(self) -> int:
        """The largest divisor of N not above the model file's batch (1 when none is): where fits
        start and torch.autocast's accumulated drift is measured."""
        return max([d for d in divisors(self.n) if d <= self.file_batch] or [1])

    # -- measuring --------------------------------------------------------------------------------
    def harness(self, m: int) -> Harness:
        """The harness whose batches are micro-batches of ``m`` (one drift batch: the drift that
        decides is :meth:`Harness.global_drift`'s), built once per ``m``."""
        if m not in self._harness:
            micro = MicroBatches(self.spec, self.n, m, self.device)
            self._harness[m] = (self._file_harness if self._file_harness is not None and micro.file_stream
                                else Harness(micro.micro_spec(), self.device, drift_batches=1))
        return self._harness[m]

    def _build(self, cfg: BatchConfig, m: int) -> Any:
        key = (cfg.name, m)
        if key not in self._fn:
            h = self.harness(m)
            if cfg.policy is None:
                fn = compile_graph(h.model, dynamic=autocast_dynamic(h.batches)) if self.compile else h.model
            else:
                lowered = run_pipeline(h.graph_module, cfg.policy).graph_module
                opts = cfg.policy.compile_options or REGIONAL_EMULATED
                fn = compile_graph(lowered, cfg.policy.activation_memory_budget, regional=opts.regional,
                                   emulate_precision_casts=opts.emulate_precision_casts) if self.compile \
                    else saved_eager(lowered)  # eagerly, its saved dtypes honoured as the contest runs it
            self._fn[key] = fn
        return self._fn[key]

    def _scaler_factory(self, cfg: BatchConfig) -> Callable[[], Any]:
        if cfg.policy is not None:
            return lambda: make_scaler(cfg.policy)
        return self.autocast.scaler_factory() if cfg.autocast_dtype is not None else (lambda: None)

    def point(self, cfg: BatchConfig, m: int) -> BatchPoint:
        """``cfg`` at micro-batch ``m``: built (compiled) and its peak measured on one micro-step
        (on CUDA the peak is read after timed steps). Never raises for a failed run: ``error``."""
        for p in self.points:
            if p.config == cfg and p.micro_batch == m:
                return p
        pt = BatchPoint(cfg, m, self.n // m)
        try:
            h, fn = self.harness(m), self._build(cfg, m)
            cuda = self.device.type == "cuda"  # CUDA's peak is read after timed steps; the CPU's on batch 0
            meas = h.measure(fn, self._scaler_factory(cfg), autocast_dtype=cfg.autocast_dtype, timing=cuda,
                             max_step_s=self.slow, cut=None if cuda else _peak_only)
            pt.peak_bytes, pt.error = meas.peak_bytes, meas.error
        except Exception as e:  # noqa: BLE001 - a harness that cannot be built at m (out of memory)
            pt.error = f"{type(e).__name__}: {e}"
        pt.fits = pt.error is None and (self.memory_budget is None or pt.peak_bytes <= self.memory_budget)
        if pt.error is None and not pt.fits:
            pt.note = f"peak {format_bytes(pt.peak_bytes)} over the memory budget"
        what = f"failed ({pt.error})" if pt.error else f"peak {format_bytes(pt.peak_bytes)}"
        log(f"  {pt.label}: {what}" + (" -> over the budget" if pt.error is None and not pt.fits else ""),
            self.quiet)
        self.points.append(pt)
        return pt

    def fit(self, cfg: BatchConfig) -> BatchPoint | None:
        """``cfg`` at its largest fitting micro-batch (module docstring, "Fit"), or None when even
        micro-batch 1 does not fit."""
        ds = divisors(self.n)
        if self.memory_budget is None:
            return self.point(cfg, self.n)
        start = self.base
        i = ds.index(start)
        first = self.point(cfg, start)
        while not first.fits:  # smaller until one fits
            if i == 0:
                return None
            i -= 1
            first = self.point(cfg, ds[i])
        if i + 1 == len(ds):
            return first
        second = self.point(cfg, ds[i + 1])
        if not second.fits:
            return first
        best, j = second, i + 1
        slope = (second.peak_bytes - first.peak_bytes) / (second.micro_batch - first.micro_batch)
        if slope > 0:  # the line's largest fitting divisor, measured
            guess = max(d for d in ds if d <= second.micro_batch or
                        second.peak_bytes + slope * (d - second.micro_batch) <= self.memory_budget)
            k = ds.index(guess)
            while k > j:
                pt = self.point(cfg, ds[k])
                if pt.fits:
                    best, j = pt, k
                    break
                k -= 1
        while j + 1 < len(ds):  # the measured ones fit: one more divisor while it fits
            pt = self.point(cfg, ds[j + 1])
            if not pt.fits:
                break
            best, j = pt, j + 1
        return best

    def drift(self, pt: BatchPoint) -> None:
        """Fill ``pt.drift`` (:meth:`Harness.global_drift` on :data:`GLOBAL_DRIFT_STEPS` global
        batches); a failure is ``pt.error``."""
        h, fn = self.harness(pt.micro_batch), self._build(pt.config, pt.micro_batch)
        try:
            pt.drift = h.global_drift(fn, pt.accumulation, self._scaler_factory(pt.config),
                                      pt.config.autocast_dtype, GLOBAL_DRIFT_STEPS)
        except Exception as e:  # noqa: BLE001
            pt.error = f"{type(e).__name__}: {e}"

    def rule(self, base_m: int) -> DriftBudget:
        """The drift budget at the global batch: the tune's fixed one, or the auto rule against
        torch.autocast's accumulated drift (eager, its GEMMs in fp32 where the device emulates
        them: :attr:`AutocastBaseline.emulated`) on the harness of micro-batch ``base_m``."""
        if self.budget.rule == "fixed":
            return self.budget
        h = self.harness(base_m)
        ref = h.global_drift(h.model, self.n // base_m, self.autocast.scaler_factory(), self.autocast.dtype,
                             GLOBAL_DRIFT_STEPS, fp32_gemms=bool(self.autocast.emulated))
        if not all(math.isfinite(x) for x in ref):
            raise SearchError(f"torch.autocast's accumulated drift at global batch {self.n} is not finite "
                              f"({ref}); pass --max-drift X")
        return DriftBudget.auto(ref, self.budget.margin)

    def time(self, pts: list[BatchPoint]) -> None:
        """Time ``pts`` in interleaved rounds, each on its own micro-batches, and fill their global
        step seconds and tokens/s (module docstring, "Speed")."""
        configs = [Config(p.label, self._build(p.config, p.micro_batch), self._scaler_factory(p.config),
                          p.config.autocast_dtype, harness=self.harness(p.micro_batch)) for p in pts]
        timings = time_interleaved(self.harness(pts[0].micro_batch), configs, min_rounds=3, max_rounds=8,
                                   steps_per_round=2, max_step_s=self.slow, time_cap_s=600.0)
        tokens = count_tokens(self.spec.tokens_per_batch,
                              MicroBatches(self.spec, self.n, self.n, self.device).global_at(0, self.device))
        for p in pts:
            t = timings[p.label]
            if t.error is not None or not t.step_times:
                p.error = p.error or t.error or "not timed"
                continue
            h = self.harness(p.micro_batch)
            p.step_s = t.step_s
            p.update_s = h.update_seconds(scaled=self._scaler_factory(p.config)() is not None)
            p.global_step_s = global_step_seconds(p.step_s, p.update_s, p.accumulation)
            p.tokens_per_s = tokens / p.global_step_s
            lo, hi = (global_step_seconds(s, p.update_s, p.accumulation) for s in t.band_s)
            p.tokens_per_s_band = (tokens / hi, tokens / lo) if math.isfinite(hi) and lo > 0 else (0.0, 0.0)

    # -- the search -------------------------------------------------------------------------------
    def configs(self, policy: Policy, random: bool) -> list[BatchConfig]:
        """The baselines (fp32 + torch.compile; torch.autocast + torch.compile where it is in the
        contest, :meth:`AutocastBaseline.in_contest`), the policy without a memory lever and, under a
        memory budget, with each: saved bf16 activations, and full recomputation (compiled, on a
        graph that draws no random numbers)."""
        how = "torch.compile" if self.compile else "eager"
        out = [BatchConfig(f"fp32 + {how}", Role.BASELINE)]
        if self.autocast.in_contest(random):
            out.append(BatchConfig(f"torch.autocast + {how}", Role.BASELINE,
                                   autocast_dtype=self.autocast.dtype))
        bare = dataclasses.replace(without_saved(policy), activation_memory_budget=1.0, batching=None)
        out.append(BatchConfig("policy", Role.POLICY, bare))
        if self.memory_budget is not None:
            out.append(BatchConfig("policy + saved bf16", Role.POLICY, with_saved(bare, "bf16")))
            if self.compile and not random:
                out.append(BatchConfig("policy + recompute 0", Role.POLICY,
                                       dataclasses.replace(bare, activation_memory_budget=0.0)))
        return out

    def run(self, policy: Policy) -> tuple[Policy, BatchPoint, BatchPoint | None]:
        """The policy to write (``policy``'s configuration with the chosen lever and its
        ``batching``), its point, and the baseline to beat's point (None when no baseline fits).

        Raises:
            SearchError: no policy configuration fits the memory budget and the drift budget (the
                message gives the smallest peak measured and the budget).
        """
        fitted = [pt for cfg in self.configs(policy, self.harness(self.base).random)
                  if (pt := self.fit(cfg)) is not None]
        rule = self.rule(self.base)
        for pt in fitted:
            self.drift(pt)
            judged = pt.error is None and pt.config.role is Role.POLICY
            if judged and not rule.feasible(pt.drift):
                pt.note = f"accumulated drift over the budget ({rule.explain(pt.drift)})"
        live = [p for p in fitted if p.error is None and not p.note]
        policies = [p for p in live if p.config.role is Role.POLICY]
        if not policies:
            least = min((p.peak_bytes for p in self.points if p.error is None), default=0)
            raise SearchError(f"--global-batch {self.n}: no policy configuration fits "
                              + (f"the memory budget ({format_bytes(self.memory_budget)}; the smallest peak "
                                 f"measured was {format_bytes(least)}) and " if self.memory_budget else "")
                              + "the drift budget at any micro-batch dividing it")
        self.time(live)
        timed = [p for p in policies if p.tokens_per_s > 0]
        if not timed:
            raise SearchError(f"--global-batch {self.n}: no policy configuration could be timed")
        bases = [p for p in live if p.config.role is Role.BASELINE and p.tokens_per_s > 0]
        bar = max(bases, key=lambda p: p.tokens_per_s) if bases else None
        # fp32 + torch.compile is a baseline and a policy to write (all-fp32, as torch.compile compiles)
        fp32 = [p for p in bases if p.config.autocast_dtype is None] if self.compile else []
        best = pick(timed + fp32)
        if best in fp32:
            policy = dataclasses.replace(Policy.fp32(), compile_options=TORCH_COMPILE,
                                         batching=Batching(best.micro_batch, best.accumulation))
            log(f"micro-batch: {best.label} was as fast as every policy configuration or faster, with the "
                "least drift: writing all-fp32, compiled as torch.compile(model) compiles it", self.quiet)
            return policy, best, best
        batching = Batching(best.micro_batch, best.accumulation)
        chosen = dataclasses.replace(best.config.policy, batching=batching)
        return chosen, best, bar


def _peak_only(_m: Any) -> Outcome:
    """A measurement's cut after its first drift pass, whose peak is the CPU's count: the file's
    harness has more drift batches than a point needs (the decisive drift is the accumulated one)."""
    return Outcome.cut("peak only")


#: The simplicity of configurations a tie leaves level after the race's key (:func:`pick`: drift, then
#: rules): fp32 + torch.compile, the policy without a memory lever, then with saved bf16
#: activations, then with full recomputation.
LEVER_ORDER = ("fp32 + torch.compile", "policy", "policy + saved bf16", "policy + recompute 0")


def pick(points: list[BatchPoint]) -> BatchPoint:
    """The configuration to write among timed ``points`` (policy configurations, and fp32 +
    torch.compile where it may be written): of those the fastest is not faster than beyond the noise
    (:func:`faster`), the lower-drift, simpler one: the contest's tie rule
    (:func:`autoprec.search.race.tie_key` on the mean accumulated ``grad_rel_l2``), then
    :data:`LEVER_ORDER`. A user's tune had
    written saved bf16 activations at 4 x 4 (drift 1.15e-3) for a 1.01x, band 0.91-1.15, over
    fp32 at 2 x 8 (drift 0).

    Raises:
        ValueError: ``points`` is empty."""
    if not points:
        raise ValueError("pick: no timed configuration")
    fastest = max(points, key=lambda p: p.tokens_per_s)
    tied = [p for p in points if p is fastest or not faster(fastest, p)]
    rank = {name: i for i, name in enumerate(LEVER_ORDER)}

    def key(p: BatchPoint) -> tuple[float, int, int]:
        drift = sum(p.drift) / len(p.drift) if p.drift else math.inf
        return *tie_key(p.config.policy, drift), rank.get(p.config.name, len(LEVER_ORDER))
    return min(tied, key=key)


def faster(a: BatchPoint, b: BatchPoint) -> bool:
    """Whether ``a`` is faster than ``b`` beyond the noise: the low end of its tokens/s band above
    the high end of ``b``'s (bands that overlap are a tie; a point without a band compares by tokens/s)."""
    if a.tokens_per_s_band[0] > 0 and b.tokens_per_s_band[1] > 0:
        return a.tokens_per_s_band[0] > b.tokens_per_s_band[1]
    return a.tokens_per_s > b.tokens_per_s
