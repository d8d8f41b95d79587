"""One decision on every rank: the loss scaler's inf/NaN flag all-reduced (MAX) over a process group
(docs/architecture.md#runtime), as torch's ``ShardedGradScaler``
(torch/distributed/fsdp/sharded_grad_scaler.py, ``unscale_``) agrees on ``found_inf``, so one rank's
non-finite gradient makes every rank skip and back off together."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["any_rank", "grad_device"]


def any_rank(flag: bool, group: Any = None, device: torch.device | None = None) -> bool:
    """Whether ``flag`` is True on any rank of ``group`` (None: the default group), by an all-reduce
    MAX of a 0-dim fp32 tensor on ``device`` (default CPU; the current CUDA device under NCCL); just
    ``flag`` without an initialised ``torch.distributed`` or in a group of one rank. Every rank gets
    the same answer.

    Raises:
        RuntimeError: from the collective (a peer died, a timeout).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) <= 1:
        return bool(flag)
    if "nccl" in str(dist.get_backend(group)):
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor(1.0 if flag else 0.0, dtype=torch.float32, device=device or "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item() > 0)


def grad_device(optimizer: torch.optim.Optimizer) -> torch.device | None:
    """The device of the optimizer's first parameter (None if it has none)."""
    return next((p.device for g in optimizer.param_groups for p in g["params"]), None)
