"""A three-layer MLP regression for the distributed tests (tests/distributed/test_distributed.py): batch B = 4
rows of ``(x, y = x @ TEACHER)``, x drawn from ``step``. ``autoprec train --nproc N`` gives rank r at step k
the batch ``get_batch(k * N + r)``; ``ddp_mlp_2b.py`` concatenates those of N = 2 into one batch."""

import torch
from torch import nn

B = 4


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.net(x) - y).pow(2).mean()


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Regression()


#: The linear map the regression learns (so the loss falls).
TEACHER = torch.randn(16, 4, generator=torch.Generator().manual_seed(7)) / 4


def get_batch(step: int, device: torch.device):
    x = torch.randn(B, 16, generator=torch.Generator().manual_seed(1000 + step))
    return x.to(device), (x @ TEACHER).to(device)


def loss_fn(out, batch):
    return out


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.5)
