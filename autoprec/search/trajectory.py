"""The finalists' trajectory check (docs/architecture.md#search): ``traj_rel`` of a policy's K
training steps against FP32's, at most :data:`TRAJ_FACTOR` times torch.autocast's over the same
steps. The finalists' contest asks it of the policy it would write
(:class:`autoprec.search.contest.TrajectoryGate`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from autoprec.measure import Harness, is_compiled
from autoprec.measure.train_run import TrainRun, shareable
from autoprec.metrics import traj_rel
from autoprec.policy import Policy
from autoprec.search.autocast_baseline import AutocastBaseline
from autoprec.training.scaler import DynamicLossScaler
from autoprec.training.train import make_scaler

__all__ = ["TRAJ_FACTOR", "TrajectoryCheck"]

#: The trajectory check passes a policy whose ``traj_rel`` is at most this many times torch.autocast's
#: over the same K steps. It catches policies that train differently (fp16 gradients flushed to zero,
#: a stalled or diverging loss: orders of magnitude over autocast's), not precision differences, which
#: the paired drift rule over the drift batches ranks (autoprec.search.drift_budget). A trajectory is one
#: run with no noise band of its own: on the 24-layer examples/qwen2_deep.py the autocast twin, which
#: computes torch.autocast's dtypes, measured 1.34x autocast's traj_rel (1.37e-3 vs 1.02e-3) from
#: summation order alone (tests/passes/test_autocast_twin.py), compounded over 20 steps.
TRAJ_FACTOR = 2.0


class _Enough(Exception):
    """Raised by :meth:`TrajectoryCheck._autocast_until`'s step hook: the steps run decide the check."""


class _Budget:
    """One reference's K losses (``ref``) and torch.autocast's losses run so far (``ac``) against it:
    ``fn``, its module, run with its GEMMs in fp32 where ``emulate``."""

    def __init__(self, ref: list[float], fn: Callable[..., Any], emulate: bool) -> None:
        self.ref, self.fn, self.emulate = ref, fn, emulate
        self.ac: list[float] = []

    def value(self) -> float:
        """torch.autocast's ``traj_rel`` over the steps it has run (0.0 before any)."""
        return traj_rel(self.ac, self.ref[:len(self.ac)])


class TrajectoryCheck:
    """``traj_rel`` (:func:`autoprec.metrics.traj_rel`: max over K optimizer steps of
    |Lₖ − L₃₂,ₖ| / |L₃₂,ₖ|, from the harness's initial weights on ``get_batch(0..K-1)``)
    of a policy's module against FP32's, judged against torch.autocast's over the same steps.

    What it learns about a policy is keyed by the policy's content (:meth:`Policy.training_key`),
    never by object identity: a rejected policy can be freed and its ``id`` reused by another.

    Args:
        harness: The run's :class:`Harness` (weights, batches, model file).
        autocast: torch.autocast on this device (:class:`AutocastBaseline`): its dtype, and whether
            its trajectory runs eagerly with its GEMMs computed in fp32, rounded as native ones
            round (:meth:`AutocastBaseline.trajectory_emulated`: its native GEMMs are slow), as its
            drift passes do, instead of K native steps (a 24-layer Qwen2 on an AVX2-only CPU:
            ~9.5 s each against ~0.6 s).
        steps: K (0: every policy passes, nothing is run).
        compiled_autocast: Gives torch.autocast's module as compiled for its baseline; called
            only when the reference is compiled.
        compiled_fp32: Gives the all-fp32 graph as compiled for its own baseline (fp32 +
            torch.compile), or None when there is none: a compiled policy's reference then (see
            :meth:`ok`).

    The losses of a module that the final head-to-head timed as a training run of its own
    (:meth:`share`) are read from that run, continued to K steps where it has fewer, instead of
    running K steps again (:mod:`autoprec.measure.train_run`).

    Attributes:
        traj: ``Policy.training_key()`` -> its ``traj_rel``.
        budget: torch.autocast's ``traj_rel`` over its first :attr:`budget_steps` steps in the last
            check (None before one): over all K where that check failed, else a lower bound of it.
        budget_steps: How many of torch.autocast's K steps :attr:`budget` is over.
        runs: ``(id(module), autocast dtype)`` -> its :class:`TrainRun` from :meth:`share`.
    """

    def __init__(self, harness: Harness, autocast: AutocastBaseline, steps: int,
                 compiled_autocast: Callable[[], Any],
                 compiled_fp32: Callable[[], Any] = lambda: None) -> None:
        self.h, self.autocast, self.steps = harness, autocast, steps
        self.ac_dtype = autocast.dtype
        self._compiled_autocast, self._compiled_fp32 = compiled_autocast, compiled_fp32
        self.traj: dict[str, float] = {}
        self.budget: float | None = None
        self.budget_steps = 0
        # id(reference fn) -> its losses and torch.autocast's so far; the harness keeps each alive
        self._refs: dict[int, _Budget] = {}
        self.runs: dict[tuple[int, torch.dtype | None], TrainRun] = {}
        self._shareable: bool | None = None

    def share(self, fn: Callable[..., Any], scaler_factory: Callable[[], DynamicLossScaler | None],
              autocast_dtype: torch.dtype | None = None) -> TrainRun | None:
        """A :class:`TrainRun` of ``fn`` for the head-to-head to time (``Config.run``), whose
        losses :meth:`ok` reads if it needs ``fn``'s trajectory; None when timed steps cannot be a
        trajectory (:func:`autoprec.measure.train_run.shareable`: random ops, several batch
        shapes) or K is 0. The run is kept until :meth:`release`.

        ``fn`` must be the object :meth:`ok` is given (or its reference: the compiled fp32
        finalist, torch.autocast's module); the run holds a copy of the weights and the
        optimizer's state."""
        if self._shareable is None:
            self._shareable = shareable(self.h, self.steps)
        if not self._shareable:
            return None
        run = TrainRun(self.h, fn, scaler_factory(), autocast_dtype, cycle=self.steps)
        self.runs[(id(fn), autocast_dtype)] = run
        return run

    def release(self) -> None:
        """Drop the runs of :meth:`share` (their weights and optimizer state)."""
        self.runs.clear()

    def _losses(self, fn: Callable[..., Any], scaler_factory: Callable[[], DynamicLossScaler | None]
                ) -> list[float]:
        """``fn``'s K losses: from its shared run, or :meth:`Harness.trajectory` when it has none
        (or its run broke)."""
        run = self.runs.get((id(fn), None))
        got = run.trajectory(self.steps) if run is not None else None
        if got is not None:
            return got
        return self.h.trajectory(fn, scaler_factory, steps=self.steps)

    def of(self, policy: Policy) -> float:
        """``traj_rel`` measured for ``policy`` (by content), 0.0 when it was not checked (it
        lowers nothing, ``steps`` is 0, or it was never the policy to write)."""
        return self.traj.get(policy.training_key(), 0.0)

    def ok(self, policy: Policy, fn: Callable[..., Any]) -> bool:
        """Whether ``fn`` (``policy``'s lowered or compiled module) has ``traj_rel`` ≤
        :data:`TRAJ_FACTOR` x torch.autocast's over the same K steps; policies that lower nothing
        compute what FP32 computes and pass unrun.

        The reference is :meth:`Harness.reference_fn`'s: the eager FP32 graph, or, for a compiled
        ``fn`` on a graph that draws random numbers (dropout), the compiled FP32 graph, whose
        masks are the compiled candidate's. A compiled ``fn`` on any other graph is compared with
        the fp32 + torch.compile baseline's graph (``compiled_fp32``, when there is one): both
        sides are then compiled, and its steps cost what a compiled step costs (a 24-layer Qwen2
        on 2 cores: 0.53 s against 0.80 s eager). Against a compiled reference torch.autocast's
        budget is taken compiled too (eagerly with its GEMMs in fp32 where the baseline's trajectory is
        emulated, :meth:`AutocastBaseline.trajectory_emulated`). Each
        reference's trajectory is run once, or read from the runs the head-to-head timed
        (:meth:`share`).

        torch.autocast's steps run after ``fn``'s, and only as many as the verdict needs: its
        ``traj_rel`` over its first j steps is a lower bound of its ``traj_rel`` over K (a max
        over steps), so once :data:`TRAJ_FACTOR` x that bound reaches ``fn``'s ``traj_rel`` the
        check passes, as it would after K. Only a failing ``fn`` needs all K (a 24-layer Qwen2 on
        an AVX2-only CPU: ~1.3 s per step of torch.autocast with its GEMMs in fp32). What was run
        is kept per reference, and continued for a later ``fn`` that needs more (:attr:`budget`,
        :attr:`budget_steps`).
        """
        if not (policy.dtypes_used() - {"fp32"}) or self.steps <= 0:
            return True
        ref_fn = self.h.reference_fn(fn)
        if ref_fn is self.h.graph_module and is_compiled(fn):
            ref_fn = self._compiled_fp32() or ref_fn
        if id(ref_fn) not in self._refs:
            emulate = self.autocast.trajectory_emulated(self.h.random)
            ac_fn = self.h.model if ref_fn is self.h.graph_module or emulate else self._compiled_autocast()
            self._refs[id(ref_fn)] = _Budget(self._losses(ref_fn, lambda: None), ac_fn, emulate)
        b = self._refs[id(ref_fn)]
        tr = traj_rel(self._losses(fn, lambda: make_scaler(policy)), b.ref)
        self.traj[policy.training_key()] = tr
        self._autocast_until(b, tr / TRAJ_FACTOR)
        self.budget, self.budget_steps = b.value(), len(b.ac)
        return tr <= max(self.budget * TRAJ_FACTOR, 1e-12)

    def _autocast_until(self, b: _Budget, need: float) -> None:
        """Run torch.autocast's trajectory for ``b`` until its ``traj_rel`` so far reaches ``need``
        or it has K steps (at least one): from the shared run's losses, continued a step at a time,
        or :meth:`Harness.trajectory` stopped by a step hook (run again from step 0 when more are
        needed than a stopped run gave)."""
        def enough() -> bool:
            return len(b.ac) >= self.steps or (len(b.ac) > 0 and b.value() >= need)

        run = None if b.emulate else self.runs.get((id(b.fn), self.ac_dtype))
        while run is not None and not enough():
            got = run.trajectory(max(len(b.ac) + 1, min(len(run.losses), self.steps)))
            if got is None:
                break  # a broken run: run the trajectory on its own below
            b.ac = got
        if enough():
            return

        def hook(_k: int, _batch: Any, stats: Any, _seconds: float) -> None:
            b.ac.append(stats.loss)
            if enough():
                raise _Enough

        b.ac = []
        with contextlib.suppress(_Enough):
            self.h.trajectory(b.fn, self.autocast.scaler_factory(), autocast_dtype=self.ac_dtype,
                              steps=self.steps, fp32_gemms=b.emulate, after=[hook])

    def reason(self, policy: Policy) -> str:
        """Why ``policy`` failed :meth:`ok` (the log's and the report's words)."""
        return f"traj_rel {self.of(policy):.3g} > {TRAJ_FACTOR:g}x torch.autocast's {self.budget:.3g}"
