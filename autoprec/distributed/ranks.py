"""Where this process stands among the ranks, and the rank's batches (docs/architecture.md#runtime).

* :class:`Ranks` and :func:`ranks_from_env`: the rank, world size and local rank torchrun sets.
* :func:`init_ranks` / :func:`close_ranks` join and leave the default process group;
  :func:`joined` leaves it only when its block ends normally (a failing rank exits at once).
* :func:`rank_step_batch` is the data rule of ``autoprec train --nproc N``: rank ``r`` of ``N`` at
  step ``k`` trains on ``get_batch(k * N + r)``, so N ranks x batch B see the batches one rank sees
  in N x as many steps, and their averaged gradient is that of the N batches concatenated.
* :class:`JobStep` makes a step's logged numbers the whole job's: the loss averaged over the ranks,
  the tokens summed over them, the seconds the slowest rank's.

The wrappers over an applied module are :mod:`autoprec.distributed.wrap`; the launch of N ranks
(``--nproc``) is :func:`autoprec.commands.launch.launch`.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autoprec.errors import AutoprecError
from autoprec.training.train import StepStats

__all__ = ["JobStep", "Ranks", "close_ranks", "init_ranks", "joined", "rank_step_batch", "ranks_from_env"]


@dataclass(frozen=True)
class Ranks:
    """Where this process stands: ``rank`` of ``world`` ranks, ``local_rank`` on its machine."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def lead(self) -> bool:
        """True on rank 0, the one that prints, logs and writes checkpoints."""
        return self.rank == 0


def ranks_from_env() -> Ranks:
    """The :class:`Ranks` torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``); one rank without.

    Raises:
        AutoprecError: a variable is not an integer or the rank is outside ``[0, WORLD_SIZE)``.
    """
    try:
        r = Ranks(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                  int(os.environ.get("LOCAL_RANK", 0)))
    except ValueError as e:
        raise AutoprecError(f"RANK/WORLD_SIZE/LOCAL_RANK: not an integer ({e})") from None
    if not 0 <= r.rank < r.world:
        raise AutoprecError(f"RANK={r.rank} is outside [0, WORLD_SIZE={r.world})")
    return r


def init_ranks(device: torch.device, ranks: Ranks) -> torch.device:
    """Join the default process group when ``ranks.world > 1`` (gloo on CPU, NCCL on CUDA, rendezvous
    from torchrun's ``MASTER_ADDR``/``MASTER_PORT``); the device this rank trains on.

    Returns:
        ``device`` on CPU or with one rank; ``cuda:<local_rank>`` (made current) on CUDA.
    """
    if ranks.world <= 1:
        return device
    if device.type == "cuda":
        device = torch.device("cuda", ranks.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=ranks.rank,
                                world_size=ranks.world)
    return device


@contextlib.contextmanager
def joined(ranks: Ranks) -> Iterator[None]:
    """Run the block in the process group :func:`init_ranks` joined, and leave it after
    (:func:`close_ranks`) when the block ends normally. A rank whose block raises leaves at once,
    without the barrier: the others may be waiting in a step's collective (DDP's all-reduce) that
    it will never join, and a barrier there waited for them forever (gloo's 30-minute timeout);
    the rank exits with its error, and torchrun stops the others (docs/distributed.md)."""
    yield
    close_ranks(ranks)


def close_ranks(ranks: Ranks) -> None:
    """Leave the default process group :func:`init_ranks` joined (no-op with one rank), after a
    barrier: a rank destroying gloo's group while another still talks to it can abort
    (``terminate called without an active exception``). A ``DistributedDataParallel`` module
    lives in a reference cycle and its C++ reducer holds the group: the cyclic GC runs first, so
    no reducer keeps gloo's threads alive past the group's destruction into interpreter exit."""
    if ranks.world > 1 and dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
        gc.collect()


def rank_step_batch(get_batch: Callable[[int, torch.device], Any], device: torch.device,
                    ranks: Ranks) -> Callable[[int], Any]:
    """Step ``k``'s batch of this rank: ``get_batch(k * world + rank, device)`` (module docstring)."""
    return lambda k: get_batch(k * ranks.world + ranks.rank, device)


class JobStep:
    """A step hook (:data:`autoprec.training.steps.StepHook`) making each step's numbers the whole
    job's, so rank 0 logs and prints what all the ranks did together (docs/distributed.md):

    * ``stats.loss`` is replaced by the mean of the ranks' losses (each rank's own batch);
    * :attr:`tokens` is the step's tokens summed over the ranks (``tokens_of(batch)`` on each);
    * :attr:`seconds` is the step's wall-clock seconds on the slowest rank (DDP's all-reduce holds
      every rank in step; a step of the job is done when its last rank is).

    Every rank must run it (one ``all_gather`` per step); with one rank it gathers nothing and the
    numbers are the process's own. Hooks after it read :attr:`tokens` and :attr:`seconds`.

    Args:
        ranks: This process among the ranks. tokens_of: ``tokens_of(batch)``, the tokens of this
            rank's batch (the model file's ``tokens_per_batch``).

    Attributes:
        tokens: The last step's tokens, all ranks together (0.0 before the first step).
        seconds: The last step's seconds, the slowest rank's (0.0 before the first step).
    """

    def __init__(self, ranks: Ranks, tokens_of: Callable[[Any], float]) -> None:
        self.ranks, self.tokens_of = ranks, tokens_of
        self.tokens = self.seconds = 0.0

    def __call__(self, _k: int, batch: Any, stats: StepStats, seconds: float) -> None:
        tokens = float(self.tokens_of(batch))
        if self.ranks.world <= 1:
            self.tokens, self.seconds = tokens, seconds
            return
        mine = torch.tensor([stats.loss, tokens, seconds], dtype=torch.float64)
        every = [torch.empty_like(mine) for _ in range(self.ranks.world)]
        dist.all_gather(every, mine)
        stats.loss = float(sum(t[0] for t in every)) / self.ranks.world
        self.tokens = float(sum(t[1] for t in every))
        self.seconds = max(float(t[2]) for t in every)
