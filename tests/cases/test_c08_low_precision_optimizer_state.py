"""C08: optimizer state and weights in low precision; fp32 master weights and state fix it."""

from __future__ import annotations

import torch

from autoprec.training.scaler import DynamicLossScaler

LR, STEPS = 1e-4, 100


def test_c08_fp16_adam_state_gives_nan():
    """The fault: Adam state in fp16, eps 1e-8 rounds to 0 in fp16, zero grad gives 0/0."""
    assert torch.tensor(1e-8, dtype=torch.float16).item() == 0.0
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt = torch.optim.Adam([p])
    p.grad = torch.zeros(4, dtype=torch.float16)
    opt.step()
    assert opt.state[p]["exp_avg_sq"].dtype == torch.float16
    assert torch.isnan(p).all()


def test_c08_fp32_master_and_state_survive_zero_grad():
    master = torch.nn.Parameter(torch.ones(4))  # fp32 master of the fp16 weight
    opt = torch.optim.Adam([master])
    master.grad = torch.zeros(4, dtype=torch.float16).float()
    opt.step()
    assert opt.state[master]["exp_avg_sq"].dtype == torch.float32
    assert torch.equal(master.detach(), torch.ones(4))


def test_c08_bf16_weights_do_not_move():
    """The fault: each AdamW update (~1e-4) is below half a bf16 ulp at 1.0 (2**-9) and rounds away."""
    p = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    opt = torch.optim.AdamW([p], lr=LR)
    for _ in range(STEPS):
        p.grad = torch.ones(8, dtype=torch.bfloat16)
        opt.step()
    assert torch.equal(p.detach(), torch.ones(8, dtype=torch.bfloat16))


def test_c08_fp32_master_weights_train_with_bf16_compute():
    """Expected: fp32 master + fp32 AdamW state, bf16 compute, fp32 grads: ~0.99 after 100 steps."""
    master = torch.nn.Parameter(torch.ones(8))
    opt = torch.optim.AdamW([master], lr=LR)
    scaler = DynamicLossScaler(init_scale=2.0**16)
    for _ in range(STEPS):
        opt.zero_grad()
        loss = (master.to(torch.bfloat16) * torch.ones(8, dtype=torch.bfloat16)).sum()  # bf16 compute
        scaler.scale(loss).backward()
        assert master.grad.dtype == torch.float32
        assert scaler.step(opt) is True
        scaler.update()
    assert all(v.dtype == torch.float32 for v in opt.state[master].values() if v.dim() > 0)
    assert torch.isfinite(master).all()
    assert (master.detach() - (1.0 - STEPS * LR)).abs().max().item() < 1e-3
    assert master.detach().max().item() < 0.995  # it really moved
