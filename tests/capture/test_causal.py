"""Causal masks built from shapes become SDPA's ``is_causal`` at capture (autoprec/capture/causal.py);
masks that read data, or are not causal, stay."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoprec.capture import capture
from autoprec.capture.causal import causal_attention
from tests.nets import qwen2_batch, tiny_qwen2

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _sdpa(gm):
    return [n for n in gm.graph.nodes if n.target is SDPA]


def _mask(n):
    return n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")


def _causal(n):
    return n.args[5] if len(n.args) > 5 else n.kwargs.get("is_causal", False)


def _loss_and_grads(fn, model, batch):
    model.zero_grad()
    loss = fn(**batch).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("dynamic", [False, True])
def test_hugging_face_causal_mask_becomes_is_causal_with_the_same_numbers(dynamic):
    torch.manual_seed(0)
    model, batch = tiny_qwen2(), qwen2_batch()
    gm = capture(model, batch, dynamic=dynamic)
    nodes = _sdpa(gm)
    assert len(nodes) == 2
    assert all(_mask(n) is None and _causal(n) is True for n in nodes)
    assert not any(n.target is torch.ops.aten.le.Tensor for n in gm.graph.nodes)  # the mask is gone
    ref_loss, ref_grads = _loss_and_grads(model, model, batch)
    loss, grads = _loss_and_grads(gm, model, batch)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


def test_a_padding_mask_read_from_the_batch_stays():
    torch.manual_seed(0)
    model, batch = tiny_qwen2(), qwen2_batch()
    mask = torch.ones_like(batch["input_ids"])
    mask[0, -3:] = 0
    gm = capture(model, {**batch, "attention_mask": mask})
    assert all(_mask(n) is not None and not _causal(n) for n in _sdpa(gm))


class _Attn(nn.Module):
    """One attention over ``x`` [B, T, 8] with a mask built from T by ``kind``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        t = x.shape[1]
        ones = torch.ones(t, t, dtype=torch.bool, device=x.device)
        if self.kind == "bool-causal":
            mask = ones.tril()
        elif self.kind == "float-causal":
            mask = torch.zeros(t, t, device=x.device).masked_fill(~ones.tril(), float("-inf"))
        elif self.kind == "window":  # causal, at most 2 back: not SDPA's causal mask
            mask = ones.tril() & ~ones.tril(-3)
        elif self.kind == "full":
            mask = ones
        else:  # "data": causal and the input's own padding (tokens equal to 0 are masked)
            mask = ones.tril() & (x[:, None, None, :, 0] != 0)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()


@pytest.mark.parametrize("kind,rewritten", [("bool-causal", True), ("float-causal", True),
                                            ("window", False), ("full", False), ("data", False)])
def test_only_a_causal_mask_computed_from_shapes_is_replaced(kind, rewritten):
    torch.manual_seed(0)
    model, x = _Attn(kind), torch.randn(2, 6, 8)
    gm = capture(model, x, dynamic=True)
    (node,) = _sdpa(gm)
    assert (_mask(node) is None and _causal(node) is True) == rewritten
    torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)
    x2 = torch.randn(1, 6, 8)  # another batch size of the dynamic capture
    torch.testing.assert_close(gm(x2), model(x2), rtol=1e-5, atol=1e-5)


def test_a_graph_without_masks_is_left_alone():
    torch.manual_seed(0)
    gm = capture(nn.Linear(4, 4), torch.randn(2, 4))
    code = gm.code
    assert causal_attention(gm) == 0
    assert gm.code == code


def _hf(arch: str) -> nn.Module:
    import transformers as tf

    small = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, use_cache=False, attn_implementation="sdpa")
    if arch == "gpt2":
        cfg = tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, use_cache=False,
                            attn_implementation="sdpa", resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
        return tf.GPT2LMHeadModel(cfg)
    if arch == "mistral, sliding window 8":
        return tf.MistralForCausalLM(tf.MistralConfig(sliding_window=8, **small))
    cfg = tf.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=96, attn_implementation="sdpa", hidden_dropout_prob=0,
                        attention_probs_dropout_prob=0)
    return tf.BertForMaskedLM(cfg)


@pytest.mark.parametrize("arch,causal", [("gpt2", 2), ("mistral, sliding window 8", 0), ("bert", 0)])
def test_other_architectures_keep_their_logits(arch, causal):
    """GPT-2's causal mask is replaced; Mistral's sliding window (8 of 24 positions) and BERT's
    bidirectional attention are not causal masks and stay; the logits are the model's, exactly."""
    torch.manual_seed(0)
    model = _hf(arch).float().eval()
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    gm = capture(model, batch)
    assert sum(_causal(n) is True and _mask(n) is None for n in _sdpa(gm)) == causal
    with torch.no_grad():
        torch.testing.assert_close(gm(**batch).logits, model(**batch).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window,causal", [(64, 0), (None, 2)])
def test_a_dynamic_capture_shorter_than_a_sliding_window_keeps_the_window(window, causal):
    """Captured at 24 tokens, a 64-token sliding window is causal at every size up to 64: the mask
    is also evaluated past the largest integer in its code, so it stays, and at 80 tokens the
    graph still attends within the window only (the model's logits); without a window the mask
    becomes ``is_causal``, and 80 tokens match too."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                           attn_implementation="sdpa", sliding_window=window, max_position_embeddings=256)
    model = tf.MistralForCausalLM(cfg).float().eval()
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    gm = capture(model, {"input_ids": ids, "labels": ids}, dynamic=True)
    assert sum(_causal(n) is True and _mask(n) is None for n in _sdpa(gm)) == causal
    long = torch.randint(0, 128, (2, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(gm(input_ids=long, labels=long).logits,
                                   model(input_ids=long, labels=long).logits, rtol=1e-5, atol=1e-5)


class _Window(nn.Module):
    """Token ids -> logits through one attention whose 40-token sliding window is written as
    ``kind`` says; ``config.max_position_embeddings`` 128 makes the sequence length dynamic."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        import types

        self.kind, self.window = kind, 40
        self.config = types.SimpleNamespace(max_position_embeddings=128)
        self.emb, self.qkv, self.out = nn.Embedding(64, 32), nn.Linear(32, 96), nn.Linear(32, 64)
        self.register_buffer("win", torch.tensor(40))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 16).permute(2, 0, 3, 1, 4)
        i = torch.arange(t, device=x.device)
        causal = i[:, None] >= i[None, :]
        if self.kind == "triu":
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril().triu(-(self.window - 1))
        elif self.kind == "negative":
            mask = causal & ((i[None, :] - i[:, None]) > -self.window)
        elif self.kind == "float":
            mask = causal & ((i[:, None] - i[None, :]) < float(self.window))
        else:  # "buffer"
            mask = causal & ((i[:, None] - i[None, :]) < self.win)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, t, 32))


@pytest.mark.parametrize("kind", ["triu", "negative", "float", "buffer"])
def test_a_window_written_without_a_positive_integer_is_still_found(kind):
    """A 40-token window looks causal at the captured 32 tokens; written as ``triu(-39)``, as
    ``j - i > -40``, as a float or in a buffer, it is still found (the mask is also evaluated past
    the largest magnitude it reads, and at the top of the capture's range), so at 60 tokens the
    captured graph attends as the model does."""
    torch.manual_seed(0)
    model = _Window(kind)
    gm = capture(model, torch.randint(0, 64, (2, 32)), dynamic=True)
    assert not any(_causal(n) is True for n in _sdpa(gm))
    x = torch.randint(0, 64, (2, 60))
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)
