"""A configuration's own training run on a :class:`~autoprec.measure.harness.Harness`, taken in
turns: the final head-to-head times its steps, and the trajectory check reads its losses
(docs/architecture.md#search, "Final choice").

Every configuration a harness measures trains the harness's one set of parameters. A
:class:`TrainRun` keeps its own copy of them between its turns, with its own optimizer and loss
scaler, so the steps it is given in turns, however interleaved with other configurations', are the
steps of one uninterrupted run from the initial weights on batches ``get_batch(0, 1, ..., K-1)``
(then again from 0): its first K losses are :meth:`Harness.trajectory`'s K losses, bit for bit, on
a graph that draws no random numbers (:func:`shareable`). Timing the head-to-head's steps this way
and reading the trajectory from them saves running the same steps twice: on a 24-layer Qwen2 on
one core the head-to-head and the trajectories of the choice, the compiled fp32 reference and
torch.autocast + torch.compile took 48 s against 65 s run apart
(``benchmarks/results/depth_2026-12-05_shared``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from autoprec.capture import batch_shapes
from autoprec.measure.harness import Harness
from autoprec.training.scaler import DynamicLossScaler
from autoprec.training.steps import StepHook, StepsTooSlow, run_steps
from autoprec.training.train import TrainStep

__all__ = ["TrainRun", "shareable"]


def shareable(harness: Harness, steps: int) -> bool:
    """Whether a :class:`TrainRun`'s first ``steps`` losses are ``harness``'s trajectory: the graph
    draws no random numbers (a trajectory runs each step from a fixed RNG seed and, compiled, with
    eager's masks, ``Harness.trajectory``; timed steps must not) and batches ``0..steps-1`` have one
    shape (so the timed steps meet no shape their warm-up did not). Makes ``harness.batches`` hold
    ``steps`` batches at least (:meth:`Harness.extend_batches`), as a trajectory would."""
    if harness.random or steps <= 0:
        return False
    harness.extend_batches(steps)
    return len(batch_shapes(harness.batches[:steps])) == 1


class TrainRun:
    """One configuration's training run from ``harness``'s initial weights (module docstring).

    Args:
        harness: Weights, batches, optimizer and loss of the model file.
        fn: The module a :class:`~autoprec.training.train.TrainStep` calls (model, lowered or
            compiled graph).
        scaler: Its loss scaler (None for bf16/fp32), kept across turns.
        autocast_dtype: Run its forward under ``torch.autocast`` (the AMP baseline).
        cycle: Step k runs on batch ``get_batch(k mod cycle)``: the first ``cycle`` steps are a
            trajectory, and later ones meet only the shapes those met (≥ 1; K of the trajectory).

    Attributes:
        losses: The loss of each step run so far (fp32 Python floats, non-finite kept), step 0 first.
        broken: A step raised (other than :class:`~autoprec.training.steps.StepsTooSlow`): the
            weights may hold a half-applied step, so :meth:`trajectory` gives None.
        step: Its :class:`~autoprec.training.train.TrainStep` (optimizer state, scaler).

    Memory: a copy of the trainable parameters (:meth:`prepare`) besides the optimizer's state.
    """

    def __init__(self, harness: Harness, fn: Callable[..., Any], scaler: DynamicLossScaler | None = None,
                 autocast_dtype: torch.dtype | None = None, cycle: int = 1) -> None:
        self.h, self.cycle = harness, max(int(cycle), 1)
        harness.extend_batches(self.cycle)
        self.step = harness.train_step(fn, scaler, autocast_dtype)
        self.losses: list[float] = []
        self.broken = False
        self._weights: list[torch.Tensor] | None = None  # its weights between turns (prepare)

    def prepare(self) -> TrainStep:
        """Allocate its copy of the weights (the initial ones) now, if not yet, and return its
        :attr:`step`: a caller that reads the device's peak memory around :meth:`steps` calls it
        first, so the copy, which training itself does not hold, is not counted in the steps' peak."""
        if self._weights is None:
            self._weights = [w.clone() for w in self.h.initial]
        return self.step

    def steps(self, n: int, after: Sequence[StepHook] = ()) -> None:
        """Run its next ``n`` steps (batch ``get_batch(k mod cycle)`` for step k) from its own weights, with
        the hooks ``after`` (:func:`autoprec.training.steps.run_steps`); the harness's parameters
        hold the initial weights again afterwards.

        Raises:
            Whatever a step or hook raises (:class:`StepsTooSlow` from a slow-step guard); the
            steps done before it stay in this run.
        """
        h, k = self.h, len(self.losses)
        self.prepare()
        with torch.no_grad():
            for p, w in zip(h.params, self._weights, strict=True):
                p.copy_(w)
                p.grad = None
        try:
            run_steps(self.step, lambda j: h.batches[j % self.cycle], k, k + n, device=h.device,
                      after=[self._record, *after])
        except StepsTooSlow:  # a hook's verdict after a whole step: the run is as it should be
            raise
        except Exception:
            self.broken = True
            raise
        finally:
            with torch.no_grad():
                for w, p in zip(self._weights, h.params, strict=True):
                    w.copy_(p)
            h.restore()

    def trajectory(self, k: int) -> list[float] | None:
        """Its first ``k`` losses, running the steps it lacks (untimed); None when it is broken.

        Raises:
            ValueError: ``k`` > ``cycle`` (step ``cycle`` reruns batch 0: no longer a trajectory).
        """
        if k > self.cycle:
            raise ValueError(f"a trajectory of {k} steps from a run that cycles {self.cycle} batches")
        if self.broken:
            return None
        if len(self.losses) < k:
            try:
                self.steps(k - len(self.losses))
            except Exception:  # noqa: BLE001 - the caller runs the trajectory on its own instead
                return None
        return self.losses[:k]

    def _record(self, _k: int, _batch: Any, stats: Any, _seconds: float) -> None:
        self.losses.append(stats.loss)
