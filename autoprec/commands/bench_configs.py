"""How ``autoprec bench`` builds each configuration (docs/architecture.md#measurements): the module it
trains, its loss scaler, its autocast dtype and the harness whose weights it trains, so that every
configuration runs every batch shape the model file gives (:mod:`autoprec.commands.bench_shapes`).
The policy rows run the lowered graph as training runs it: ``policy_eager`` with the policy's saved
activation dtypes honoured (:func:`autoprec.applied.saved.saved_eager`, as ``tune``'s eager
candidates and ``apply(..., compile=False)``), ``policy_compiled`` through
:func:`autoprec.applied.compile.compile_graph`."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autoprec.applied.compile import check_recompute, compile_graph
from autoprec.applied.saved import saved_eager
from autoprec.capture import autocast_dynamic
from autoprec.commands import bench_shapes as shapes
from autoprec.dtypes import NAMES
from autoprec.measure import Harness
from autoprec.nodemeta import read_meta
from autoprec.passes import run_pipeline
from autoprec.policy import Policy
from autoprec.training.scaler import DynamicLossScaler
from autoprec.training.train import autocast_scaler, make_scaler

__all__ = ["BenchConfig", "build_configs", "main_dtype", "pure_low"]


def main_dtype(lowered: torch.fx.GraphModule, policy: Policy) -> str:
    """Most common dtype among the lowered graph's ``matmul``-class nodes (else the default)."""
    seen = Counter(read_meta(n).dtype for n in lowered.graph.nodes
                   if read_meta(n).op_class == "matmul" and read_meta(n).dtype)
    return seen.most_common(1)[0][0] if seen else policy.default_dtype


@dataclass
class BenchConfig:
    """How to run one configuration: module, scaler, autocast dtype and harness (weights)."""

    fn: Callable[[], Any]
    harness: Harness
    scaler: Callable[[], DynamicLossScaler | None]
    autocast: torch.dtype | None
    dtype: str
    compiled: bool


def pure_low(h: Harness, dtype: torch.dtype) -> Harness:
    """A shallow copy of ``h`` whose model, parameters and initial weights are ``dtype`` copies
    (same values rounded; no fp32 master weights); batches and FP32 references (eager and
    compiled: ``h._reference``) are ``h``'s."""
    low = copy.copy(h)
    low.model = copy.deepcopy(h.model).to(dtype)
    low.params = [p for p in low.model.parameters() if p.requires_grad]
    low.initial = [p.detach().clone() for p in low.params]
    # FP32 references from h itself, on h's fp32 weights: with random ops a compiled candidate's is the
    # compiled FP32 graph (Harness.reference_fn), whose gradients land on h's parameters, not the copy's
    low._reference = h._reference
    return low


def build_configs(h: Harness, policy: Policy, low: torch.dtype, names: Sequence[str],
                  source: Any = None) -> dict[str, BenchConfig]:
    """How to run each configuration in ``names`` (:data:`autoprec.commands.bench.CONFIGS`) on ``h``'s
    model and batches, in the low dtype ``low``; modules are built lazily (``BenchConfig.fn()``:
    compiling starts at their first call). Widens ``h.graph_module``'s ranges first when a batch is
    outside them (:func:`autoprec.commands.bench_shapes.cover_batches`).

    ``source`` (the policy file, or None) is named in a refusal.

    Raises:
        PassError: the policy cannot be applied to the graph.
        PolicyError: ``policy_compiled`` with an activation memory budget below 1.0 on a graph that
            draws random numbers (:func:`autoprec.applied.compile.check_recompute`), before any row.
    """
    if "policy_compiled" in names:
        check_recompute(h.graph_module, policy.activation_memory_budget, source)
    shapes.cover_batches(h)  # dynamic ranges over every batch the rows run, not only the first ones
    lowered = run_pipeline(h.graph_module, policy).graph_module
    pol_scaler = lambda: make_scaler(policy)
    low_scaler = autocast_scaler(low)
    lname, pdt = NAMES[low], main_dtype(lowered, policy)
    plow = pure_low(h, low) if any(n.startswith("pure_low") for n in names) else None
    how = policy.compiled_as  # the compile options tune measured (as apply compiles the policy)
    table = {
        "fp32_eager": lambda: BenchConfig(lambda: h.model, h, lambda: None, None, "fp32", False),
        "fp32_compiled": lambda: BenchConfig(lambda: compile_graph(h.graph_module), h, lambda: None, None,
                                             "fp32", True),
        "autocast_eager": lambda: BenchConfig(lambda: h.model, h, low_scaler, low, lname, False),
        "autocast_compiled": lambda: BenchConfig(
            lambda: compile_graph(h.model, dynamic=autocast_dynamic(h.batches)),
            h, low_scaler, low, lname, True),
        "pure_low_eager": lambda: BenchConfig(lambda: plow.model, plow, low_scaler, None, lname, False),
        # torch.compile of the low-dtype copy as a user compiles it (capture refuses a model whose
        # parameters are not fp32: they are the master weights a policy trains)
        "pure_low_compiled": lambda: BenchConfig(
            lambda: compile_graph(plow.model, dynamic=autocast_dynamic(plow.batches)),
            plow, low_scaler, None, lname, True),
        # as tune's eager candidates, train --no-compile and apply(compile=False) run it: its nodes'
        # ``saved`` dtypes honoured (saved_eager); a lowering of its own, as saved_eager marks it in place
        "policy_eager": lambda: BenchConfig(
            lambda: saved_eager(run_pipeline(h.graph_module, policy).graph_module), h, pol_scaler, None, pdt,
            False),
        "policy_compiled": lambda: BenchConfig(
            lambda: compile_graph(lowered, policy.activation_memory_budget, regional=how.regional,
                                  emulate_precision_casts=how.emulate_precision_casts),
            h, pol_scaler, None, pdt, True),
    }
    return {n: table[n]() for n in names}
