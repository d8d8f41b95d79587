"""C01: fp16 overflow in an FFN projection (x @ w = 66368 > 65504), then residual + RMSNorm."""

from __future__ import annotations

import math

import torch

from autoprec.capture import capture
from autoprec.passes import first_nonfinite_node, lower
from autoprec.policy import Policy
from tests.models.c01_ffn import FFN


def drift(model, gm_low, x):
    """(grad_rel_l2, loss_rel) of ``gm_low`` vs the fp32 ``model``; non-finite -> inf."""
    def run(f):
        model.zero_grad()
        loss = f(x).float().sum()
        loss.backward()
        g = torch.cat([p.grad.flatten() for p in model.parameters()])
        return loss.detach(), g

    l32, g32 = run(model)
    loss, g = run(gm_low)
    if not (torch.isfinite(loss) and torch.isfinite(g).all()):
        return math.inf, math.inf
    return float((g - g32).norm() / g32.norm()), float((loss - l32).abs() / l32.abs())


def test_c01_ffn_matmul_overflow():
    model = FFN()
    x = torch.full((1, 256), 16.0)
    gm = capture(model, (x,))
    fp16 = lower(gm, Policy.default("fp16"))  # matmul in fp16, norm in fp32
    out = fp16(x)
    assert not torch.isfinite(out).all()
    # autoprec names the node whose output first went non-finite: the fp16 projection
    assert first_nonfinite_node(fp16, x) == "proj/linear#0"
    assert first_nonfinite_node(gm, x) is None  # the fp32 graph is fine (66368 fits fp32)
    # the search sees infinite drift for this policy, so it can never be selected
    assert drift(model, fp16, x) == (math.inf, math.inf)
    # bf16 has fp32's range: finite and close
    g_rel, l_rel = drift(model, lower(gm, Policy.default("bf16")), x)
    assert g_rel < 2e-2 and l_rel < 2e-2
