"""The model of this run of ``autoprec bench --nproc 2`` (README.md here): four 512 x 512 Linear
layers (1,050,624 parameters, 4.0 MiB in fp32) on batches of 4 rows, so the parameters' state,
not the activations, sets the peak (docs/architecture.md#runtime, "Memory under sharding")."""

import torch
from torch import nn

D = 512


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D), nn.ReLU(),
                                    nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.layers(x) - y).pow(2).mean()


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def get_batch(step: int, device: torch.device):
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(step))
    return x.to(device), torch.tanh(x).to(device)


def loss_fn(out, batch):
    return out


def tokens_per_batch(batch) -> int:
    return int(batch[0].shape[0])
