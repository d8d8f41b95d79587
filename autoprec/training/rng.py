"""The one RNG rule of training steps: what random-number state each step runs from.

Every loop over training steps (:func:`autoprec.training.steps.run_steps`: ``autoprec train``,
``train --compare``, the harness's timing and trajectory steps) takes a :class:`StepRng`, and the
harness's drift pass runs its single forward/backward under :func:`same_rng` with
:data:`MEASURE_SEED` (step 0 of the fixed-seed rule). There are three cases
(docs/architecture.md#runtime):

* **stream** (``StepRng()``, ``seed=None``): each step draws from the global generators as the
  previous step, or the process, left them. ``autoprec train`` (a checkpoint saves and restores
  that state, so a resumed run continues the same stream and, eager on the CPU, is bit-identical)
  and the harness's timing steps (timings do not depend on the draws).
* **seeded stream** (``StepRng(seed)``): as stream, but the global generators
  (``torch.manual_seed``: CPU and every CUDA device) are seeded with ``seed`` before step 0, so
  every configuration of ``train --compare`` starts from the same state. A run resumed at a later
  step is not reseeded: its checkpoint restored the state the interrupted run had there.
* **fixed per step** (``StepRng(seed, per_step=True)``): step ``k`` runs from seed ``seed + k``
  (:func:`same_rng`) and the caller's RNG state is given back afterwards, so every configuration
  sees the same random draws (e.g. dropout masks) at step ``k`` whatever earlier steps drew: the
  harness's trajectory check, with ``seed = MEASURE_SEED``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

__all__ = ["MEASURE_SEED", "StepRng", "same_rng"]

#: Seed of the global RNG (CPU, and the CUDA device when on CUDA) at the start of every drift
#: forward/backward (the FP32 reference's and each candidate's) and of every trajectory step
#: (step k: ``MEASURE_SEED + k``), so a model with dropout or other random ops draws the same
#: random numbers in the reference and in every eager candidate (docs/architecture.md#measurements
#: compares gradients "on the same weights and batch"; different dropout masks would make even
#: FP32 differ from itself by grad_rel_l2 ~1). Timing steps are not reseeded.
MEASURE_SEED = 0


@contextlib.contextmanager
def same_rng(device: torch.device, seed: int = MEASURE_SEED) -> Iterator[None]:
    """Run the body from a fixed RNG state and give the caller its RNG state back afterwards.

    Forks the CPU RNG and, on CUDA, ``device``'s RNG (``torch.random.fork_rng``), then seeds
    exactly those generators with ``seed`` (``torch.manual_seed`` would also reseed every other
    CUDA device, whose state ``fork_rng(devices=[device])`` does not restore).

    Eager random ops (``aten.dropout``/``native_dropout``, ``rand``, ``bernoulli``) then draw
    identical numbers in every configuration. Inductor-compiled graphs draw theirs from seeds
    they take from the same generators (``inductor_prims.seeds`` -> ``torch.randint``), so they
    are reproducible run to run but use Inductor's Philox stream, not eager's
    (``torch._inductor.config.fallback_random`` is False): a compiled graph's dropout masks
    differ from an eager graph's even from the same seed. Measurements therefore run compiled
    graphs with random ops under ``fallback_random=True``
    (:meth:`autoprec.measure.harness.Harness._eager_random`), and a policy's graph is compiled with
    it (:data:`autoprec.applied.compile.RANDOM_OPTIONS`), so training draws eager's masks too.

    Args:
        device: The device the body runs on (its CUDA generator is forked and seeded too).
        seed: The seed (a Python int).
    """
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else [], device_type="cuda" if cuda else None):
        torch.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield


@dataclass(frozen=True)
class StepRng:
    """Which of the module docstring's three cases a step loop follows.

    Attributes:
        seed: None for the stream case; otherwise the seed of the seeded-stream case, or the base
            seed (step ``k`` runs from ``seed + k``) of the fixed-per-step case.
        per_step: The fixed-per-step case (needs ``seed``).

    Raises:
        ValueError: ``per_step`` without ``seed``.
    """

    seed: int | None = None
    per_step: bool = False

    def __post_init__(self) -> None:
        if self.per_step and self.seed is None:
            raise ValueError("StepRng(per_step=True) needs a seed (step k runs from seed + k)")

    def begin(self, start: int) -> None:
        """Prepare the global generators before the loop's first step ``start``: seeded with
        ``seed`` in the seeded-stream case when ``start == 0``; untouched otherwise."""
        if self.seed is not None and not self.per_step and start == 0:
            torch.manual_seed(self.seed)

    def step(self, device: torch.device, k: int) -> AbstractContextManager[None]:
        """The context step ``k`` runs in: :func:`same_rng` ``(device, seed + k)`` in the
        fixed-per-step case, nothing otherwise."""
        if self.per_step:
            return same_rng(device, self.seed + k)
        return contextlib.nullcontext()
