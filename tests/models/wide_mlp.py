"""A residual MLP whose activations outweigh its parameters (model.py contract): used by the
memory-budget tests, where recomputation has something to save. One wide block (1024 rows, hidden
768: ~99k parameters, a 3 MiB hidden activation): each compile builds a third of the kernels of
three blocks of hidden 256, at the same parameter count."""

import torch
from torch import nn


class WideMLP(nn.Module):
    def __init__(self, d: int = 64, hidden: int = 768, layers: int = 1) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, hidden), nn.GELU(),
                                                  nn.Linear(hidden, d)) for _ in range(layers))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return nn.functional.mse_loss(x, y)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return WideMLP()


def get_batch(step: int, device: torch.device):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(1024, 64, generator=g)
    return (x.to(device), torch.tanh(x).to(device))
