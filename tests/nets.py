"""Small models shared by several test files."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """A pre-norm MLP block with an embedding and a head: ids [B, T] (int64, < 100) -> scalar loss
    (cross entropy against the ids). Its matmuls, layer norm and gelu save activations for backward."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, d)
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.head = nn.Linear(d, 100)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(h))))
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())
