"""A tiny Qwen2 language model on byte-level Python source: autoprec's reference example.

A 4-layer, hidden-512 ``transformers.Qwen2ForCausalLM`` (grouped-query attention, RMSNorm,
SwiGLU MLP, rotary embeddings: the op mix of a modern LLM) with random fp32 weights (seed 0,
never downloaded), trained on real text: the CPython standard library's own top-level ``.py``
sources, read as bytes (vocabulary 256). The last 10% of the corpus is held out.

Run::

    autoprec tune examples/qwen2_tiny.py

Entry points (docs/architecture.md#modelpy-contract): ``build_model``, ``get_batch``, ``get_heldout_batch``;
the loss is the model's own ``output.loss`` (batches carry ``labels``) and the optimizer the default AdamW.
Needs only torch and transformers.
"""

from __future__ import annotations

import glob
import os
import sysconfig

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

BATCH_SIZE = 4
SEQ_LEN = 256
VOCAB_SIZE = 256
CORPUS_MAX_BYTES = 4_000_000  # cap so the corpus (and its 10% held-out tail) is fixed-size
HELDOUT_FRACTION = 0.1

_corpus: torch.Tensor | None = None  # uint8 [n_bytes], loaded once per process


def build_qwen2(**shape) -> torch.nn.Module:
    """A Qwen2ForCausalLM with byte-level vocabulary, random init with seed 0, fp32, training mode.

    Args:
        **shape: ``Qwen2Config`` fields (hidden_size, num_hidden_layers, ...) overriding the
            defaults below (no KV cache, SDPA attention, untied embeddings).

    The global RNG state is restored afterwards, so building does not perturb the caller.
    """
    fields = {"vocab_size": VOCAB_SIZE, "max_position_embeddings": 512, "tie_word_embeddings": False,
              "use_cache": False, "attn_implementation": "sdpa", **shape}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(**fields))
    return model.float().train()


def build_model() -> torch.nn.Module:
    """Build the model: Qwen2ForCausalLM, ~11.9M fp32 parameters, random init with seed 0.

    Returns:
        The model on CPU, fp32, in training mode (dropout is 0 in this config).
    """
    return build_qwen2(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                       intermediate_size=1376)


def _load_corpus() -> torch.Tensor:
    """The corpus as uint8 bytes: sorted top-level stdlib ``*.py`` files, capped at 4 MB."""
    global _corpus
    if _corpus is None:
        stdlib = sysconfig.get_paths()["stdlib"]
        chunks: list[bytes] = []
        total = 0
        for name in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
            with open(name, "rb") as f:
                data = f.read(CORPUS_MAX_BYTES - total)
            chunks.append(data)
            total += len(data)
            if total >= CORPUS_MAX_BYTES:
                break
        if total < 10 * BATCH_SIZE * SEQ_LEN:
            raise RuntimeError(f"stdlib sources under {stdlib} too small for a corpus ({total} bytes)")
        _corpus = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
    return _corpus


def corpus_split(heldout: bool) -> torch.Tensor:
    """The training split (first 90%) or the held-out split (last 10%) of the corpus, uint8 bytes;
    ``qwen2_deep.py`` and ``t5_seq2seq.py`` read the same corpus through it."""
    corpus = _load_corpus()
    n_train = int(len(corpus) * (1.0 - HELDOUT_FRACTION))
    return corpus[n_train:] if heldout else corpus[:n_train]


def make_batch(step: int, device: torch.device | str, batch_size: int = BATCH_SIZE, seq_len: int = SEQ_LEN,
               heldout: bool = False) -> dict[str, torch.Tensor]:
    """``batch_size`` windows of ``seq_len`` bytes from the training (or held-out) split, chosen
    by a generator seeded with ``step``: ``{"input_ids", "labels"}``, LongTensor[batch, seq]."""
    data = corpus_split(heldout)
    gen = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(data) - seq_len + 1, (batch_size,), generator=gen)
    input_ids = torch.stack([data[s : s + seq_len] for s in starts.tolist()]).long().to(device)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def get_batch(step: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """A training batch, deterministic in ``step``.

    Args:
        step: Training step; seeds the choice of windows from the training split.
        device: Where the tensors are placed.

    Returns:
        ``{"input_ids": LongTensor[4, 256], "labels": LongTensor[4, 256]}``, equal byte values
        in 0..255 (the model shifts labels internally for next-token prediction).
    """
    return make_batch(step, device)


def get_heldout_batch(step: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """A batch from the held-out last 10% of the corpus; same form as :func:`get_batch`.

    Args:
        step: Seeds the choice of windows from the held-out split.
        device: Where the tensors are placed.

    Returns:
        ``{"input_ids": LongTensor[4, 256], "labels": LongTensor[4, 256]}``.
    """
    return make_batch(step, device, heldout=True)
