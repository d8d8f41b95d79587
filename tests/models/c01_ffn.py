"""Case C01 as a model file: x @ w = 256 * 16 * 16.2 = 66355 > fp16 max (65504), then a residual
add and an RMSNorm (inf -> NaN). Used by the C01 and monitor tests."""

import torch
from torch import nn


class FFN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(256, 1, bias=False)
        self.norm_weight = nn.Parameter(torch.ones(1))
        with torch.no_grad():
            self.proj.weight.fill_(16.2)

    def forward(self, x):
        h = self.proj(x) + x[:, :1]  # residual
        return self.norm_weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


def build_model() -> nn.Module:
    return FFN()


def get_batch(step: int, device: torch.device):
    return (torch.full((1, 256), 16.0, device=device),)


def loss_fn(out, batch):
    return out.float().sum()


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.1)
