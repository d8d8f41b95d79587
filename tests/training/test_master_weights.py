"""Master weights: parameters, gradients and optimizer state stay fp32 whatever the compute dtype."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoprec import Policy
from autoprec.applied.apply import apply
from autoprec.training.train import TrainStep, make_scaler

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.fc1, self.norm, self.fc2 = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def _loss(out, batch):
    return out.float().pow(2).mean()


@pytest.mark.parametrize("opt_name", ["adamw", "sgd_momentum"])
@pytest.mark.parametrize("low", ["bf16", "fp16"])
def test_params_grads_and_optimizer_state_stay_fp32(low, opt_name):
    model = Net()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    mp = apply(model, Policy.default(low), (x,), compile=False)
    # the lowered graph really computes in the low dtype ...
    low_nodes = [n for n in mp.graph_module.graph.nodes
                 if n.op == "call_function" and getattr(n.meta.get("val"), "dtype", None) == LOW[low]]
    assert low_nodes
    params = list(mp.parameters())
    assert [id(p) for p in params] == [id(p) for p in model.parameters()]  # same Parameter objects
    opt = (torch.optim.AdamW(params, lr=1e-3) if opt_name == "adamw"
           else torch.optim.SGD(params, lr=1e-2, momentum=0.9))
    step = TrainStep(mp, params, opt, _loss, scaler=make_scaler(Policy.default(low)))
    assert (step.scaler is not None) == (low == "fp16")
    before = [p.detach().clone() for p in params]
    for _ in range(3):
        step.forward_backward(x)
        assert all(p.grad.dtype == torch.float32 for p in params)  # fp32 grads (accumulators)
        skipped, *_ = step.finish()
        assert not skipped
    # ... while the master weights and every optimizer state tensor stay fp32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(v.dtype == torch.float32 for v in model.state_dict().values())
    state_tensors = [v for s in opt.state.values() for v in s.values()
                     if isinstance(v, torch.Tensor) and v.is_floating_point()]
    assert state_tensors and all(t.dtype == torch.float32 for t in state_tensors)
    assert all(not torch.equal(p, b) for p, b in zip(params, before))  # and they trained


def test_small_updates_are_not_lost_with_bf16_compute():
    """C08's failure (bf16 weights swallow lr=1e-4 updates) cannot happen: the update lands on fp32."""
    model = Net()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    mp = apply(model, Policy.default("bf16"), (x,), compile=False)
    params = list(model.parameters())
    step = TrainStep(mp, params, torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0), _loss)
    w0 = model.fc2.weight.detach().clone()
    for _ in range(5):
        step(x)
    delta = (model.fc2.weight.detach() - w0).abs()
    # Adam moves each weight by ~lr per step: 5e-4, far below bf16's spacing near 0.2 (2^-10)
    assert 1e-4 < delta.max() < 1e-3
    assert not torch.equal(model.fc2.weight.detach().to(torch.bfloat16).float(), model.fc2.weight.detach())
