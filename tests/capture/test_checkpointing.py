"""Gradient checkpointing in a model's forward: torch.export inlines it, so capture refuses it by
name (a captured graph that silently saved every activation used to be the result)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import autoprec
from autoprec.errors import CaptureError
from tests.nets import qwen2_batch, tiny_qwen2


class _Block(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.f = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, x):
        return x + checkpoint(self.f, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
def test_torch_utils_checkpoint_in_forward_is_refused_naming_the_module(reentrant):
    net = nn.Sequential(_Block(reentrant), _Block(reentrant))
    with pytest.raises(CaptureError) as err:
        autoprec.apply(net, autoprec.Policy.fp32(), torch.randn(4, 8), compile=False)
    msg = str(err.value)
    assert msg.startswith("Sequential's forward uses gradient checkpointing (torch.utils.checkpoint) on "
                          "module '0.f' (Sequential) and 1 more: torch.export inlines it"), msg
    assert "activation_memory_budget below 1.0" in msg and "compile=True" in msg
    # nothing of the capture stays behind: checkpointing still works eagerly
    x = torch.randn(4, 8, requires_grad=True)
    net(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_hf_gradient_checkpointing_is_refused_and_apply_works_once_it_is_off():
    model = tiny_qwen2()
    model.gradient_checkpointing_enable()
    batch = qwen2_batch()
    with pytest.raises(CaptureError, match=r"Qwen2ForCausalLM's forward uses gradient checkpointing "
                                           r"\(torch.utils.checkpoint\) on module 'model.layers.0' "
                                           r"\(Qwen2DecoderLayer\) and 1 more"
                                           r".*activation_checkpointing_disable\(\)"):
        autoprec.apply(model, autoprec.Policy.fp32(), batch, compile=False)
    getattr(model, "activation_checkpointing_disable", model.gradient_checkpointing_disable)()
    mp = autoprec.apply(model, autoprec.Policy.fp32(), batch, compile=False)
    torch.testing.assert_close(mp(**batch).loss, model(**batch).loss)
