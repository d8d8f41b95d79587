"""use_cache=False for training through a wrapper whose forward takes ``**kwargs`` (peft's ``PeftModel``:
``get_base_model()``, or a module holding the model as ``.model``): captured and trained like the model
itself, while a ``**kwargs`` that reaches no ``use_cache`` parameter is not given one, and the CaptureError
of a model that still returns a cache says what the user can do."""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from torch import nn

import autoprec
from autoprec.capture import CALL_KWARGS_META, capture
from autoprec.errors import CaptureError
from autoprec.modelspec import training_kwargs


class KVCache:
    """Stands for transformers' DynamicCache: an unregistered class holding tensors."""

    def __init__(self, h: torch.Tensor) -> None:
        self.keys = h


class CacheLM(nn.Module):
    """A causal LM whose forward defaults to use_cache=True and then returns a cache, as HF's do."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 32)

    def forward(self, input_ids, labels=None, use_cache=True):
        h = self.emb(input_ids)
        logits = self.head(torch.tanh(h))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits, "cache": KVCache(h) if use_cache else None}


class NoCacheLM(CacheLM):
    """A model whose forward has no use_cache parameter (and would reject one)."""

    def forward(self, input_ids, labels=None):
        return super().forward(input_ids, labels, use_cache=False)


class Wrapper(nn.Module):
    """A user's wrapper: forward(**kwargs) passes everything to ``self.model``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **kwargs):
        return self.model(**kwargs)


class BaseModelWrapper(nn.Module):
    """A wrapper that names its model through ``get_base_model()`` (as peft's PeftModel), under another
    attribute name."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.inner = model

    def get_base_model(self) -> nn.Module:
        return self.inner

    def forward(self, input_ids, **kwargs):
        return self.inner(input_ids, **kwargs)


class Fixed(nn.Module):
    """A wrapper without ``**kwargs``: it calls the model with its default use_cache=True."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels=None):
        return self.model(input_ids=input_ids, labels=labels)


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def test_training_kwargs_follow_kwargs_to_the_wrapped_model():
    ids = torch.zeros(1, 2, dtype=torch.long)
    assert training_kwargs(Wrapper(CacheLM()), (), {"input_ids": ids}) == {"use_cache": False}
    assert training_kwargs(BaseModelWrapper(CacheLM()), (ids,), {}) == {"use_cache": False}
    assert training_kwargs(Wrapper(Wrapper(BaseModelWrapper(CacheLM()))), (), {"input_ids": ids}) == {
        "use_cache": False}
    # the batch sets it; the model reached takes no use_cache; the wrapper takes no **kwargs
    assert training_kwargs(Wrapper(CacheLM()), (), {"input_ids": ids, "use_cache": True}) == {}
    assert training_kwargs(Wrapper(NoCacheLM()), (), {"input_ids": ids}) == {}
    assert training_kwargs(Fixed(CacheLM()), (), {"input_ids": ids}) == {}
    # set positionally on the model reached (input_ids, labels, use_cache)
    assert training_kwargs(BaseModelWrapper(CacheLM()), (ids, ids, True), {}) == {}


@pytest.mark.parametrize("wrap", [Wrapper, BaseModelWrapper])
def test_a_kwargs_wrapper_is_captured_without_a_cache(wrap, caplog, monkeypatch):
    monkeypatch.setattr(sys.modules["autoprec.capture.trace"], "_announced", set())  # as in a fresh process
    torch.manual_seed(0)
    model, batch = wrap(CacheLM()), _batch()
    with caplog.at_level(logging.INFO, logger="autoprec"):
        gm = capture(model, batch)
    said = [r.getMessage() for r in caplog.records if r.name == "autoprec"]
    assert len(said) == 1 and wrap.__name__ in said[0] and "use_cache=False" in said[0]
    assert gm.meta[CALL_KWARGS_META] == {"use_cache": False}
    out, ref = gm(**batch), model(**batch, use_cache=False)
    assert out["cache"] is None
    torch.testing.assert_close(out["loss"], ref["loss"], rtol=0, atol=0)
    torch.testing.assert_close(out["logits"], ref["logits"], rtol=0, atol=0)


def test_a_kwargs_wrapper_of_a_model_without_use_cache_gets_none():
    torch.manual_seed(0)
    model, batch = Wrapper(NoCacheLM()), _batch()
    gm = capture(model, batch)  # NoCacheLM.forward(use_cache=...) would raise TypeError
    assert gm.meta[CALL_KWARGS_META] == {}
    torch.testing.assert_close(gm(**batch)["loss"], model(**batch)["loss"], rtol=0, atol=0)


def test_cache_error_does_not_ask_for_what_the_batch_already_does():
    with pytest.raises(CaptureError) as ei:
        capture(Fixed(CacheLM()), _batch())  # no use_cache in the batch, and forward does not name it
    msg = str(ei.value)
    assert "output['cache']" in msg and "KVCache" in msg
    assert "model.config.use_cache = False" in msg and "use_cache=False in the batch" in msg
    assert "leave use_cache out" not in msg


# --- peft LoRA (issue: apply on get_peft_model(...) captured a DynamicCache) -------------------------

def _lora(seed: int = 0):
    """A tiny Qwen2 (config defaults: use_cache=True) with LoRA adapters on q_proj and v_proj."""
    tf = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(seed)
    cfg = tf.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return peft.get_peft_model(tf.Qwen2ForCausalLM(cfg), lora).train()


def _lm_batches(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 128, (4, 16), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return out


def _train(model: nn.Module, batches: list[dict[str, torch.Tensor]]) -> list[float]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for b in batches:
        loss = model(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_peft_lora_trains_through_apply_as_the_plain_peft_model(caplog, monkeypatch):
    monkeypatch.setattr(sys.modules["autoprec.capture.trace"], "_announced", set())
    ref, pm = _lora(), _lora()
    assert pm.get_base_model().config.use_cache is True  # nothing in the batch or config turns it off
    batches = _lm_batches(5)
    with caplog.at_level(logging.INFO, logger="autoprec"):
        mp = autoprec.apply(pm, autoprec.Policy.fp32(), batches[0], compile=False)
    said = [r.getMessage() for r in caplog.records if r.name == "autoprec"]
    assert any("PeftModelForCausalLM" in m and "use_cache=False" in m for m in said), said
    before = {n: p.detach().clone() for n, p in pm.named_parameters()}
    adapters = {n for n, p in pm.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)

    losses, ref_losses = _train(mp, batches), _train(ref, batches)
    assert losses == pytest.approx(ref_losses, abs=1e-5, rel=0)
    assert losses[-1] < losses[0]
    ref_params = dict(ref.named_parameters())
    for n, p in pm.named_parameters():
        if n in adapters:
            assert not torch.equal(p, before[n]), n
            torch.testing.assert_close(p, ref_params[n], rtol=0, atol=1e-5)
        else:
            assert torch.equal(p, before[n]), n  # frozen base weights untouched
