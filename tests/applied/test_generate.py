"""``mp.generate`` (a Hugging Face model applied): the model's own ``generate`` on the trained fp32
Parameters; the applied module had no ``generate`` (``AttributeError``), and no page said how to
sample after training with a policy."""

from __future__ import annotations

import pytest
import torch

import autoprec

transformers = pytest.importorskip("transformers")


def test_generate_is_the_models_own_on_the_trained_weights():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    mp = autoprec.apply(model, autoprec.Policy.default("bf16"), batch, compile=False)
    opt = torch.optim.SGD(mp.parameters(), lr=1.0)
    before = model.transformer.wte.weight.detach().clone()
    mp(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert not torch.equal(model.transformer.wte.weight, before)  # trained
    mp.eval()
    prompt = ids[:1, :4]
    got = mp.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert got.shape == (1, 9) and got.dtype == torch.int64
    assert torch.equal(got, model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0))
    mp.train()
    mp(input_ids=ids, labels=ids).loss.backward()  # training goes on through the graph

    bare = autoprec.apply(torch.nn.Linear(4, 1), autoprec.Policy.fp32(), torch.randn(2, 4), compile=False)
    with pytest.raises(TypeError, match=r"MixedPrecisionModule of Linear: the wrapped model has no generate"):
        bare.generate(torch.randn(2, 4))
