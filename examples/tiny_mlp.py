"""A tiny pure-torch byte model for fast tests (no transformers).

Embedding(256, 64) → 2 residual blocks (LayerNorm → Linear → GELU → Linear) → LayerNorm → Linear
head over 256 byte values. Batches are random but seeded byte tokens, given to the model as one
tensor (``model(batch)``); the target of each token is a fixed permutation of its value, so the
task is learnable per position and the loss falls under training.

Run::

    autoprec tune examples/tiny_mlp.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB_SIZE = 256
DIM = 64
BATCH_SIZE = 8
SEQ_LEN = 32

# target(token) = (167 * token + 13) mod 256: a bijection on bytes since 167 is odd.
_TARGET = (torch.arange(VOCAB_SIZE) * 167 + 13) % VOCAB_SIZE


class Block(nn.Module):
    """Pre-norm residual MLP block: ``x + fc2(gelu(fc1(norm(x))))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TinyMLP(nn.Module):
    """Byte embedding, two residual MLP blocks, final LayerNorm, linear head."""

    def __init__(self, vocab: int = VOCAB_SIZE, dim: int = DIM) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim, 4 * dim) for _ in range(2)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Map ``input_ids`` LongTensor[B, T] to logits FloatTensor[B, T, vocab]."""
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model() -> nn.Module:
    """Build :class:`TinyMLP` (~100k fp32 parameters), seed 0; the global RNG is left untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return TinyMLP()


def get_batch(step: int, device: torch.device | str) -> torch.Tensor:
    """Random byte tokens seeded by ``step``.

    Args:
        step: Seeds the generator; the same step gives the same batch.
        device: Where the tensor is placed.

    Returns:
        LongTensor[8, 32] with values in 0..255.
    """
    gen = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB_SIZE, (BATCH_SIZE, SEQ_LEN), generator=gen).to(device)


def loss_fn(output: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits against the fixed permutation of each input byte.

    Args:
        output: Logits FloatTensor[B, T, 256] (any float dtype; upcast to fp32 here).
        batch: The input LongTensor[B, T].

    Returns:
        Scalar fp32 mean cross-entropy (ln 256 ≈ 5.55 for uniform logits).
    """
    target = _TARGET.to(batch.device)[batch]
    return F.cross_entropy(output.float().reshape(-1, output.shape[-1]), target.reshape(-1))
