"""Switches the captured graph fixed (``autoprec.applied.forward_state``): gradient checkpointing
switched on after ``apply`` is refused in a training call (the graph would save every activation, as a
user reported: no memory saved and no word), and peft's ``disable_adapter()`` / ``merge_adapter()``
after ``apply`` are honoured under ``torch.no_grad()`` (TRL's DPO reference pass of a peft model) by
the model's own forward, and refused with grad enabled. Before, the graph ran the captured adapter in
both: the "reference" logits were the policy model's, and a merged adapter counted twice."""

from __future__ import annotations

import pytest
import torch

import autoprec

tf = pytest.importorskip("transformers")

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
           num_key_value_heads=1, max_position_embeddings=32)


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "labels": ids}


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**CFG)).train()


def test_checkpointing_switched_on_after_apply_is_refused_and_off_again_trains():
    model, b = _llama(), _batch()
    mp = autoprec.apply(model, autoprec.Policy.fp32(), b, compile=False)
    captured = mp(**b).loss.item()
    with pytest.warns(FutureWarning):  # transformers 5's name for it is activation_checkpointing_enable
        model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match=r"gradient checkpointing was switched on after autoprec.apply "
                       r"\('model': gradient_checkpointing is True\).*activation_memory_budget"):
        mp(**b)
    with torch.no_grad():  # no backward: checkpointing changes nothing, the model's own forward runs
        assert mp(**b).loss.item() == pytest.approx(captured, rel=1e-6)
    model.activation_checkpointing_disable()
    loss = mp(**b).loss
    loss.backward()
    assert loss.item() == pytest.approx(captured, rel=1e-6)


def _lora_model():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                         target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # peft starts lora_B at zero: an adapter that changes nothing proves nothing
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    return model.train()


def test_peft_adapter_disabled_or_merged_after_apply_runs_the_models_own_forward_under_no_grad():
    pm, b = _lora_model(), _batch()
    mp = autoprec.apply(pm, autoprec.Policy.fp32(), b, compile=False)
    with torch.no_grad():
        with_adapter = mp(**b).logits
        assert torch.allclose(with_adapter, pm(**b).logits, atol=1e-5)
        with pm.disable_adapter():
            base = pm(**b).logits
            assert torch.equal(mp(**b).logits, base)  # the reference pass: the base model's logits
        assert (base - with_adapter).abs().max() > 1e-2  # the adapter does change them
        pm.merge_adapter()
        merged = mp(**b).logits
        assert torch.allclose(merged, with_adapter, atol=1e-4)  # not the delta twice
        pm.unmerge_adapter()
    assert torch.allclose(mp(**b).logits, with_adapter, atol=1e-5)  # the graph again, grads on


@pytest.mark.parametrize("switch, says", [
    ("disable", r"'base_model.model.model.layers.0.self_attn.q_proj': its adapters are disabled "
                r"\(model.disable_adapter\(\)\); the graph"),
    ("merge", r"adapters \['default'\] are merged into its weights \(merge_adapter\(\)\)"),
])
def test_peft_adapter_switched_after_apply_is_refused_with_grad_enabled(switch, says):
    pm, b = _lora_model(), _batch()
    mp = autoprec.apply(pm, autoprec.Policy.fp32(), b, compile=False)
    before = [p.detach().clone() for p in pm.parameters()]
    if switch == "disable":
        with pm.disable_adapter(), pytest.raises(ValueError, match=says + r".*restore their state"):
            mp(**b)
    else:
        pm.merge_adapter()
        with pytest.raises(ValueError, match=says):
            mp(**b)
    pm.unmerge_adapter()
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(pm.parameters(), before))
