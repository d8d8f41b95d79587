"""Stock Hugging Face models as configured by default (issue 12, Done when 1).

Each architecture is built from its config's DEFAULTS except tiny sizes (hidden size, layers, heads,
intermediate size, vocabulary): ``use_cache`` (True for the decoders), the attention implementation
and dropout stay as the library sets them. Each is captured, ``Policy.default("bf16")`` is applied
(``autoprec.apply``, eager), one training step runs, and the policy's gradient drift against FP32
(``autoprec.metrics.grad_rel_l2``, docs/architecture.md#measurements) is at most 2x that of
``torch.autocast(bf16)`` on the same model, weights, batch and random draws (dropout masks:
``autoprec.training.rng.same_rng(CPU, MEASURE_SEED)`` around every forward/backward).

Qwen2, Llama, GPT-2 and BERT run in the default suite; the others are ``slow``.
"""

from __future__ import annotations

import logging
import math
import warnings

import pytest
import torch

import autoprec
from autoprec.metrics import grad_rel_l2
from autoprec.training.rng import MEASURE_SEED, same_rng

tf = pytest.importorskip("transformers")

B, T, V = 2, 16, 128
CPU = torch.device("cpu")
LLAMA_LIKE = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)


def _model(name: str) -> torch.nn.Module:
    """The architecture with its default config, sizes made tiny (nothing else changed)."""
    if name == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**LLAMA_LIKE))
    if name == "qwen2-1024":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(max_position_embeddings=1024, **LLAMA_LIKE))
    if name == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA_LIKE))
    if name == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(head_dim=16, **LLAMA_LIKE))
    if name == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=16, **LLAMA_LIKE))
    if name == "gemma":
        return tf.GemmaForCausalLM(tf.GemmaConfig(head_dim=16, **LLAMA_LIKE))
    if name == "qwen2-moe":
        return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2,
                                                        moe_intermediate_size=32,
                                                        shared_expert_intermediate_size=64, **LLAMA_LIKE))
    if name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4))
    if name == "bert":
        return tf.BertForMaskedLM(tf.BertConfig(vocab_size=V, hidden_size=64, num_hidden_layers=2,
                                                num_attention_heads=4, intermediate_size=96))
    if name == "t5":
        # T5Config (transformers 5) sets no decoder_start_token_id, which shifting the labels needs;
        # 0 is T5's pad token, the id the released T5 checkpoints start decoding with
        return tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=V, d_model=64, d_kv=16, d_ff=96,
                                                         num_layers=2, num_heads=4, decoder_start_token_id=0))
    raise KeyError(name)


def _build(name: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _model(name).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, T), generator=g)
    labels = torch.randint(0, V, (B, T), generator=g) if name == "t5" else ids
    return model, {"input_ids": ids, "labels": labels}


def _grads(model, fn, batch, autocast=False):
    """Loss, output and per-parameter gradients of one forward/backward under the measure seed."""
    model.zero_grad(set_to_none=True)
    with same_rng(CPU, MEASURE_SEED), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = fn(**batch)
        out.loss.float().backward()
    grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
             for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out, grads


FAST = ["qwen2", "llama", "gpt2", "bert"]
SLOW = ["mistral", "qwen3", "gemma", "qwen2-moe", "t5", "qwen2-1024"]
ACCEPTS_USE_CACHE = {"qwen2", "qwen2-1024", "llama", "mistral", "qwen3", "gemma", "qwen2-moe", "gpt2", "t5"}


@pytest.mark.parametrize("name", FAST + [pytest.param(n, marks=pytest.mark.slow) for n in SLOW])
def test_default_config_captures_trains_and_drifts_within_2x_autocast(name, caplog, monkeypatch):
    import sys

    monkeypatch.setattr(sys.modules["autoprec.capture.trace"], "_announced", set())  # said once per process
    model, batch = _build(name)
    if name in ACCEPTS_USE_CACHE:
        assert model.config.use_cache is True  # the default this test is about
    ref_out, g32 = _grads(model, model, batch)
    _, g_ac = _grads(model, model, batch, autocast=True)
    with caplog.at_level(logging.INFO, logger="autoprec"):
        mp = autoprec.apply(model, autoprec.Policy.default("bf16"), batch, compile=False)
    said = [r.getMessage() for r in caplog.records
            if r.name == "autoprec" and "use_cache=False" in r.getMessage()]
    assert len(said) == (1 if name in ACCEPTS_USE_CACHE else 0), said

    out, g_ap = _grads(model, mp, batch)
    assert type(out) is type(ref_out)  # the model's own output type and fields
    assert out.logits.shape == ref_out.logits.shape and out.logits.dtype == torch.float32
    assert all(not isinstance(v, tf.Cache) for v in out.values())  # no KV cache built for training

    rel_ap, rel_ac = grad_rel_l2(g_ap, g32), grad_rel_l2(g_ac, g32)
    print(f"{name}: grad_rel_l2 policy={rel_ap:.3e} autocast={rel_ac:.3e}")
    assert math.isfinite(rel_ac), f"torch.autocast's grad_rel_l2 is {rel_ac}: the baseline is broken"
    assert rel_ap <= 2 * rel_ac, (rel_ap, rel_ac)

    # one training step through the applied module moves the fp32 master weights
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with same_rng(CPU, MEASURE_SEED):
        loss = mp(**batch).loss
    loss.backward()
    opt.step()
    assert math.isfinite(float(loss.detach()))
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())
