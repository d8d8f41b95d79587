"""A micro language model (model.py contract) small enough that even emulated bf16 runs fast:
used by the search tests that start whole ``autoprec tune`` processes."""

import torch
from torch import nn


class MicroLM(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(),
                                                  nn.Linear(2 * d, d)) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for b in self.blocks:
            h = h + b(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), ids.roll(1, 1).flatten())


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return MicroLM()


def get_batch(step: int, device: torch.device):
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, 64, (2, 8), generator=g).to(device),)
