"""The one training-step loop: ``autoprec train``, ``train --compare``, the harness's timing and
its trajectory check all run their steps through :func:`run_steps` (docs/architecture.md#runtime).

The loop drives a :class:`~autoprec.training.train.TrainStep` over steps ``start..stop-1`` with the
batch of each step from a callable, times each step (:meth:`TrainStep.timed`: device synchronised
before and after), runs it under the RNG rule of :mod:`autoprec.training.rng` and returns
``(StepStats, seconds)`` per step. What differs between the callers is passed as per-step hooks:
logging, monitor records, checkpoints (:func:`every`), the harness's early abort
(:func:`slow_step_guard`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from autoprec.device import compile_count
from autoprec.training.rng import StepRng
from autoprec.training.train import StepStats, TrainStep

__all__ = ["SLOW_FACTOR", "SLOW_IN_A_ROW", "StepHook", "StepsTooSlow", "every", "run_steps", "slow_steps",
           "slow_step_guard"]

#: A per-step hook: ``hook(step_index, batch, stats, seconds)``, called after each step (seconds:
#: the step's wall-clock time). A hook stops the loop by raising.
StepHook = Callable[[int, Any, StepStats, float], None]

#: :func:`slow_step_guard` stops after this many consecutive steps over the limit (one noisy
#: step is not enough) ...
SLOW_IN_A_ROW = 2
#: ... or after one step over this multiple of the limit (e.g. a dtype the device emulates slowly).
SLOW_FACTOR = 4.0


def run_steps(step: TrainStep, batches: Callable[[int], Any], start: int, stop: int, *,
              rng: StepRng | None = None, device: torch.device | None = None,
              before: Callable[[int, Any], None] | None = None,
              after: Sequence[StepHook] = ()) -> list[tuple[StepStats, float]]:
    """Run training steps ``start..stop-1``; the one loop of every caller (module docstring).

    Args:
        step: The training step (module, master weights, optimizer, loss, scaler).
        batches: ``batches(k)`` is step ``k``'s batch (e.g. ``get_batch(k, device)``).
        start: First step index (``> 0`` when resumed from a checkpoint).
        stop: One past the last step index.
        rng: Which RNG state each step runs from (:class:`~autoprec.training.rng.StepRng`;
            None: ``StepRng()``, the global stream).
        device: The device the steps run on, for the fixed-per-step RNG case
            (default ``torch.device(step.device_type)``).
        before: Called as ``before(k, batch)`` before step ``k`` (e.g. to give a monitor the
            batch its loss-scale diagnosis re-runs, since the scaler raises inside the step).
        after: Hooks called in order after each step (:data:`StepHook`).

    Returns:
        ``(stats, seconds)`` of each step run, in order (empty if ``start >= stop``).

    Raises:
        Whatever the step or a hook raises (e.g. ``LossScaleError`` at the scale floor,
        :class:`StepsTooSlow` from :func:`slow_step_guard`); steps already run stay applied.
    """
    dev = device if device is not None else torch.device(step.device_type)
    rng = rng if rng is not None else StepRng()
    rng.begin(start)
    done: list[tuple[StepStats, float]] = []
    for k in range(start, stop):
        batch = batches(k)
        if before is not None:
            before(k, batch)
        with rng.step(dev, k):
            stats, seconds = step.timed(batch)
        done.append((stats, seconds))
        for hook in after:
            hook(k, batch, stats, seconds)
    return done


def every(n: int, fn: Callable[[int], None], stop: int | None = None) -> StepHook:
    """A hook calling ``fn(k + 1)`` (the number of steps done) after each step ``k`` that ends a
    multiple of ``n`` steps, e.g. to save a checkpoint every ``n`` steps.

    Args:
        n: Period in steps; ``n <= 0`` never calls ``fn``.
        fn: Called with the number of steps done.
        stop: Not called when ``k + 1 == stop`` (the caller saves at the end itself).
    """
    def hook(k: int, _batch: Any, _stats: StepStats, _seconds: float) -> None:
        if n > 0 and (k + 1) % n == 0 and k + 1 != stop:
            fn(k + 1)

    return hook


class StepsTooSlow(Exception):
    """Raised by :func:`slow_step_guard`'s hook.

    Attributes:
        step: Index of the step that stopped the loop.
        seconds: Its wall-clock seconds: the one timing a caller may still report.
        limit: The ``max_step_s`` the guard was made with (seconds).
        why: The rule it tripped, e.g. ``"a step took 9.26 s, over 4 x the 1.72 s limit"``.
    """

    def __init__(self, step: int, seconds: float, limit: float, in_a_row: int) -> None:
        why = (f"a step took {seconds:.2f} s, over {SLOW_FACTOR:g} x the {limit:.2f} s limit"
               if in_a_row < SLOW_IN_A_ROW else
               f"{in_a_row} steps in a row took over the {limit:.2f} s limit (the last {seconds:.2f} s)")
        super().__init__(f"timing stopped: {why}")  # the caller says which steps it kept
        self.step, self.seconds, self.limit, self.why = step, seconds, limit, why


def slow_steps(seconds: Sequence[float], max_step_s: float, step: int | None = None) -> StepsTooSlow | None:
    """:func:`slow_step_guard`'s rule on the step times of one run so far: the last
    :data:`SLOW_IN_A_ROW` (2) over ``max_step_s``, or the last over :data:`SLOW_FACTOR` (4) x it.

    Args:
        seconds: Wall-clock seconds of the steps judged so far, in order.
        max_step_s: The limit in seconds (> 0).
        step: The last step's index for the exception (default ``len(seconds) - 1``).

    Returns:
        The :class:`StepsTooSlow` to raise after the last step, or None (also for no steps).
    """
    if not seconds:
        return None
    in_a_row = 0
    for s in reversed(seconds):
        if s <= max_step_s:
            break
        in_a_row += 1
    if in_a_row >= SLOW_IN_A_ROW or seconds[-1] > SLOW_FACTOR * max_step_s:
        return StepsTooSlow(len(seconds) - 1 if step is None else step, seconds[-1], max_step_s, in_a_row)
    return None


def slow_step_guard(max_step_s: float) -> StepHook:
    """A hook stopping a loop whose steps are too slow to be worth timing further.

    It raises :class:`StepsTooSlow` after :data:`SLOW_IN_A_ROW` (2) consecutive steps longer than
    ``max_step_s``, or after one step longer than :data:`SLOW_FACTOR` (4) x ``max_step_s``. Any
    floor belongs to the caller's limit (``autoprec tune``: ``max(3 x fp32 eager step, 0.25 s)``;
    ``autoprec bench``: ``max(max_step_ratio x fp32 eager step, 1 s)``).

    A step during which ``torch.compile`` compiled (:func:`autoprec.device.compile_count` rose: e.g. a dynamic
    graph recompiling for a size-1 batch in the warm-up) is not judged: its time is the compile's.

    Args:
        max_step_s: The limit in seconds (> 0).
    """
    judged: list[float] = []
    compiles = compile_count()

    def hook(k: int, _batch: Any, _stats: StepStats, seconds: float) -> None:
        nonlocal compiles
        seen, compiles = compiles, compile_count()
        if compiles != seen:
            return
        judged.append(seconds)
        del judged[:-SLOW_IN_A_ROW]  # the rule reads no further back (a long training run stays small)
        if (slow := slow_steps(judged, max_step_s, k)) is not None:
            raise slow

    return hook
