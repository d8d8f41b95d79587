"""The MLP of sgd_mlp.py trained with SGD with momentum (one momentum buffer per parameter), for
the memory tests: its training state is parameters + gradients + momentum, 3x the parameter bytes."""

import torch
from torch import nn


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8))


def get_batch(step: int, device: torch.device):
    g = torch.Generator().manual_seed(step)
    return (torch.randn(4, 32, generator=g).to(device),)


def loss_fn(out, batch):
    return out.pow(2).mean()


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)
