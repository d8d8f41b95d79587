"""A Qwen2-0.5B-shaped model for the GPU check (random weights, byte-level vocabulary).

Shape of Qwen2-0.5B: hidden 896, 24 layers, 14 attention heads, 2 KV heads, MLP 4864, tied
embeddings; the vocabulary is trimmed to 256 bytes (the 151k-token embedding would dominate
the parameter count and needs a tokenizer download). ~358M fp32 parameters. Batches come from
the same stdlib corpus as :mod:`qwen2_tiny`, 8×512 tokens.

Environment:
    AUTOPREC_QWEN2_05B_TINY=1 shrinks the model to 2 layers, hidden 64 and the batch to 2×32,
    same code path, for CPU dry runs of ``benchmarks/gpu_check.sh``.

Run::

    autoprec tune examples/qwen2_05b.py --device cuda
"""

from __future__ import annotations

import os
import sys

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qwen2_tiny

TINY = os.environ.get("AUTOPREC_QWEN2_05B_TINY", "") not in ("", "0")
BATCH_SIZE, SEQ_LEN = (2, 32) if TINY else (8, 512)
VOCAB_SIZE = qwen2_tiny.VOCAB_SIZE


def make_config(tiny: bool = TINY) -> Qwen2Config:
    """The Qwen2-0.5B shape (or, with ``tiny``, a 2-layer hidden-64 stand-in for dry runs)."""
    if tiny:
        shape = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "intermediate_size": 128}
    else:
        shape = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
                 "num_key_value_heads": 2, "intermediate_size": 4864}
    return Qwen2Config(vocab_size=VOCAB_SIZE, max_position_embeddings=max(SEQ_LEN, 512), rope_theta=1e6,
                       rms_norm_eps=1e-6, tie_word_embeddings=True, use_cache=False,
                       attn_implementation="sdpa", **shape)


def build_model() -> torch.nn.Module:
    """Qwen2ForCausalLM of :func:`make_config`, seed 0, fp32, training mode (RNG restored)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(make_config())
    return model.float().train()


def get_batch(step: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """A training batch deterministic in ``step``: ``{"input_ids", "labels"}``,
    LongTensor[8, 512] (LongTensor[2, 32] when tiny)."""
    return qwen2_tiny.make_batch(step, device, BATCH_SIZE, SEQ_LEN)


def get_heldout_batch(step: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """A held-out batch (last 10% of the corpus); same form as :func:`get_batch`."""
    return qwen2_tiny.make_batch(step, device, BATCH_SIZE, SEQ_LEN, heldout=True)
