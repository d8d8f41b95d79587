"""A deep, narrow Qwen2 (24 layers, hidden 256) on the same byte-level corpus as ``qwen2_tiny.py``:
the depth case of the autocast-twin issue, where the residual stream stored in bf16 drifts 1.26x
torch.autocast's. Batches are 4 x 128 bytes.

Run::

    autoprec tune examples/qwen2_deep.py

Entry points (docs/architecture.md#modelpy-contract): ``build_model``, ``get_batch``; the loss is
the model's own ``output.loss`` and the optimizer the default AdamW.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from qwen2_tiny import build_qwen2, make_batch  # noqa: E402

LAYERS = 24
HIDDEN = 256
BATCH_SIZE = 4
SEQ_LEN = 128


def build_model() -> torch.nn.Module:
    """Qwen2ForCausalLM, 24 layers of hidden 256 (4 heads, 2 KV heads, MLP 688), random init with
    seed 0, fp32, training mode (~17.5M parameters; 1783 captured nodes).

    Returns:
        The model on CPU, fp32, in training mode (dropout 0).
    """
    return build_qwen2(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=688)


def get_batch(step: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """A training batch, deterministic in ``step``: ``{"input_ids", "labels"}``, LongTensor[4, 128]
    of byte values from the training split of ``qwen2_tiny``'s corpus."""
    return make_batch(step, device, batch_size=BATCH_SIZE, seq_len=SEQ_LEN)
