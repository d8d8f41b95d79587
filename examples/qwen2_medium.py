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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qwen2_tiny

BATCH_SIZE = 1
SEQ_LEN = 256
VOCAB_SIZE = qwen2_tiny.VOCAB_SIZE


def build_model() -> torch.nn.Module:
    """Qwen2ForCausalLM, 8 layers, hidden 1024, 16 heads (8 KV), MLP 2816; seed 0, fp32.

    The global RNG state is restored afterwards.

    Returns:
        The model on CPU, fp32, in training mode.
    """
    return qwen2_tiny.build_qwen2(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                                  num_key_value_heads=8, intermediate_size=2816)


def get_batch(step: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """A training batch deterministic in ``step``: ``{"input_ids", "labels"}``, LongTensor[1, 256]."""
    return qwen2_tiny.make_batch(step, device, BATCH_SIZE, SEQ_LEN)


def get_heldout_batch(step: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """A held-out batch (last 10% of the corpus); same form as :func:`get_batch`."""
    return qwen2_tiny.make_batch(step, device, BATCH_SIZE, SEQ_LEN, heldout=True)
