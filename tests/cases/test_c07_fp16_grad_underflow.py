"""C07: fp16 gradients underflow; dynamic loss scaling (2**16, unscale in fp32) recovers them."""

from __future__ import annotations

import torch

from autoprec.training.scaler import DynamicLossScaler
from tests.conftest import RTOL

GRADS = [1e-8, 3e-8, 1e-5]


def test_c07_plain_fp16_cast_loses_small_gradients():
    g16 = torch.tensor(GRADS, dtype=torch.float32).half()
    assert g16[0].item() == 0.0  # below half the smallest fp16 subnormal (2**-24 ~ 6e-8): flushed
    assert abs(g16[1].item() - 3e-8) / 3e-8 > 0.9  # rounds to 2**-24 ~ 6e-8: 99% off
    assert abs(g16[2].item() - 1e-5) / 1e-5 > 1e-3  # fp16 subnormal: 1.0014e-5, misses 0.1%


def test_c07_scaled_fp16_cast_then_fp32_unscale_recovers_them():
    true = torch.tensor(GRADS, dtype=torch.float32)
    recovered = (true * 2.0**16).half().float() / 2.0**16
    assert torch.all(recovered != 0)
    torch.testing.assert_close(recovered, true, rtol=RTOL[torch.float16], atol=0.0)


def test_c07_scaler_recovers_gradients_flowing_through_an_fp16_node():
    """fp32 master p -> fp16 compute copy -> fp32 loss: the gradient crosses the graph in fp16."""
    true = torch.tensor(GRADS, dtype=torch.float32)

    def grad_of_p(scaler: DynamicLossScaler) -> torch.Tensor:
        p = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.SGD([p], lr=0.0)
        loss = (p.half().float() * true).sum()  # dloss/d(p.half()) is cast to fp16 on the way back
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        assert scaler.step(opt) is True
        scaler.update()
        return p.grad

    unscaled = grad_of_p(DynamicLossScaler(enabled=False))
    assert unscaled[0].item() == 0.0  # the fault: silently lost
    scaled = grad_of_p(DynamicLossScaler(init_scale=2.0**16))
    assert scaled.dtype == torch.float32
    torch.testing.assert_close(scaled, true, rtol=RTOL[torch.float16], atol=0.0)
