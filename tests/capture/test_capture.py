"""capture(): shared Parameters, stable node keys, call signature, regions, errors."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from autoprec.capture import capture
from autoprec.errors import CaptureError
from autoprec.nodemeta import read_meta


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x, scale=None):
        for layer in self.layers:
            x = layer(x)
        return {"out": x * (1.0 if scale is None else scale), "sum": x.sum()}


def _keys(gm):
    return [read_meta(n).key for n in gm.graph.nodes if n.op == "call_function"]


def test_keys_format_and_stability():
    torch.manual_seed(0)
    m = Net()
    x = torch.randn(3, 8)
    k1 = _keys(capture(m, {"x": x}))
    k2 = _keys(capture(m, {"x": torch.randn(3, 8)}))
    assert k1 == k2
    assert "layers.1.fc2/linear#0" in k1 and "layers.0/add#0" in k1
    assert len(set(k1)) == len(k1)
    assert all(re.fullmatch(r"([\w.]+/)?\w+#\d+", k) for k in k1), k1
    # a fresh instance of the same code gives the same keys
    assert _keys(capture(Net(), {"x": x})) == k1


def test_shares_parameters_and_matches_forward():
    torch.manual_seed(0)
    m = Net()
    x = torch.randn(3, 8)
    gm = capture(m, {"x": x})
    assert {id(p) for p in gm.parameters()} <= {id(p) for p in m.parameters()}
    out, ref = gm(x=x), m(x=x)
    assert set(out) == {"out", "sum"}
    torch.testing.assert_close(out["out"], ref["out"])
    out["sum"].backward()
    assert m.layers[0].fc1.weight.grad is not None  # gradients land on the user's parameters
    assert m.training


def test_tuple_and_tensor_batches():
    m = Block()
    x = torch.randn(2, 8)
    torch.testing.assert_close(capture(m, x)(x), m(x))
    torch.testing.assert_close(capture(m, (x,))(x), m(x))


def test_no_runtime_dtype_asserts_left():
    class ToFloat(nn.Module):
        def forward(self, x):
            return x.to(torch.float32) * 2

    gm = capture(ToFloat(), (torch.randn(2),))
    assert not any("assert" in str(n.target) for n in gm.graph.nodes)


def test_capture_error_is_a_capture_error():
    class Shapey(nn.Module):
        def forward(self, x):
            return x[: int(x.sum().item() > 0) + 1]

    with pytest.raises(CaptureError, match="Shapey"):
        capture(Shapey(), (torch.randn(4),))


class _DataDependent(nn.Module):
    """Case C13's untraceable `if`, plus a line the model itself writes to stderr."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x):
        import sys

        print("model says hello", file=sys.stderr)
        if x.abs().max() > 100:
            x = x / 100
        return self.lin(x).sum()


def test_failed_capture_prints_no_partial_graph(capfd):
    """torch.export prints its partial FX graph to stderr when it fails; capture's own error names
    the source line instead, so the dump is dropped, while the model's own output still shows."""
    with pytest.raises(CaptureError, match=r"test_capture.py:\d+ \(forward\)"):
        capture(_DataDependent(), (torch.randn(2, 4),))
    err = capfd.readouterr().err
    assert "model says hello" in err
    assert "def forward" not in err and "Unable to find user code" not in err, err
