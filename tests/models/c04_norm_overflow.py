"""Case C04 as a model file: activations |x| > 256 into a hand-written RMSNorm, whose ``x**2``
overflows fp16 (> 65504) so that ``rsqrt(inf)`` zeroes the norm's output: torch.autocast fp16's own
gradients are then ~99% off fp32's (a fresh user's report)."""
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 64)
        self.up = nn.Linear(64, 64)
        self.norm = RMSNorm(64)
        self.head = nn.Linear(64, 256)

    def forward(self, ids):
        return self.head(self.norm(self.up(self.emb(ids)) * 300.0))


def build_model():
    torch.manual_seed(0)
    return Net()


def get_batch(step, device):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 256, (4, 32), generator=g).to(device)


def loss_fn(out, batch):
    return nn.functional.cross_entropy(out.float().flatten(0, 1), batch.roll(1, 1).flatten())
