"""A down-sized ``examples/qwen2_tiny.py`` for the CPU convergence check (``autoprec train --compare``).

Same architecture family (``transformers.Qwen2ForCausalLM``: GQA, RMSNorm, SwiGLU, rotary), same byte-level
corpus and held-out split (imported from ``examples/qwen2_tiny.py``), but hidden 128, 2 layers, 4 heads
(2 KV heads), sequence 128, batch 4: ~0.43M parameters, about 1/60 of qwen2_tiny's FLOPs per step, so
that a bf16 ``torch.autocast`` curve fits in minutes on a CPU without AVX512-BF16 (where bf16 matmuls
run 10-100x slower than fp32). The full 300-step run on qwen2_tiny itself is a slow job
(``pytest -m slow tests/commands/test_compare.py``).
"""

from __future__ import annotations

import importlib.util
import os

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location(
    "_autoprec_qwen2_tiny_data", os.path.join(_HERE, os.pardir, "examples", "qwen2_tiny.py"))
_q = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_q)

BATCH_SIZE = 4
SEQ_LEN = 128


def build_model() -> torch.nn.Module:
    """Qwen2ForCausalLM, hidden 128, 2 layers, random fp32 init with seed 0 (global RNG restored)."""
    return _q.build_qwen2(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=344, max_position_embeddings=256)


def get_batch(step: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """Training batch ``{"input_ids", "labels"}``: LongTensor[4, 128] byte windows, deterministic in step."""
    return _q.make_batch(step, device, BATCH_SIZE, SEQ_LEN)


def get_heldout_batch(step: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """Batch from the held-out last 10% of the corpus; same form as :func:`get_batch`."""
    return _q.make_batch(step, device, BATCH_SIZE, SEQ_LEN, heldout=True)
