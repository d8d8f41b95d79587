"""Capture coverage: tiny configs of HF architectures and the nanoGPT example.

For each: capture, lower with ``Policy.default()`` (bf16 compute, sensitive ops fp32), forward +
backward, and check the gradient drift against fp32 (``grad_rel_l2`` = ‖g − g₃₂‖ / ‖g₃₂‖ over all
gradients) is at most 2 × that of ``torch.autocast("cpu", torch.bfloat16)`` on the same model and
batch (docs/architecture.md#measurements: "as accurate as standard AMP").
"""

from __future__ import annotations

import importlib.util
import math
import sys
import warnings

import pytest
import torch

from autoprec.capture import capture
from autoprec.passes import run_pipeline
from autoprec.policy import Policy
from tests.conftest import EXAMPLES

B, T, V = 2, 16, 128


def _ids(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g)


def _hf(name):
    import transformers as tf

    ids = _ids()
    common = {"vocab_size": V, "use_cache": False, "attn_implementation": "sdpa"}
    llama_like = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, **common)
    if name == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**llama_like))
    elif name == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**llama_like))
    elif name == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(sliding_window=None, **llama_like))
    elif name == "gemma":
        model = tf.GemmaForCausalLM(tf.GemmaConfig(head_dim=16, **llama_like))
    elif name == "qwen2_moe":  # mixture of experts, transformers' default (grouped_mm) experts
        model = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
            moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
            num_experts_per_tok=2, decoder_sparse_step=1, output_router_logits=False, **llama_like))
    elif name == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                                 **common))
    elif name == "bert":
        model = tf.BertForMaskedLM(tf.BertConfig(hidden_size=64, num_hidden_layers=2,
                                                 num_attention_heads=4, intermediate_size=96,
                                                 hidden_dropout_prob=0.0,
                                                 attention_probs_dropout_prob=0.0,
                                                 max_position_embeddings=64, vocab_size=V,
                                                 attn_implementation="sdpa"))
    elif name == "t5":
        model = tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=V, d_model=64, d_kv=16, d_ff=96,
                                                          num_layers=2, num_heads=4, dropout_rate=0.0,
                                                          use_cache=False, decoder_start_token_id=0))
        return model.train(), {"input_ids": ids, "labels": _ids(1)}, None
    else:
        raise KeyError(name)
    return model.train(), {"input_ids": ids, "labels": ids}, None


def _nanogpt():
    spec = importlib.util.spec_from_file_location("nanogpt_example",
                                                  EXAMPLES / "nanogpt.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(mod)
    cfg = mod.GPTConfig(vocab_size=V, block_size=T, n_layer=2, n_head=4, n_embd=64)
    model = mod.build_model(cfg)
    ids = _ids()
    return model, (ids, torch.roll(ids, -1, 1)), mod.loss_fn


ARCHS = ["qwen2", "llama", "mistral", "gemma", "qwen2_moe", "gpt2", "bert", "t5", "nanogpt"]


def _build(name):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _nanogpt() if name == "nanogpt" else _hf(name)


def _call(f, batch):
    return f(**batch) if isinstance(batch, dict) else f(*batch)


def _loss(out, batch, loss_fn):
    if loss_fn is not None:
        return loss_fn(out, batch)
    return out["loss"] if isinstance(out, dict) else out.loss


def _grads(model, f, batch, loss_fn, autocast=False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = _loss(_call(f, batch), batch, loss_fn)
    loss.float().backward()
    params = list(dict.fromkeys(model.parameters()))
    g = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().float() for p in params])
    return float(loss.detach()), g


def _rel(g, g32):
    if not torch.isfinite(g).all():
        return math.inf
    return float((g - g32).norm() / g32.norm())


@pytest.mark.parametrize("name", ARCHS)
def test_arch_capture_default_policy_within_2x_autocast(name, record_property):
    model, batch, loss_fn = _build(name)
    gm = capture(model, batch)
    r = run_pipeline(gm, Policy.default())
    assert r.stats["casts"] > 0
    low = r.graph_module
    l32, g32 = _grads(model, model, batch, loss_fn)
    _l_ac, g_ac = _grads(model, model, batch, loss_fn, autocast=True)
    l_ap, g_ap = _grads(model, low, batch, loss_fn)
    assert math.isfinite(l_ap)
    rel_ap, rel_ac = _rel(g_ap, g32), _rel(g_ac, g32)
    record_property("grad_rel_l2_policy", rel_ap)
    record_property("grad_rel_l2_autocast", rel_ac)
    print(f"{name}: grad_rel_l2 policy={rel_ap:.3e} autocast={rel_ac:.3e} casts={r.stats['casts']}")
    _assert_within_2x_autocast(rel_ap, rel_ac)
    assert abs(l_ap - l32) / abs(l32) < 2e-2


def _assert_within_2x_autocast(rel_ap, rel_ac):
    """The policy's drift is at most 2x autocast's, which must be finite: with an infinite
    autocast drift (non-finite autocast gradients) any policy would pass the comparison."""
    assert math.isfinite(rel_ac), f"torch.autocast's grad_rel_l2 is {rel_ac}: the baseline is broken"
    assert rel_ap <= 2 * rel_ac, (rel_ap, rel_ac)


def test_comparison_fails_when_autocast_drift_is_infinite():
    with pytest.raises(AssertionError, match="autocast"):
        _assert_within_2x_autocast(1e-3, math.inf)
    with pytest.raises(AssertionError):
        _assert_within_2x_autocast(math.inf, math.inf)
    with pytest.raises(AssertionError):
        _assert_within_2x_autocast(3e-3, 1e-3)
    _assert_within_2x_autocast(1e-3, 1e-3)


def test_nanogpt_example_follows_model_py_contract():
    from autoprec.modelspec import call_model, load_model_spec

    spec = load_model_spec(EXAMPLES / "nanogpt.py")
    b0, b0_again = spec.get_batch(0, torch.device("cpu")), spec.get_batch(0, torch.device("cpu"))
    assert torch.equal(b0[0], b0_again[0]) and b0[0].shape == (8, 128)
    assert torch.equal(b0[1][:, :-1], b0[0][:, 1:])  # targets are the next bytes
    model = spec.build_model()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    loss = spec.loss_fn(call_model(model, b0), b0)
    assert loss.dim() == 0 and abs(float(loss.detach()) - math.log(256)) < 0.5  # random init ~ uniform
