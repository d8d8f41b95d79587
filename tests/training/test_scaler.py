"""DynamicLossScaler against torch.amp.GradScaler, plus its own checks (floor, cap, state, errors)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autoprec.errors import LossScaleError
from autoprec.training.scaler import DynamicLossScaler, unscaled_grad_norm

GRADSCALER_KEYS = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
FP32_MAX = float(torch.finfo(torch.float32).max)


def _model_and_opt(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _backward(scaler, model: torch.nn.Module, kind: str) -> None:
    """Scaled backward of a fixed loss; ``kind`` injects an inf or NaN into one gradient."""
    x = torch.linspace(-1.0, 1.0, 6).reshape(2, 3)
    scaler.scale(model(x).pow(2).sum()).backward()
    if kind == "inf":
        model.weight.grad[0, 1] = math.inf
    elif kind == "nan":
        model.bias.grad[1] = math.nan


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in model.parameters()]
    for state in opt.state.values():
        tensors += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def _bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@settings(max_examples=40, deadline=None)
@given(
    init_scale=st.floats(min_value=1.0, max_value=2.0**20),
    growth_factor=st.floats(min_value=1.0, max_value=4.0, exclude_min=True),
    backoff_factor=st.floats(min_value=0.01, max_value=1.0, exclude_max=True),
    growth_interval=st.integers(min_value=1, max_value=4),
    kinds=st.lists(st.sampled_from(["finite", "finite", "inf", "nan"]), min_size=1, max_size=30),
)
def test_scaler_matches_gradscaler(init_scale, growth_factor, backoff_factor, growth_interval, kinds):
    """Same scale after each update, same skips, bitwise-equal parameters (floor/cap not binding)."""
    cfg = {"init_scale": init_scale, "growth_factor": growth_factor, "backoff_factor": backoff_factor,
           "growth_interval": growth_interval}
    ours = DynamicLossScaler(**cfg, min_scale=2.0**-100, max_scale=FP32_MAX)
    ref = torch.amp.GradScaler("cpu", **cfg)
    model, opt = _model_and_opt()
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.01, momentum=0.9)
    skips = 0
    for kind in kinds:
        for m, o, s in ((model, opt, ours), (ref_model, ref_opt, ref)):
            o.zero_grad()
            _backward(s, m, kind)
        expect_skip = not all(torch.isfinite(p.grad).all() for p in ref_model.parameters())
        before = _snapshot(model, opt)
        applied = ours.step(opt)
        ref.step(ref_opt)
        assert applied is not expect_skip
        assert ours.found_inf is expect_skip
        if expect_skip:
            skips += 1
            assert _bitwise_equal(_snapshot(model, opt), before)
        assert _bitwise_equal(_snapshot(model, opt), _snapshot(ref_model, ref_opt))
        ours.update()
        ref.update()
        if ref.get_scale() < 2.0**-100:  # the floor would bind from here on
            break
        assert ours.get_scale() == ref.get_scale()
        assert ours.state_dict()["_growth_tracker"] == ref.state_dict()["_growth_tracker"]
    assert ours.skipped_steps == skips


def test_scaler_update_rounds_like_the_amp_kernel():
    """Non-power-of-2 factors: the product is formed in double and rounded to fp32, as GradScaler does."""
    ours = DynamicLossScaler(init_scale=3.0, growth_factor=1.1, backoff_factor=0.3, growth_interval=1,
                             min_scale=2.0**-20, max_scale=2.0**20)
    ref = torch.amp.GradScaler("cpu", init_scale=3.0, growth_factor=1.1, backoff_factor=0.3,
                               growth_interval=1)
    model, opt = _model_and_opt()
    for kind in ["finite"] * 5 + ["inf"] * 3 + ["finite"] * 4:
        for s in (ours, ref):
            opt.zero_grad()
            _backward(s, model, kind)
            s.unscale_(opt)
            s.update()
        assert ours.get_scale() == ref.get_scale()
        assert ours.get_scale() == float(torch.tensor(ours.get_scale(), dtype=torch.float32))


def _tiny_loss_step(scaler, p: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    scaler.scale((p * 1e-30).sum()).backward()
    scaler.step(opt)
    scaler.update()


def test_scaler_growth_never_reaches_inf_and_is_capped():
    p = torch.ones(2, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.0)
    ours = DynamicLossScaler(init_scale=2.0**120, growth_interval=1, max_scale=FP32_MAX)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**120, growth_interval=1)
    for _ in range(12):
        _tiny_loss_step(ours, p, opt)
        _tiny_loss_step(ref, p, opt)
        assert ours.get_scale() == ref.get_scale() < math.inf
    assert ours.get_scale() == 2.0**127  # 2**128 overflows fp32: GradScaler keeps the old scale
    assert ours.skipped_steps == 0
    capped = DynamicLossScaler(init_scale=2.0**10, growth_interval=1, max_scale=2.0**12)
    for _ in range(5):
        _tiny_loss_step(capped, p, opt)
        assert capped.get_scale() <= 2.0**12
    assert capped.get_scale() == 2.0**12


def test_scaler_unscale_divides_once_in_fp32():
    model, opt = _model_and_opt()
    scaler = DynamicLossScaler(init_scale=2.0**10)
    _backward(scaler, model, "finite")
    scaled = [p.grad.clone() for p in model.parameters()]
    scaler.unscale_(opt)
    for p, g in zip(model.parameters(), scaled, strict=True):
        assert torch.equal(p.grad, g / 2.0**10)
    assert scaler.step(opt) is True  # does not unscale a second time
    for p, g in zip(model.parameters(), scaled, strict=True):
        assert torch.equal(p.grad, g / 2.0**10)
    scaler.update()


def test_scaler_call_order_errors():
    model, opt = _model_and_opt()
    scaler = DynamicLossScaler()
    with pytest.raises(RuntimeError, match="update"):
        scaler.update()
    _backward(scaler, model, "finite")
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match="[Cc]losure"):
        DynamicLossScaler().step(opt, closure=lambda: 0.0)
    scaler.update()
    opt.zero_grad()
    _backward(scaler, model, "finite")
    assert scaler.step(opt) is True  # a new iteration after update() is fine
    scaler.update()


def test_scaler_disabled_is_a_passthrough():
    model, opt = _model_and_opt()
    scaler = DynamicLossScaler(enabled=False)
    loss = torch.tensor(3.0, dtype=torch.float16)
    assert scaler.scale(loss) is loss
    assert scaler.get_scale() == 1.0 and not scaler.is_enabled()
    _backward(scaler, model, "inf")
    before = _snapshot(model, opt)
    scaler.unscale_(opt)
    assert scaler.step(opt) is True  # a plain optimizer.step(), even with inf grads
    scaler.update()
    assert not _bitwise_equal(_snapshot(model, opt), before)
    assert scaler.state_dict() == {}


def test_scaler_scale_is_fp32():
    scaler = DynamicLossScaler(init_scale=2.0**16)
    out = scaler.scale(torch.tensor(2.0, dtype=torch.float16))
    assert out.dtype == torch.float32 and out.item() == 2.0**17  # fp16 would overflow to inf
    with pytest.raises(TypeError):
        scaler.scale(1.0)


@pytest.mark.parametrize("kwargs, name", [
    ({"growth_factor": 1.0}, "growth_factor"),
    ({"growth_factor": math.nan}, "growth_factor"),
    ({"backoff_factor": 1.0}, "backoff_factor"),
    ({"backoff_factor": 0.0}, "backoff_factor"),
    ({"growth_interval": 0}, "growth_interval"),
    ({"growth_interval": 2.0}, "growth_interval"),
    ({"min_scale": 0.0}, "min_scale"),
    ({"min_scale": 0.1}, "min_scale"),
    ({"init_scale": 0.5}, "init_scale"),
    ({"init_scale": 2.0**25}, "init_scale"),
    ({"max_scale": math.inf}, "max_scale"),
    ({"max_skips_at_floor": 0}, "max_skips_at_floor"),
    ({"diagnose": "node"}, "diagnose"),
])
def test_scaler_constructor_validation(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DynamicLossScaler(**kwargs)


def test_scaler_state_dict_json_and_gradscaler_compatible():
    model, opt = _model_and_opt()
    scaler = DynamicLossScaler(init_scale=2.0**8, growth_interval=3)
    for kind in ("inf", "finite"):
        opt.zero_grad()
        _backward(scaler, model, kind)
        scaler.step(opt)
        scaler.update()
    d = scaler.state_dict()
    assert GRADSCALER_KEYS <= set(d)
    assert json.loads(json.dumps(d)) == d
    assert all(type(v) in (int, float) for v in d.values())
    assert d["scale"] == 2.0**7 and d["_growth_tracker"] == 1 and d["skipped_steps"] == 1
    ref = torch.amp.GradScaler("cpu")
    ref.load_state_dict(d)
    assert ref.state_dict() == {k: d[k] for k in GRADSCALER_KEYS}
    fresh = DynamicLossScaler()
    fresh.load_state_dict(ref.state_dict())  # a GradScaler checkpoint resumes into autoprec's scaler
    assert fresh.get_scale() == 2.0**7 and fresh.state_dict()["_growth_tracker"] == 1
    fresh.load_state_dict(d)
    assert fresh.state_dict() == d
    fresh.load_state_dict(fresh.state_dict())
    assert fresh.state_dict() == d


@pytest.mark.parametrize("change, name", [
    ({"bogus": 1}, "bogus"),
    ({"scale": None}, "scale"),
    ({"scale": 0.1}, "scale"),
    ({"scale": 2.0**30}, "scale"),
    ({"growth_factor": 0.5}, "growth_factor"),
    ({"_growth_tracker": 3}, "_growth_tracker"),
    ({"_growth_tracker": -1}, "_growth_tracker"),
    ({"skipped_steps": 1.5}, "skipped_steps"),
    ({"consecutive_skips": 9}, "consecutive_skips"),
    ({"skips_at_floor": 1}, "skips_at_floor"),
    ({"min_scale": 2.0**17}, "scale"),
])
def test_scaler_load_state_dict_validation(change, name):
    scaler = DynamicLossScaler(growth_interval=3)
    good = scaler.state_dict()
    with pytest.raises(ValueError, match=name):
        scaler.load_state_dict({**good, **change})
    assert scaler.state_dict() == good  # nothing changed by a rejected load
    with pytest.raises(ValueError, match="_growth_tracker"):
        scaler.load_state_dict({k: v for k, v in good.items() if k != "_growth_tracker"})
    with pytest.raises(ValueError, match="empty"):
        scaler.load_state_dict({})


def _skip_until_error(scaler, model, opt, steps: int) -> int:
    for i in range(steps):
        opt.zero_grad()
        _backward(scaler, model, "nan")
        assert scaler.step(opt) is False
        try:
            scaler.update()
        except LossScaleError as e:
            scaler.error = e
            return i + 1
    return steps


def test_scaler_floor_error_without_diagnose_says_how_to_find_the_node():
    model, opt = _model_and_opt()
    scaler = DynamicLossScaler(init_scale=4.0, min_scale=1.0, max_skips_at_floor=3)
    assert _skip_until_error(scaler, model, opt, 20) == 2 + 3  # 4 -> 2 -> 1, then 3 skips at the floor
    msg = str(scaler.error)
    assert "forward" in msg and "first_nonfinite_node" in msg
    assert scaler.get_scale() == 1.0 and scaler.consecutive_skips == 5 and scaler.skips_at_floor == 3
    none_found = DynamicLossScaler(init_scale=1.0, max_skips_at_floor=1, diagnose=lambda: None)
    _skip_until_error(none_found, model, opt, 1)
    # a diagnose that finds no forward node: the backward overflowed even unscaled, and what to do
    # (a user test: "the non-finite values come from the forward pass ... the forward pass is finite",
    # then advice to build the Monitor autoprec train had already attached)
    msg = str(none_found.error)
    assert "has no non-finite output, so they arise in the backward pass" in msg, msg
    assert "loss_scaling.min_scale in the policy file" in msg and "a mean instead of a sum" in msg
    assert "first_nonfinite_node" not in msg and "come from the forward pass" not in msg


def test_scaler_clean_step_resets_skip_counters():
    model, opt = _model_and_opt()
    scaler = DynamicLossScaler(init_scale=1.0, max_skips_at_floor=3)
    for kind in ("nan", "nan", "finite", "nan", "nan", "finite"):
        opt.zero_grad()
        _backward(scaler, model, kind)
        scaler.step(opt)
        scaler.update()  # never 3 in a row: no error
    assert scaler.skipped_steps == 4 and scaler.consecutive_skips == 0 and scaler.skips_at_floor == 0


def test_scaler_unscaled_grad_norm():
    model, opt = _model_and_opt()
    scaler = DynamicLossScaler(init_scale=2.0**12)
    _backward(scaler, model, "finite")
    scaler.unscale_(opt)
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf, norm_type=2.0)
    assert unscaled_grad_norm(model.parameters()) == pytest.approx(float(expected), rel=1e-6)
    model.bias.grad[0] = math.nan
    assert unscaled_grad_norm(model.parameters()) == math.inf
    assert unscaled_grad_norm([torch.zeros(2, requires_grad=True)]) == 0.0
    half = torch.zeros(1000, dtype=torch.float16, requires_grad=True)
    half.grad = torch.full((1000,), 300.0, dtype=torch.float16)  # sum of squares 9e7 > fp16 max
    assert unscaled_grad_norm(half) == pytest.approx(300.0 * math.sqrt(1000), rel=1e-6)
