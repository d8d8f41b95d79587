"""A larger Qwen2-shaped model for benchmarks: 8 layers, hidden 1024 (~93M fp32 parameters).

Same architecture family and byte-level corpus as :mod:`qwen2_tiny` (CPython stdlib sources,
vocabulary 256, last 10% held out); only the shape and the batch differ. The batch is 1×256
tokens so that one fp32 training step stays in seconds on a small CPU.

Run::

    autoprec tune examples/qwen2_medium.py
"""

from __future__ import annotations

import os
import sys

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qwen2_tiny  # noqa: E402  (corpus and splits are shared, not duplicated)

BATCH_SIZE = 1
SEQ_LEN = 256
VOCAB_SIZE = qwen2_tiny.VOCAB_SIZE


def build_model() -> torch.nn.Module:
    """Qwen2ForCausalLM, 8 layers, hidden 1024, 16 heads (8 KV), MLP 2816; seed 0, fp32.

    The global RNG state is restored afterwards.

    Returns:
        The model on CPU, fp32, in training mode.
    """
    config = Qwen2Config(
        vocab_size=VOCAB_SIZE, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=8, intermediate_size=2816, max_position_embeddings=512,
        tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    return model.float().train()


def _batch(data: torch.Tensor, step: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(data) - SEQ_LEN + 1, (BATCH_SIZE,), generator=gen)
    input_ids = torch.stack([data[s : s + SEQ_LEN] for s in starts.tolist()]).long().to(device)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def get_batch(step: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """A training batch deterministic in ``step``: ``{"input_ids", "labels"}``, LongTensor[1, 256]."""
    return _batch(qwen2_tiny._split(heldout=False), step, device)


def get_heldout_batch(step: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """A held-out batch (last 10% of the corpus); same form as :func:`get_batch`."""
    return _batch(qwen2_tiny._split(heldout=True), step, device)
