"""``ddp_mlp.py`` at batch 2B: step k's batch is the concatenation of ``ddp_mlp``'s batches 2k and
2k + 1, which ranks 0 and 1 of ``autoprec train --nproc 2`` train on at step k
(tests/distributed/test_distributed.py)."""

import torch
from ddp_mlp import build_model, loss_fn, make_optimizer  # a neighbour: on sys.path while this file loads
from ddp_mlp import get_batch as get_b_batch

__all__ = ["build_model", "get_batch", "loss_fn", "make_optimizer"]


def get_batch(step: int, device: torch.device):
    (x0, y0), (x1, y1) = get_b_batch(2 * step, device), get_b_batch(2 * step + 1, device)
    return torch.cat([x0, x1]), torch.cat([y0, y1])
