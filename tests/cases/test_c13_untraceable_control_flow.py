"""C13: data-dependent control flow, and autocast(enabled=False) / no_grad blocks in forward."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from autoprec.capture import capture
from autoprec.errors import CaptureError
from autoprec.nodemeta import read_meta
from autoprec.passes import run_pipeline
from autoprec.policy import Policy, Rule
from tests.conftest import DRIFT


class Branchy(nn.Module):
    def forward(self, x):
        if x.abs().max() > 100:
            x = x / 100
        return 2 * x


class Inner(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x
        return -x


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), Inner()])

    def forward(self, x):
        return self.blocks[1](self.blocks[0](x))


def test_c13_untraceable_control_flow():
    with pytest.raises(CaptureError) as ei:
        capture(Branchy(), (torch.randn(3),))
    msg = str(ei.value)
    assert "Branchy" in msg
    assert "test_c13_untraceable_control_flow.py:" in msg and "if x.abs().max() > 100:" in msg
    assert "torch.where" in msg and "torch.cond" in msg  # what to do


def test_c13_error_names_the_submodule():
    with pytest.raises(CaptureError, match=r"module 'blocks\.1' \(Inner\)") as ei:
        capture(Outer(), (torch.randn(2, 4),))
    assert "if x.sum() > 0:" in str(ei.value)


class Contexts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        with torch.autocast("cpu", enabled=False):
            h = torch.exp(h.float() * 0.5) * 2  # the user wants this in fp32
        with torch.no_grad():
            z = h.sum(-1, keepdim=True)  # a statistic without gradient
        return self.b(h) + z


POLICIES = [
    Policy.default("bf16"),
    Policy.default("fp16"),
    Policy(default_dtype="fp16", rules=(Rule(op_class="follow", dtype="fp16"),)),
]


@pytest.mark.parametrize("policy", POLICIES, ids=["default-bf16", "default-fp16", "all-fp16"])
def test_c13_autocast_disabled_and_no_grad_regions_kept(policy):
    torch.manual_seed(0)
    m = Contexts()
    x = torch.randn(2, 8)
    gm = capture(m, (x,))
    regions = [n for n in gm.graph.nodes if read_meta(n).region is not None]
    assert [read_meta(n).region.kind for n in regions] == ["autocast", "grad"]
    assert read_meta(regions[0]).region.enabled is False
    r = run_pipeline(gm, policy)
    for n in r.graph_module.graph.nodes:
        meta = read_meta(n)
        if meta.region is not None:
            assert meta.dtype == "fp32" and "region" in meta.decided_by
            # every float input of the region reaches it in fp32
            for a in n.all_input_nodes:
                v = a.meta.get("val")
                if isinstance(v, torch.Tensor):
                    assert v.dtype == torch.float32, a.format_node()
    out = r.graph_module(x)
    ref = m(x)
    torch.testing.assert_close(out, ref, rtol=5e-2, atol=5e-2)  # low-precision outside the region
    # no_grad is kept: the gradient of a.weight equals the fp32 one up to low-precision error,
    # and differs clearly from what it would be if z carried gradient.
    m.zero_grad()
    ref.sum().backward()
    g32 = m.a.weight.grad.clone()
    m.zero_grad()
    r.graph_module(x).sum().backward()
    rel = (m.a.weight.grad - g32).norm() / g32.norm()
    assert rel < 5e-2


class DeviceCopyInNoGrad(nn.Module):
    """A no_grad region whose body cannot run on the meta device (``.to(x.device)`` copies to the
    CPU), as transformers' rotary embeddings (``@torch.no_grad()``, 5.17) are captured."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("freq", torch.arange(16.0))

    def forward(self, x):
        with torch.no_grad():
            f = torch.cos(self.freq[None, :].float().expand(x.shape[0], -1).to(x.device))
        return (self.fc(x) * f).square().mean()


def test_c13_failed_region_propagation_leaves_grad_mode_on():
    # torch's wrap_with_set_grad_enabled does not restore the grad mode when its body raises (here:
    # on the meta device, before the verify pass falls back to fake tensors); a pass that leaked
    # it would leave the caller's training step without gradients.
    torch.manual_seed(0)
    m, x = DeviceCopyInNoGrad(), torch.randn(4, 16)
    gm = capture(m, (x,), dynamic=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*not in the op table")  # a region is a region
        r = run_pipeline(gm, Policy.default("bf16"))
    assert torch.is_grad_enabled()
    loss = r.graph_module(x)
    assert loss.requires_grad
    loss.backward()
    g = m.fc.weight.grad.clone()
    m.zero_grad()
    m(x).backward()
    assert (g - m.fc.weight.grad).norm() / m.fc.weight.grad.norm() < DRIFT[torch.bfloat16]  # bf16 matmul
