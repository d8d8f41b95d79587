"""A hand-written nanoGPT (Karpathy's model.py, trimmed) on byte-level Python source.

GPT-2 architecture: learned position embeddings, pre-LayerNorm blocks with causal
self-attention (``F.scaled_dot_product_attention``) and a GELU MLP, weight-tied LM head.
4 layers, 4 heads, width 128, context 128, vocabulary 256 (bytes); random fp32 weights, seed 0.
Data: the CPython standard library's top-level ``.py`` files as bytes, as in ``qwen2_tiny``.

Run::

    autoprec tune examples/nanogpt.py

Entry points (docs/architecture.md#modelpy-contract): ``build_model``, ``get_batch``, ``loss_fn``; optimizer:
default AdamW. Needs only torch.
"""

from __future__ import annotations

import glob
import math
import os
import sysconfig
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

BATCH_SIZE = 8
SEQ_LEN = 128
CORPUS_MAX_BYTES = 2_000_000
_corpus: torch.Tensor | None = None


@dataclass(frozen=True)
class GPTConfig:
    """Model shape. ``block_size`` is the maximum context length."""

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: x [B, T, C] -> [B, T, C]."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    """Linear(C, 4C) -> GELU -> Linear(4C, C)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """``(idx [B, T], targets [B, T] | None) -> (logits [B, T, vocab], loss | None)`` (as nanoGPT)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _b, t = idx.shape
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def build_model(cfg: GPTConfig | None = None) -> nn.Module:
    """The model (fp32, training mode), random init with seed 0; the global RNG is restored."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT(cfg or GPTConfig())
    return model.train()


def _load_corpus() -> torch.Tensor:
    global _corpus
    if _corpus is None:
        stdlib = sysconfig.get_paths()["stdlib"]
        chunks, total = [], 0
        for name in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
            with open(name, "rb") as f:
                data = f.read(CORPUS_MAX_BYTES - total)
            chunks.append(data)
            total += len(data)
            if total >= CORPUS_MAX_BYTES:
                break
        _corpus = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
    return _corpus


def get_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(idx, targets)``: LongTensor[8, 128] windows of the corpus and the next bytes.

    Deterministic in ``step``; the model is called as ``model(idx, targets)``.
    """
    data = _load_corpus()
    gen = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(data) - SEQ_LEN - 1, (BATCH_SIZE,), generator=gen).tolist()
    x = torch.stack([data[s : s + SEQ_LEN] for s in starts]).long()
    y = torch.stack([data[s + 1 : s + 1 + SEQ_LEN] for s in starts]).long()
    return x.to(device), y.to(device)


def loss_fn(output: tuple[torch.Tensor, torch.Tensor],
            batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The model's own mean next-byte cross-entropy (``output[1]``, a scalar)."""
    return output[1]
