"""Fitting a compiled finalist to ``--max-memory`` (docs/architecture.md#search, "Finalists"): two
levers, activations saved in low precision (a policy's ``saved``) and recomputation in backward
(``activation_memory_budget``); the faster candidate that fits peak and drift is kept. On a graph
that draws random numbers only the first lever is tried (:data:`autoprec.applied.compile.RECOMPUTE_REDRAWS`).

:class:`MemoryFit` is built by the finalists' contest (:class:`autoprec.search.contest.Contest`)
with what it needs of it: how to build and measure a policy, the drift and memory budgets, and
where to record each try (the report's lever table).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autoprec._interrupt import check as check_interrupt
from autoprec.applied.compile import RECOMPUTE_REDRAWS
from autoprec.errors import SearchError
from autoprec.measure import Harness, Measurement
from autoprec.passes import run_pipeline
from autoprec.policy import Policy
from autoprec.search.budgets import format_bytes
from autoprec.search.progress import log
from autoprec.search.space import SAVED_LEVERS, with_saved

__all__ = ["MemoryFit", "eager_fitting", "lever"]


def lever(pol: Policy) -> str:
    """Which memory lever a finalist uses: ``"none"``, ``"recompute <budget>"``, ``"saved <dtype>"``."""
    saved = {r.saved for r in pol.rules if r.saved is not None}
    parts = ([f"saved {'/'.join(sorted(saved))}"] if saved else []) + (
        [f"recompute {pol.activation_memory_budget:g}"] if pol.activation_memory_budget < 1.0 else [])
    return " + ".join(parts) or "none"


@dataclass(frozen=True)
class MemoryFit:
    """Fits a compiled finalist to the memory budget (the module docstring).

    Attributes:
        harness: The run's :class:`Harness` (its graph, device, ``random`` and ``state_bytes``).
        build: ``(lowered graph, activation_memory_budget) -> module`` as the contest trains it.
        measure: ``(module, policy, timed) -> Measurement`` (drift and memory; steps timed when
            ``timed``), under the contest's slow-step limit.
        drift: Whether a measurement is within the drift budget.
        budget: The memory budget, bytes.
        record: ``(policy, measurement, timed)``: each try's row of the report's lever table.
        quiet: No log lines.
    """

    harness: Harness
    build: Callable[[Any, float], Any]
    measure: Callable[[Any, Policy, bool], Measurement]
    drift: Callable[[Measurement], bool]
    budget: float
    record: Callable[[Policy, Measurement, bool], None]
    quiet: bool = False

    def _fits(self, m: Measurement) -> bool:
        return not m.failed and m.peak_bytes <= self.budget and self.drift(m)

    def fit(self, pol: Policy, m: Measurement) -> tuple[Policy, Any, Measurement]:
        """Fit ``pol`` to the memory budget with the faster of the two levers.

        Saved activations (:data:`SAVED_LEVERS`, :func:`with_saved`: bf16 first, then fp8_e5m2)
        keep the forward and cost a cast per saved tensor and some drift; recomputation
        (:meth:`fit_recompute`) keeps the numerics and costs forward work in backward. Each lever's
        candidate that fits (peak and drift) is timed, and the faster is returned; when neither
        fits, the recomputation result is returned for the contest's gates to explain. On a graph
        that draws random numbers (``harness.random``) recomputation is not tried
        (:data:`autoprec.applied.compile.RECOMPUTE_REDRAWS`); when saved activations do not fit either,
        the drift-feasible saved candidate with the smallest peak is returned (``pol`` and ``m`` as they
        came when none is), so the rejection quotes the lowest peak reached.
        """
        fitted, tried = [], [(pol, None, m)]
        for dtype in SAVED_LEVERS:
            check_interrupt()
            cand = with_saved(pol, dtype)
            lowered = run_pipeline(self.harness.graph_module, cand).graph_module
            fn = self.build(lowered, cand.activation_memory_budget)
            probe = self.measure(fn, cand, self.harness.device.type == "cuda")
            log(f"  memory lever saved {dtype}: {format_bytes(probe.peak_bytes)}, grad_rel_l2 "
                f"{probe.grad_rel_l2:.3g}" + (f" ({probe.error})" if probe.error else ""), self.quiet)
            if self._fits(probe):
                timed = probe if probe.step_times else self.measure(fn, cand, True)
                self.record(cand, timed, True)
                fitted.append((cand, fn, timed))
                break
            self.record(cand, probe, bool(probe.step_times))
            if not probe.failed and self.drift(probe):
                tried.append((cand, fn, probe))
        if self.harness.random:
            log(f"  memory lever recompute: not tried, {RECOMPUTE_REDRAWS}", self.quiet)
            rc = min(tried, key=lambda t: t[2].peak_bytes)
        else:
            rc = self.fit_recompute(pol, m)
            self.record(rc[0], rc[2], bool(rc[2].step_times))
            if self._fits(rc[2]) and rc[2].step_times:
                fitted.append(rc)
        if not fitted:
            return rc
        best = max(fitted, key=lambda f: f[2].tokens_per_s)
        log(f"  memory levers: {', '.join(f'{lever(c)} {x.tokens_per_s:.0f} tok/s' for c, _, x in fitted)} "
            f"-> {lever(best[0])}", self.quiet)
        return best

    def fit_recompute(self, pol: Policy, m: Measurement) -> tuple[Policy, Any, Measurement]:
        """Lower ``pol``'s ``activation_memory_budget`` until the compiled graph's peak fits.

        Saved activations scale about linearly with the partitioner's budget (its definition:
        torch/_functorch/config.py), so the first guess is proportional, the second a secant
        through the measured points, the third 0.0 (full recomputation); each aims 10% under
        the budget. On the CPU memory is counted on one forward/backward (compile included) and
        only the budget that fits is timed; on CUDA each try is timed (its peak is read then).

        Returns:
            The policy, callable and measurement to judge: still over the budget when even full
            recomputation does not fit, with ``error`` set when the budget is below the fp32
            parameter, gradient and optimizer state alone.
        """
        state = self.harness.state_bytes
        room = self.budget - state
        if room <= 0:
            m.fail(f"peak {m.peak_bytes / 2**20:.1f} MiB > memory budget {self.budget / 2**20:.1f} "
                   "MiB, which is below the fp32 parameter, gradient and optimizer state alone "
                   f"({state / 2**20:.1f} MiB)")
            return pol, None, m
        points = [(pol.activation_memory_budget, m.peak_bytes - state)]
        for attempt in range(3):
            (b1, a1), (b0, a0) = points[-1], points[-2] if len(points) > 1 else (0.0, 0.0)
            slope = (a1 - a0) / (b1 - b0) if (a1 - a0) * (b1 - b0) > 0 else a1 / max(b1, 1e-9)
            b = 0.0 if attempt == 2 else max(0.0, math.floor(100 * (b1 - (a1 - 0.9 * room) / slope)) / 100)
            cand = dataclasses.replace(pol, activation_memory_budget=b)
            # a fresh graph per budget: Dynamo caches compiled code per graph, not per config
            fn = self.build(run_pipeline(self.harness.graph_module, cand).graph_module, b)
            # CUDA's peak (max_memory_allocated) is read after timed steps; the CPU's count needs none
            probe = self.measure(fn, cand, self.harness.device.type == "cuda")
            log(f"  peak {points[-1][1] / 2**20 + state / 2**20:.1f} MiB > memory budget "
                 f"{self.budget / 2**20:.1f} MiB: activation memory budget {b:g} -> "
                 f"{probe.peak_bytes / 2**20:.1f} MiB", self.quiet)
            if probe.failed or probe.peak_bytes <= self.budget or b == 0.0:
                break
            points.append((b, probe.peak_bytes - state))
        if probe.failed or probe.peak_bytes > self.budget or probe.step_times:
            return cand, fn, probe
        return cand, fn, self.measure(fn, cand, True)


def eager_fitting(feasible: list[Any], memory_budget: float) -> list[Any]:
    """Without compile (nothing can recompute), the feasible trials (Optuna ``FrozenTrial``s, their
    ``values[2]`` the screening peak in bytes) whose peak fits ``memory_budget`` (bytes): a slower
    one that fits is a finalist before a faster one that cannot.

    Raises:
        SearchError: none fits; the message gives the smallest peak."""
    fits = [t for t in feasible if t.values[2] <= memory_budget]
    if not fits:
        least, budget = min(t.values[2] for t in feasible) / 2**20, format_bytes(memory_budget)
        raise SearchError(f"no feasible trial fits the memory budget ({budget}; "
                          f"the smallest peak was {least:.1f} MiB); without --no-compile, "
                          "recomputation in backward can lower the peak")
    return fits
