"""A residual MLP whose activations outweigh its parameters (model.py contract): used by the
memory-budget tests, where recomputation has something to save. Keep three blocks: compiled in
regions (one block's graph called three times) it is the check of REGION_OPTIONS' in-place half
(autoprec/applied/compile.py): without it the gradients are 12% off; one block, or two of hidden
384, do not show the bug (measured)."""

import torch
from torch import nn


class WideMLP(nn.Module):
    def __init__(self, d: int = 64, hidden: int = 256, layers: int = 3) -> None:
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
