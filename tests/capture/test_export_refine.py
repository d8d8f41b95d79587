"""The export's refinement retry (``autoprec.capture.export``) takes a dimension torch fixes to its
example's size: a T5 over pad-to-longest batches of 2 rows got the batch range 1..2, where torch
specialises 1 and so fixed ``batch = 2``; the retry refused any fixed size, the model fell back to
one graph per shape, and ``autoprec train`` died at its 17th sequence-length pair (a user's run at
step 27). Now the batch is static and both sequence lengths dynamic: one graph for every step, whose
losses are the model's own, and a batch of another size gets a graph of its own."""

from __future__ import annotations

import pytest
import torch

import autoprec
from autoprec.applied.shape_cache import is_dynamic
from autoprec.capture import capture_for

tf = pytest.importorskip("transformers")


def _t5():
    torch.manual_seed(0)
    return tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)).train()


def _batch(step: int, rows: int = 2) -> dict[str, torch.Tensor]:
    """``rows`` pairs padded to their own longest source (4-12) and target (3-9)."""
    g = torch.Generator().manual_seed(step)
    ls, lt = torch.randint(4, 13, (rows,), generator=g), torch.randint(3, 10, (rows,), generator=g)
    src = torch.randint(1, 64, (rows, int(ls.max())), generator=g)
    tgt = torch.randint(1, 64, (rows, int(lt.max())), generator=g)
    am = (torch.arange(src.shape[1])[None] < ls[:, None]).long()
    tm = torch.arange(tgt.shape[1])[None] < lt[:, None]
    return {"input_ids": src * am, "attention_mask": am, "labels": tgt.masked_fill(~tm, -100)}


def test_a_batch_torch_fixes_at_its_example_size_keeps_the_sequences_dynamic():
    model, eager = _t5(), _t5()
    batches = [_batch(step) for step in range(16)]
    assert len({(b["input_ids"].shape[1], b["labels"].shape[1]) for b in batches}) > 8
    gm = capture_for(model, batches)  # ranges reaching every batch: no recapture below
    assert is_dynamic(gm)
    mp = autoprec.apply(model, autoprec.Policy.fp32(), batches[0], compile=False, graph_module=gm)
    for b in batches:
        torch.testing.assert_close(mp(**b).loss, eager(**b).loss, rtol=1e-5, atol=1e-6)
    assert mp.shape_stats == {"mode": "dynamic", "captures": 1}  # not a graph per length pair
    b = _batch(99, rows=3)  # another batch size: a graph of its own
    torch.testing.assert_close(mp(**b).loss, eager(**b).loss, rtol=1e-5, atol=1e-6)
