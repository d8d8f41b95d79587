"""C04: the decomposed RMSNorm x * rsqrt(mean(x**2) + eps) overflows fp16 for |x| > 256."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from autoprec.capture import capture
from autoprec.nodemeta import read_meta
from autoprec.passes import lower, run_pipeline
from autoprec.policy import Policy, Rule
from tests.conftest import RTOL


class RMSNorm(nn.Module):
    """HF Llama/Qwen2 style: ``weight * (x * rsqrt(mean(x**2) + eps))``; the mean spelled as
    ``mean``, or as ``sum`` divided by (multiplied with the inverse of) the size."""

    def __init__(self, dim: int, mean: str = "mean") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.mean = mean

    def forward(self, x):
        sq = x.pow(2)
        if self.mean == "mean":
            var = sq.mean(-1, keepdim=True)
        elif self.mean == "sum_div":
            var = sq.sum(-1, keepdim=True) / x.shape[-1]
        else:
            var = sq.sum(-1, keepdim=True) * (1.0 / x.shape[-1])
        return self.weight * (x * torch.rsqrt(var + 1e-6))


class Net(nn.Module):
    def __init__(self, mean: str = "mean") -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(8))
        self.norm = RMSNorm(8, mean)

    def forward(self, x):
        return self.norm(x * self.gain)


def drift(model, f, x):
    """(grad_rel_l2, loss_rel) against fp32; NaN/inf count as infinite drift."""
    def run(fn):
        model.zero_grad()
        out = fn(x).float()
        loss = (out * torch.linspace(1, 2, 8)).sum()
        loss.backward()
        return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])

    l32, g32 = run(model)
    loss, g = run(f)
    if not (torch.isfinite(loss) and torch.isfinite(g).all()):
        return math.inf, math.inf
    return float((g - g32).norm() / g32.norm()), float((loss - l32).abs() / l32.abs())


REGION = {"norm/pow#0", "norm/mean#0", "norm/add#0", "norm/rsqrt#0", "norm/mul#0"}
#: The nodes of the norm per spelling of its mean.
REGIONS = {"mean": REGION,
           "sum_div": {"norm/pow#0", "norm/sum#0", "norm/div#0", "norm/add#0", "norm/rsqrt#0", "norm/mul#0"},
           "sum_mul": {"norm/pow#0", "norm/sum#0", "norm/mul#0", "norm/add#0", "norm/rsqrt#0", "norm/mul#1"}}


def _dtypes(gm):
    return {read_meta(n).key: read_meta(n).dtype for n in gm.graph.nodes
            if read_meta(n).key is not None}


@pytest.mark.parametrize("policy", [
    Policy.default("fp16"),
    # even a policy that lowers every follow op keeps the norm's mul (it is part of the pattern)
    Policy(default_dtype="fp16", rules=(Rule(op_class="sensitive", dtype="fp32"),
                                        Rule(op_class="follow", dtype="fp16"))),
])
@pytest.mark.parametrize("mean", sorted(REGIONS))
def test_c04_rmsnorm_square_overflow(policy, mean):
    model = Net(mean)
    x = torch.full((1, 8), 300.0)
    gm = capture(model, (x,))
    r = run_pipeline(gm, policy)
    d = _dtypes(r.graph_module)
    region = REGIONS[mean]
    assert {k: d[k] for k in region} == dict.fromkeys(region, "fp32")
    for n in r.graph_module.graph.nodes:
        if read_meta(n).key in region:
            assert read_meta(n).op_class == "sensitive"
            assert read_meta(n).pattern == "rms_norm"
            assert "C04" in read_meta(n).reason
    out = r.graph_module(x)
    torch.testing.assert_close(out, torch.ones(1, 8), rtol=RTOL[torch.float16], atol=0)  # true: all ones
    g_rel, l_rel = drift(model, r.graph_module, x)
    assert g_rel < 1e-2 and l_rel < 1e-3


def test_c04_lowering_the_norm_is_caught_by_drift():
    model = Net()
    x = torch.full((1, 8), 300.0)
    gm = capture(model, (x,))
    lowered = lower(gm, Policy(default_dtype="fp16", rules=(Rule(module="norm", op_class="sensitive",
                                                                  dtype="fp16"),)))
    assert _dtypes(lowered)["norm/pow#0"] == "fp16"
    out = lowered(x)
    assert torch.all(out == 0)  # x**2 = 90000 -> inf, rsqrt(inf) = 0: silently all zeros
    g_rel, l_rel = drift(model, lowered, x)
    assert g_rel > 0.5 and l_rel > 0.5  # huge (or infinite): never within a drift budget


def test_tune_refuses_an_auto_budget_from_an_autocast_that_overflows(tmp_path):
    """C04 end to end (a fresh user's report): under fp16 autocast the norm's ``x**2`` overflows, so
    torch.autocast's own grad_rel_l2 is ~1; ``--max-drift auto`` relative to it would pass a policy
    that zeroes the norm. ``tune`` refuses it before any trial, naming the model file, the dtype and
    the number, and writes nothing; with ``--max-drift`` the same run goes on."""
    from autoprec.errors import SearchError
    from autoprec.search.study import tune
    from tests.conftest import MODELS

    model, out = MODELS / "c04_norm_overflow.py", tmp_path / "p.json"
    kw = dict(dtypes="fp16", compile=False, trials=1, traj_steps=0, quiet=True, progress=False, report=False,
              storage=f"sqlite:///{tmp_path / 's.db'}")
    with pytest.raises(SearchError, match=r"c04_norm_overflow.py: torch.autocast\(torch.float16\)'s own "
                                          r"gradients are grad_rel_l2 0\.9\d+ from fp32's"):
        tune(model, out=out, **kw)
    assert not out.exists()
    res = tune(model, out=out, max_drift=0.05, **kw)
    assert out.exists() and res.policy.measured["grad_rel_l2"] <= 0.05
