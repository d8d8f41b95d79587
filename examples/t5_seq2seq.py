"""A tiny T5 encoder-decoder on byte-level Python source: the seq2seq example (pad-to-longest batches).

A 2+2-layer, d_model-64 ``transformers.T5ForConditionalGeneration`` (relative position bias,
RMSNorm, ReLU MLP, tied embeddings: T5's defaults) built from a ``T5Config`` with random fp32
weights (seed 0, nothing downloaded). The task is continuation on real text, the CPython standard
library's top-level ``.py`` sources read as bytes (``qwen2_tiny.py``'s corpus): the encoder reads a span of
8-32 bytes, the decoder predicts the 4-16 bytes that follow it, then end-of-sequence. The last 10% of the
corpus is held out.

Batches are what a seq2seq data collator gives (``DataCollatorForSeq2Seq``): every example has its
own source and target length, and each batch is padded to its longest, so shapes change from batch
to batch; ``attention_mask`` marks the source's padding and ``labels`` is padded with -100 (ignored
by the loss). The decoder's inputs come from ``labels`` inside the model (T5 shifts them right and
replaces -100 by the pad id), so the batch holds no ``decoder_input_ids``.

Dropout is T5's default, 0.1 (``dropout_rate``), kept on: it is part of what a user of T5 trains
with. Compiled graphs draw eager's masks (``tune`` measures them so and ``train`` compiles them
so, docs/architecture.md#measurements), so a compiled and an eager run from one seed drop the
same units.

Run::

    autoprec tune examples/t5_seq2seq.py

Entry points (docs/architecture.md#modelpy-contract): ``build_model``, ``get_batch``,
``get_heldout_batch``, ``tokens_per_batch``; the loss is the model's own ``output.loss`` and the
optimizer the default AdamW. Needs only torch and transformers (and ``qwen2_tiny.py`` beside it).
"""

from __future__ import annotations

import os
import sys

import torch
from transformers import T5Config, T5ForConditionalGeneration

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from qwen2_tiny import corpus_split  # noqa: E402  the same corpus and held-out split

BATCH_SIZE = 4
SRC_LEN = (8, 32)  # inclusive range of source lengths, bytes
TGT_LEN = (4, 16)  # inclusive range of target lengths, bytes (end-of-sequence token added)
PAD, EOS, OFFSET = 0, 1, 3  # token ids: pad, end of sequence; byte b is token b + OFFSET
VOCAB_SIZE = 256 + OFFSET


def build_model() -> torch.nn.Module:
    """Build the model: T5ForConditionalGeneration, ~0.18M fp32 parameters, random init with seed 0.

    d_model 64, 2 encoder and 2 decoder layers, 4 heads of 16, d_ff 128, byte vocabulary of 259
    (pad 0, eos 1, unused 2, bytes 3..258), T5's default dropout 0.1, no KV cache.

    Returns:
        The model on CPU, fp32, in training mode. The global RNG state is left as it was.
    """
    config = T5Config(vocab_size=VOCAB_SIZE, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                      num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=16,
                      relative_attention_max_distance=32, dropout_rate=0.1, pad_token_id=PAD,
                      eos_token_id=EOS, decoder_start_token_id=PAD, use_cache=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = T5ForConditionalGeneration(config)
    return model.float().train()


def make_batch(step: int, device: torch.device | str, batch_size: int = BATCH_SIZE,
               heldout: bool = False) -> dict[str, torch.Tensor]:
    """``batch_size`` (source, continuation) pairs, each of its own length, padded to the longest.

    Args:
        step: Seeds the generator that picks the spans and their lengths.
        device: Where the tensors are placed.
        batch_size: Pairs per batch.
        heldout: Draw from the held-out last 10% of the corpus.

    Returns:
        ``{"input_ids": LongTensor[B, S], "attention_mask": LongTensor[B, S], "labels":
        LongTensor[B, T]}``: S the longest source, T the longest target plus one (eos); source
        padding is ``PAD`` with mask 0, label padding -100.
    """
    data = corpus_split(heldout)
    gen = torch.Generator().manual_seed(step)
    src_lens = torch.randint(SRC_LEN[0], SRC_LEN[1] + 1, (batch_size,), generator=gen).tolist()
    tgt_lens = torch.randint(TGT_LEN[0], TGT_LEN[1] + 1, (batch_size,), generator=gen).tolist()
    starts = torch.randint(0, len(data) - SRC_LEN[1] - TGT_LEN[1], (batch_size,), generator=gen).tolist()
    s_max, t_max = max(src_lens), max(tgt_lens) + 1
    input_ids = torch.full((batch_size, s_max), PAD, dtype=torch.long)
    attention_mask = torch.zeros((batch_size, s_max), dtype=torch.long)
    labels = torch.full((batch_size, t_max), -100, dtype=torch.long)
    for i, (start, ls, lt) in enumerate(zip(starts, src_lens, tgt_lens)):
        input_ids[i, :ls] = data[start : start + ls].long() + OFFSET
        attention_mask[i, :ls] = 1
        labels[i, :lt] = data[start + ls : start + ls + lt].long() + OFFSET
        labels[i, lt] = EOS
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device),
            "labels": labels.to(device)}


def get_batch(step: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """A training batch, deterministic in ``step`` (shapes vary from step to step).

    Args:
        step: Training step; seeds the spans and lengths drawn from the training split.
        device: Where the tensors are placed.

    Returns:
        ``{"input_ids", "attention_mask": LongTensor[4, S], "labels": LongTensor[4, T]}`` with
        S in 8..32 and T in 5..17 (see :func:`make_batch`).
    """
    return make_batch(step, device)


def get_heldout_batch(step: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """A batch from the held-out last 10% of the corpus; same form as :func:`get_batch`."""
    return make_batch(step, device, heldout=True)


def tokens_per_batch(batch: dict[str, torch.Tensor]) -> int:
    """Real (unpadded) tokens of a batch: source tokens plus target tokens, padding excluded."""
    return int(batch["attention_mask"].sum()) + int((batch["labels"] != -100).sum())
