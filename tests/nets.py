"""Small models shared by several test files: a pre-norm MLP block, a one-block causal LM with its
batches (and a variant torch.export cannot keep dynamic) for the dynamic-shape tests, and a
two-layer Hugging Face Qwen2 with its batches (transformers needed, imported on use)."""

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


VOCAB = 64


class CausalLM(nn.Module):
    """A one-block causal transformer LM (embedding, causal SDPA attention, MLP, shifted CE loss)."""

    def __init__(self, d: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(VOCAB, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        h = self.emb(input_ids)
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        h = h + self.fc2(nn.functional.gelu(self.fc1(self.ln2(h))))
        logits = self.head(h)[:, :-1]
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels[:, 1:].reshape(-1))


def lm_batch(b: int, t: int, step: int) -> dict[str, torch.Tensor]:
    """A learnable batch: arithmetic progressions of token ids mod VOCAB, random starts."""
    start = torch.randint(0, VOCAB, (b, 1), generator=torch.Generator().manual_seed(step))
    ids = (start + 3 * torch.arange(t)) % VOCAB
    return {"input_ids": ids, "labels": ids.clone()}


class ParityLM(CausalLM):
    """Branches on the sequence length's parity: torch.export cannot keep the length symbolic."""

    def forward(self, input_ids: torch.Tensor,  # type: ignore[override]
                labels: torch.Tensor) -> torch.Tensor:
        loss = super().forward(input_ids, labels)
        return loss * 2 if input_ids.shape[1] % 2 == 0 else loss


def tiny_qwen2() -> nn.Module:
    """A 2-layer Qwen2ForCausalLM (hidden 64, 4 heads, 2 KV heads, SDPA attention, untied head), fp32,
    train mode, weights from seed 0."""
    import transformers as tf

    cfg = tf.Qwen2Config(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
                         use_cache=False, attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(0)
    return tf.Qwen2ForCausalLM(cfg).float().train()


def qwen2_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """A batch for :func:`tiny_qwen2`: ids [2, 32] (int64, < 128) drawn from ``seed``, labels = ids."""
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}
