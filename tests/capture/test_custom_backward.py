"""Custom ``torch.autograd.Function``s in a forward (autoprec/capture/custom_backward.py): torch.export
traces their forward and drops their backward, so a gradient reversal layer trained reversed
gradients and a straight-through ``round`` trained zeros, silently. A capture whose fp32 gradients
differ from the model's own is refused naming the Function; one whose backward is the derivative
of its forward is captured; the custom op the message advises keeps the backward."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import autoprec
from autoprec.capture import capture
from autoprec.errors import CaptureError


class GradReverse(torch.autograd.Function):  # domain-adversarial training's layer
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return -g


class RoundSTE(torch.autograd.Function):  # straight-through estimator (quantization-aware training)
    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g


class Square(torch.autograd.Function):  # a hand-written op whose backward is its derivative
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


@torch.library.custom_op("autoprec_test::grad_reverse", mutates_args=())
def grad_reverse(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


grad_reverse.register_fake(lambda x: torch.empty_like(x))
grad_reverse.register_autograd(lambda ctx, g: -g)


class Net(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.a, self.drop, self.b, self.fn = nn.Linear(8, 8), nn.Dropout(0.25), nn.Linear(8, 1), fn

    def forward(self, x):
        return self.b(self.fn(self.drop(self.a(x)))).pow(2).mean()


def _grads(run, model):
    model.zero_grad()
    torch.manual_seed(1)
    run().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("fn", [GradReverse.apply, RoundSTE.apply], ids=["grad_reverse", "round_ste"])
def test_a_function_whose_backward_is_not_its_forwards_derivative_is_refused(fn):
    torch.manual_seed(0)
    model, x = Net(fn), torch.randn(4, 8)
    with pytest.raises(CaptureError, match=r"Net: the forward calls custom torch\.autograd\.Function "
                                           r"(GradReverse|RoundSTE) \(.*test_custom_backward\.py:\d+\)\..* "
                                           r"relative L2 \d.*register_autograd"):
        capture(model, x)
    with pytest.raises(CaptureError, match="drops its backward"):
        autoprec.apply(model, autoprec.Policy.fp32(), x, compile=False)
    assert all(p.grad is None for p in model.parameters())  # the check left .grad alone


def test_a_function_whose_backward_is_its_derivative_is_captured_with_the_models_gradients(caplog):
    torch.manual_seed(0)
    model, x = Net(Square.apply), torch.randn(4, 8)
    model.eval()  # wholly in eval mode: traced (and checked) in training mode, dropout drawing masks
    with caplog.at_level(logging.INFO, logger="autoprec"):
        mp = autoprec.apply(model, autoprec.Policy.fp32(), x, compile=False)
    assert "custom autograd.Function Square" in caplog.text and "match its own backward" in caplog.text
    model.train()
    for want, got in zip(_grads(lambda: model(x), model), _grads(lambda: mp(x), model)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_the_advised_custom_op_keeps_its_backward_under_a_bf16_policy():
    torch.manual_seed(0)
    model, x = Net(grad_reverse), torch.randn(4, 8)
    want = _grads(lambda: model(x), model)
    fp32 = autoprec.apply(model, autoprec.Policy.fp32(), x, compile=False)
    for w, g in zip(want, _grads(lambda: fp32(x), model)):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
    bf16 = autoprec.apply(model, autoprec.Policy.default("bf16"), x, compile=False)
    got = _grads(lambda: bf16(x), model)
    a_weight = want[0]  # reversed by the op: a sign error would make the cosine -1
    cos = nn.functional.cosine_similarity(got[0].flatten(), a_weight.flatten(), dim=0)
    assert cos > 0.99, cos
