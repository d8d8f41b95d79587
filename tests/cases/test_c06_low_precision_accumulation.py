"""C06: low-precision accumulation stalls; gradient accumulation and running sums stay fp32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoprec import Policy
from autoprec.applied.apply import apply
from autoprec.training.scaler import DynamicLossScaler
from autoprec.training.train import TrainStep, make_scaler
from tests.conftest import RTOL

MICRO, ROWS = 64, 4  # 64 micro-batches of 4 rows = one batch of 256 rows


def test_c06_bf16_running_sum_stalls_and_fp32_does_not():
    s16 = torch.zeros((), dtype=torch.bfloat16)
    s32 = torch.zeros((), dtype=torch.float32)
    for _ in range(1000):
        s16 += 0.01
        s32 += 0.01
    # the fault: once the bf16 sum reaches 4.0 its spacing (2^-6 = 0.0156) swallows each 0.01
    assert s16.item() == 4.0
    # what autoprec does for running sums / accumulators: fp32
    assert s32.item() == pytest.approx(10.0, rel=1e-4)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x, target=None):  # the batch is (x, target); the loss reads target
        return self.fc2(torch.relu(self.fc1(x)))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(MICRO * ROWS, 16, generator=g), torch.randn(MICRO * ROWS, 4, generator=g)


def _step(policy: Policy, scale_by: int):
    model = Net()
    x, y = _data()
    mp = apply(model, policy, (x[:ROWS], y[:ROWS]), compile=False)
    params = list(model.parameters())

    def loss_fn(out, batch):  # mean over the big batch = sum of micro-batch means / MICRO
        return (out.float() - batch[1]).pow(2).mean() / scale_by

    return model, params, x, y, TrainStep(mp, params, torch.optim.SGD(params, lr=0.1), loss_fn,
                                          scaler=make_scaler(policy))


def test_c06_64_micro_batches_match_one_big_batch_fp32():
    """fp32 policy: 64 x forward_backward then finish() == one big batch, within fp32 tolerance."""
    _, params, x, y, big = _step(Policy.fp32(), 1)
    mp_big = apply(big.module.model, Policy.fp32(), (x, y), compile=False)
    big.module = mp_big
    big.forward_backward((x, y))
    g_big = [p.grad.clone() for p in params]
    big.finish()
    w_big = [p.detach().clone() for p in params]

    _, params, x, y, acc = _step(Policy.fp32(), MICRO)
    for i in range(MICRO):
        acc.forward_backward((x[i * ROWS:(i + 1) * ROWS], y[i * ROWS:(i + 1) * ROWS]))
    g_acc = [p.grad.clone() for p in params]
    acc.finish()
    for a, b in zip(g_acc, g_big):
        torch.testing.assert_close(a, b, rtol=RTOL[torch.float32], atol=1e-6)
    for p, w in zip(params, w_big):
        torch.testing.assert_close(p.detach(), w, rtol=RTOL[torch.float32], atol=1e-6)


@pytest.mark.parametrize("low", ["bf16", "fp16"])
def test_c06_accumulation_is_fp32_under_low_precision_compute(low):
    """Under bf16/fp16 compute the 64 micro-batch gradients are summed in fp32 (into the fp32 master
    .grad): the accumulated gradient equals the fp32 sum of the separately computed micro-gradients
    within fp32 tolerance, while summing the same micro-gradients in the compute dtype drifts."""
    policy = Policy.default(low)
    model, params, x, y, step = _step(policy, MICRO)
    chunks = [(x[i * ROWS:(i + 1) * ROWS], y[i * ROWS:(i + 1) * ROWS]) for i in range(MICRO)]
    scale = step.scaler.get_scale() if step.scaler is not None else 1.0
    singles = []
    for c in chunks:  # each micro-batch's own gradient (same policy, same scale)
        step.forward_backward(c)
        singles.append([p.grad.clone() for p in params])
        model.zero_grad(set_to_none=True)
    for c in chunks:
        step.forward_backward(c)
    assert all(p.grad.dtype == torch.float32 for p in params)
    ref = [torch.stack([s[j].double() for s in singles]).sum(0) for j in range(len(params))]
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[low]
    low_sum = [torch.zeros_like(r, dtype=dt) for r in ref]
    for s in singles:
        for j, g in enumerate(s):
            low_sum[j] += (g / scale).to(dt) if low == "fp16" else g.to(dt)
    for j, p in enumerate(params):
        torch.testing.assert_close(p.grad.double(), ref[j], rtol=RTOL[torch.float32], atol=1e-6 * scale)
    low_err = max(float(((ls.double() * (scale if low == "fp16" else 1.0)) - r).norm() / r.norm())
                  for ls, r in zip(low_sum, ref))
    assert low_err > 1e-3  # what a low-precision accumulator would have cost
    # the accumulated step is applied (finite), without changing the loss scale
    skipped, *_ = step.finish()
    assert not skipped
    if isinstance(step.scaler, DynamicLossScaler):
        assert step.scaler.get_scale() == scale  # no overflow
