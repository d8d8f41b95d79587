"""C03: scalar constants that do not fit the lowered dtype (masked_fill(-1e9), x * 1e5 in fp16)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoprec.capture import capture
from autoprec.errors import PassError
from autoprec.nodemeta import read_meta
from autoprec.passes import run_pipeline
from autoprec.policy import Policy, Rule

FP16_MIN = float(torch.finfo(torch.float16).min)


class MaskedScores(nn.Module):
    def __init__(self, fill: float) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.fill = fill

    def forward(self, x, mask):
        return torch.softmax(self.fc(x).masked_fill(mask, self.fill), -1)


class FullMask(nn.Module):
    """An additive mask built with ``torch.full(-1e9)`` (a factory, kept fp32) added in fp16."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, mask):
        bias = torch.full((4, 8), -1e9).masked_fill(~mask, 0.0)
        return torch.softmax(self.fc(x) + bias, -1)


class BigScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.fc(x) * 1e5)


def _inputs():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    mask = torch.rand(4, 8) < 0.5
    mask[1] = True  # a fully masked row
    mask[:, 0] &= torch.tensor([True, True, False, True])
    return x, mask


FP16_ALL = Policy(default_dtype="fp16", rules=(Rule(op_class="follow", dtype="fp16"),))


def _node(gm, op):
    return next(n for n in gm.graph.nodes if read_meta(n).op == op)


def test_c03_mask_constant_out_of_range():
    model = MaskedScores(-1e9)
    x, mask = _inputs()
    gm = capture(model, (x, mask))
    r = run_pipeline(gm, FP16_ALL)
    mf = _node(r.graph_module, "masked_fill")
    assert read_meta(mf).dtype == "fp16"
    assert mf.args[2] == FP16_MIN  # -1e9 replaced by finfo(fp16).min
    assert r.stats["constants_clamped"] == 1
    out, ref = r.graph_module(x, mask), model(x, mask)
    assert torch.isfinite(out).all()
    # the fully masked row is uniform (as in fp32 with -1e9), not NaN
    torch.testing.assert_close(out[1], torch.full((8,), 1 / 8))
    torch.testing.assert_close(out, ref, rtol=0, atol=5e-3)


def test_c03_strict_mode_names_node_and_constant():
    x, mask = _inputs()
    gm = capture(MaskedScores(-1e9), (x, mask))
    with pytest.raises(PassError, match=r"masked_fill#0.*-1000000000\.0.*fp16"):
        run_pipeline(gm, FP16_ALL, constants="strict")
    # bf16 has fp32's range: the same constant is fine
    run_pipeline(gm, Policy(default_dtype="bf16", rules=(Rule(op_class="follow", dtype="bf16"),)),
                 constants="strict")


def test_c03_full_constant_saturates_when_cast():
    model = FullMask()
    x, mask = _inputs()
    gm = capture(model, (x, mask))
    r = run_pipeline(gm, FP16_ALL)
    sat = [n for n in r.graph_module.graph.nodes if read_meta(n).saturating_cast]
    assert len(sat) == 1
    out, ref = r.graph_module(x, mask), model(x, mask)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=0, atol=5e-3)


def test_c03_scalar_out_of_range_keeps_node_fp32():
    model = BigScale()
    x = torch.randn(4, 8) * 1e-3
    gm = capture(model, (x,))
    r = run_pipeline(gm, FP16_ALL)
    mul = _node(r.graph_module, "mul")
    assert read_meta(mul).dtype == "fp32"
    assert read_meta(mul).decided_by == "constant out of range"
    assert "100000.0" in read_meta(mul).reason
    torch.testing.assert_close(r.graph_module(x), model(x), rtol=0, atol=2e-2)
    with pytest.raises(PassError, match=r"mul#0.*100000\.0"):
        run_pipeline(gm, FP16_ALL, constants="strict")


def test_c03_all_minus_inf_row_is_nan_in_fp32_too():
    """-inf is representable in every dtype: autoprec keeps the model's meaning (a fully masked
    -inf row is NaN in the fp32 reference as well) and the drift check reports it."""
    model = MaskedScores(float("-inf"))
    x, mask = _inputs()
    gm = capture(model, (x, mask))
    r = run_pipeline(gm, FP16_ALL)
    assert _node(r.graph_module, "masked_fill").args[2] == float("-inf")
    assert torch.isnan(model(x, mask)[1]).all() and torch.isnan(r.graph_module(x, mask)[1]).all()
    assert torch.isfinite(r.graph_module(x, mask)[[0, 2, 3]]).all()


class AdditiveMask(nn.Module):
    """Hugging Face's additive spelling: ``scores + (1 - keep) * -1e9``."""

    def __init__(self, big: float) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.big = big

    def forward(self, x, keep):
        return torch.softmax(self.fc(x) + (1.0 - keep.float()) * self.big, -1)


@pytest.mark.parametrize("big", [-1e9, float(torch.finfo(torch.float32).min)])
def test_c03_additive_mask_carried_into_a_follow_node_stays_fp32(big):
    """The ``mul`` by the constant was kept fp32 but the ``add`` reading it ran in fp16 (a search
    point, ``follow->fp16``): the fully masked row became -inf, NaN after softmax."""
    x, mask = _inputs()
    keep = ~mask  # row 1 fully masked
    model = AdditiveMask(big)
    pol = Policy(default_dtype="fp16", rules=(Rule(op_class="sensitive", dtype="fp32"),
                                              Rule(op_class="follow", dtype="fp16")))
    r = run_pipeline(capture(model, (x, keep)), pol)
    add = _node(r.graph_module, "add")
    assert read_meta(add).dtype == "fp32" and read_meta(add).decided_by == "constant out of range"
    assert "reads mul#0, which combines constant" in read_meta(add).reason
    out = r.graph_module(x, keep)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, model(x, keep), rtol=1e-2, atol=1e-2)  # fp16 scores, fp32 softmax
