"""C02: fp16 overflow in attention scores before scaling: softmax((q @ k.T) / 8)."""

from __future__ import annotations

import math

import torch
from torch import nn

from autoprec.capture import capture
from autoprec.passes import first_nonfinite_node, lower
from autoprec.policy import Policy


class Scores(nn.Module):
    def __init__(self, scale_first: bool) -> None:
        super().__init__()
        self.q = nn.Parameter(torch.zeros(8, 64))
        self.scale_first = scale_first

    def forward(self, k):
        q = self.q / 8 if self.scale_first else self.q
        s = q @ k.T
        return torch.softmax(s if self.scale_first else s / 8, -1)


def _setup(scale_first=False):
    torch.manual_seed(0)
    qk = 40 * torch.randn(8, 64)
    m = Scores(scale_first)
    with torch.no_grad():
        m.q.copy_(qk)
    return m, qk.clone()


def _grad_rel_l2(model, f, k):
    def run(fn):
        model.zero_grad()
        (fn(k) * torch.arange(8.0)).sum().backward()
        return model.q.grad.clone()

    g32, g = run(model), run(f)
    if not torch.isfinite(g).all():
        return math.inf
    return float((g - g32).norm() / g32.norm().clamp_min(1e-30))


def test_c02_attention_score_overflow():
    model, k = _setup()
    gm = capture(model, (k,))
    all_fp16 = lower(gm, Policy(default_dtype="fp16"))  # scores, softmax all fp16
    assert torch.isnan(all_fp16(k)).any()
    assert first_nonfinite_node(all_fp16, k) == "matmul#0"
    assert _grad_rel_l2(model, all_fp16, k) == math.inf  # NaN never passes a drift check
    # a safe policy (scores in bf16, softmax fp32) stays finite and accurate
    safe = lower(gm, Policy.default("bf16"))
    out = safe(k)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, model(k), rtol=0, atol=0.1)  # finite and near: this test's bound


def test_c02_scaling_q_before_the_matmul_is_fine_in_fp16():
    model, k = _setup(scale_first=True)
    gm = capture(model, (k,))
    fp16 = lower(gm, Policy.default("fp16"))
    assert first_nonfinite_node(fp16, k) is None
    assert torch.isfinite(fp16(k)).all()
