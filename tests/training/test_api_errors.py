"""Errors and hints of the Python API: per-shape capture, the loss-scale floor advice, torch's
pytree deprecation warning, and the loss-scaler hint of ``apply``."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

import autoprec
import autoprec.training.monitor  # the module the LossScaleError message names
from autoprec.errors import LossScaleError
from autoprec.training.monitor import Monitor, first_nonfinite_node
from autoprec.training.scaler import DynamicLossScaler
from autoprec.training.train import TrainStep, make_scaler
from tests.models.c01_ffn import FFN


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.fc = nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.fc(self.emb(ids))
        if mask is not None:
            h = h * mask[..., None]
        return h.float().sum()


class Nested(Tiny):
    def forward(self, ids: torch.Tensor, extra: list) -> torch.Tensor:  # type: ignore[override]
        return (self.fc(self.emb(ids)).sum((-2, -1)) + extra[0] + extra[1]["z"]).sum()


def _ids(b: int, t: int = 4) -> torch.Tensor:
    return torch.randint(0, 10, (b, t), generator=torch.Generator().manual_seed(b))


# ------------------------------------------------------------------ 1. the capture is per shape
@pytest.mark.parametrize("compile", [False, True])
def test_other_batch_size_names_input_and_both_shapes(compile):
    """The one-shape capture (apply(..., dynamic=False)) refuses other shapes before the graph runs."""
    torch.manual_seed(0)
    model = Tiny()
    mp = autoprec.apply(model, autoprec.Policy.default("bf16"), (_ids(8),), compile=compile, dynamic=False)
    with pytest.raises(ValueError) as err:  # checked before the graph runs: no compile needed
        mp(_ids(3))
    msg = str(err.value)
    assert "MixedPrecisionModule was captured for input shapes {ids: (8, 4)}" in msg
    assert "got shapes {ids: (3, 4)}" in msg
    assert "input 'ids' has shape (3, 4), captured (8, 4)" in msg
    assert "the capture is per shape" in msg and "autoprec.apply(model, policy, batch)" in msg
    assert "Guard failed" not in msg and not isinstance(err.value, AssertionError)
    with pytest.raises(ValueError, match=r"input 'ids' has shape \(8, 5\), captured \(8, 4\)"):
        mp(ids=_ids(8, 5))  # keyword call, other sequence length


def test_right_shape_still_runs_and_other_errors_are_the_graphs_own():
    torch.manual_seed(0)
    model = Tiny()
    ids, mask = _ids(8), torch.ones(8, 4)
    mp = autoprec.apply(model, autoprec.Policy.fp32(), {"ids": ids, "mask": mask}, compile=False,
                        dynamic=False)
    torch.testing.assert_close(mp(ids=ids, mask=mask), model(ids, mask))
    torch.testing.assert_close(mp(ids, mask), model(ids, mask))  # positional, like the exported forward
    with pytest.raises(ValueError) as err:
        mp(ids=ids, mask=torch.ones(2, 4))
    msg = str(err.value)
    assert "captured for input shapes {ids: (8, 4), mask: (8, 4)}" in msg
    assert "got shapes {ids: (8, 4), mask: (2, 4)}" in msg and "input 'mask' has shape (2, 4)" in msg
    assert "input 'ids'" not in msg  # only the input that differs is blamed
    with pytest.raises(TypeError):  # a wrong call is left to the graph, not reported as a shape
        mp(ids, mask, torch.ones(1))


def test_nested_input_is_named_by_its_path():
    torch.manual_seed(0)
    model = Nested()
    batch = {"ids": _ids(8), "extra": [torch.ones(8), {"z": torch.ones(8)}]}
    mp = autoprec.apply(model, autoprec.Policy.fp32(), batch, compile=False, dynamic=False)
    torch.testing.assert_close(mp(**batch), model(**batch))
    with pytest.raises(ValueError) as err:
        mp(ids=_ids(8), extra=[torch.ones(8), {"z": torch.ones(3)}])
    assert "input \"extra[1]['z']\" has shape (3,), captured (8,)" in str(err.value)


def test_monitor_diagnosis_of_another_shape_says_so():
    model = FFN()
    x = torch.full((1, 256), 16.0)
    mp = autoprec.apply(model, autoprec.Policy.default("fp16"), (x,), compile=False, dynamic=False)
    with pytest.raises(ValueError, match=r"input 'x' has shape \(2, 256\), captured \(1, 256\)"):
        first_nonfinite_node(mp.graph_module, (torch.full((2, 256), 16.0),))


# ------------------------------------------------------------------ 2. the loss-scale floor advice
def _train_until_floor_error(mp, model, batch, scaler, monitor=None) -> LossScaleError:
    params = list(model.parameters())
    step = TrainStep(mp, params, torch.optim.SGD(params, lr=0.1), lambda out, b: out.float().sum(),
                     scaler=scaler)
    with pytest.raises(LossScaleError) as err:
        for _ in range(20):
            if monitor is not None:
                monitor.last_batch = batch
            step(batch)
    return err.value


def test_loss_scale_error_advice_followed_literally_names_the_node():
    """C01 (fp16 x @ w = 66355 > 65504): do what the message says, get ``proj/linear#0``."""
    model = FFN()
    x = torch.full((1, 256), 16.0)
    batch = (x,)
    mp = autoprec.apply(model, autoprec.Policy.default("fp16"), batch, compile=False)
    scaler = DynamicLossScaler(init_scale=4.0, min_scale=1.0, max_skips_at_floor=2)
    msg = str(_train_until_floor_error(mp, model, batch, scaler))
    assert "forward pass" in msg
    # every name the advice gives is real: autoprec.X.Y and Monitor.X resolve
    names = re.findall(r"(?<![\w.])((?:autoprec|Monitor)(?:\.\w+)+)", msg)
    assert names
    for name in names:
        obj = autoprec
        for part in name.removeprefix("autoprec.").split("."):
            assert hasattr(obj, part), f"the advice names {name}, which does not exist"
            obj = getattr(obj, part)

    # route 1: monitor = autoprec.Monitor(graph_module=mp.graph_module), diagnose=monitor.diagnoser(),
    # monitor.last_batch = batch before each step
    m = re.search(r"monitor = (autoprec\.Monitor\(graph_module=mp\.graph_module\))", msg)
    assert m and "diagnose=monitor.diagnoser()" in msg
    assert "monitor.last_batch = batch before each step" in msg
    monitor = eval(m.group(1), {"autoprec": autoprec, "mp": mp})  # noqa: S307 - the message's own code
    assert isinstance(monitor, Monitor)
    scaler = DynamicLossScaler(init_scale=4.0, min_scale=1.0, max_skips_at_floor=2,
                               diagnose=monitor.diagnoser())
    err = _train_until_floor_error(mp, model, batch, scaler, monitor)
    assert "First node that produced a non-finite value: 'proj/linear#0'" in str(err)

    # route 2: autoprec.training.monitor.first_nonfinite_node(mp.graph_module, batch)
    call = re.search(r"(autoprec\.training\.monitor\.first_nonfinite_node\(mp\.graph_module, batch\))", msg)
    assert call
    assert eval(call.group(1), {"autoprec": autoprec, "mp": mp, "batch": batch}) == "proj/linear#0"  # noqa: S307


# ------------------------------------------------------------------ 3. torch's LeafSpec FutureWarning
def test_capture_and_apply_do_not_leak_the_leafspec_warning():
    torch.manual_seed(0)
    model = Tiny()
    batch = {"ids": _ids(8), "mask": torch.ones(8, 4)}
    filters_before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # overrides pytest's own LeafSpec filter (pyproject.toml)
        autoprec.capture(model, batch)
        mp = autoprec.apply(model, autoprec.Policy.default("bf16"), batch, compile=False)
        mp(**batch)
    leaf = [w for w in seen if issubclass(w.category, FutureWarning) and "LeafSpec" in str(w.message)]
    assert leaf == []
    assert list(warnings.filters) == filters_before  # the filter is scoped, never global


def test_capture_still_shows_the_models_own_warnings():
    class Warns(Tiny):
        def forward(self, ids):  # type: ignore[override]
            warnings.warn("model says hello", UserWarning, stacklevel=1)
            return super().forward(ids)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        autoprec.capture(Warns(), (_ids(8),))
    assert any("model says hello" in str(w.message) for w in seen)


# ------------------------------------------------------------------ 4. fp16 needs a loss scaler
def test_an_fp16_policy_needs_a_loss_scaler_and_make_scaler_builds_it():
    x = torch.full((1, 256), 1.0)
    fp16 = autoprec.apply(FFN(), autoprec.Policy.default("fp16"), (x,), compile=False)
    bf16 = autoprec.apply(FFN(), autoprec.Policy.default("bf16"), (x,), compile=False)
    assert fp16.policy.needs_loss_scaling and isinstance(make_scaler(fp16.policy), DynamicLossScaler)
    assert not bf16.policy.needs_loss_scaling and make_scaler(bf16.policy) is None
