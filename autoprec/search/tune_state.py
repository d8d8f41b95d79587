"""The state ``tune``'s phases hand on to each other (:class:`TuneState`):
:mod:`autoprec.search.study` fills it phase by phase, :mod:`autoprec.search.results` reads it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from autoprec.measure import Harness, Measurement
from autoprec.modelspec import ModelSpec
from autoprec.search.autocast_baseline import AutocastBaseline
from autoprec.search.drift_budget import DriftBudget
from autoprec.search.kernel_choice import KernelChoice
from autoprec.search.progress import Clock
from autoprec.search.space import SearchSpace

__all__ = ["TuneState"]


@dataclass
class TuneState:
    """What the phases of one :func:`autoprec.search.study.tune` call hand on to each other.

    Attributes:
        spec: The loaded model file. dev: The device measured on. harness: The run's
            :class:`Harness` (captured graph, FP32 reference, weights and batches).
        clock: Seconds per phase. quiet: No log lines. progress: A bar over each long phase.
        kernels: The probe phase's (or the resumed study's) :class:`KernelChoice`.
        fp32, autocast: fp32 eager's and torch.autocast eager's baseline measurements.
        slow: ``max_step_s`` of every timed measurement after the fp32 baseline (seconds).
        baseline: torch.autocast on this device (:class:`AutocastBaseline`), set with ``slow``.
        budget: The drift budget, set by the baselines phase.
    """

    spec: ModelSpec
    dev: torch.device
    harness: Harness
    clock: Clock
    quiet: bool
    progress: bool = False  # a bar over each long phase (autoprec.search.phases)
    kernels: KernelChoice | None = None  # the probe phase's (or the study's) choice
    fp32: Measurement = field(default_factory=Measurement)
    autocast: Measurement = field(default_factory=Measurement)
    slow: float = math.inf  # max_step_s of every timed measurement after the fp32 baseline
    baseline: AutocastBaseline | None = None  # torch.autocast on this device, set by _baselines
    budget: DriftBudget | None = None  # the drift budget, set by _baselines

    @property
    def gm(self) -> torch.fx.GraphModule:
        """The captured training graph (the harness's)."""
        return self.harness.graph_module

    @property
    def probes(self) -> dict[str, Any]:
        """The kernel probe's results (empty before the probe phase)."""
        return self.kernels.probes if self.kernels is not None else {}

    @property
    def space(self) -> SearchSpace:
        """The search space (empty before the probe phase)."""
        return self.kernels.space if self.kernels is not None else SearchSpace([])

    @property
    def ac_dtype(self) -> torch.dtype:
        """torch.autocast's low dtype (bf16 before the probe phase)."""
        return self.kernels.ac_dtype if self.kernels is not None else torch.bfloat16
