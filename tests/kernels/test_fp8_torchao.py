"""autoprec's fp8 path side by side with torchao.float8 (issue 21): ``fp8_linear`` against torchao's
own ``Float8Linear`` (what ``convert_to_float8_training`` swaps in) on the same inputs, per recipe,
forward, grad_x, grad_W and grad_bias; the recipe names against torchao's and the policy's; the
scale rule against torchao's ``tensor_to_scale``; the ImportError without torchao.

Tolerance: none. Both run torchao's ``matmul_with_hp_or_float8_args`` under
``Float8LinearConfig.from_recipe_name``, so the results are bit-identical (measured: max |diff| 0 at
64x128x96 and 256x512x1376, all recipes). The large shape takes ~2 min on one CPU core (torch's
reference fp8 kernel), so it is ``slow``.
"""

from __future__ import annotations

import sys

import pytest
import torch

import autoprec
from autoprec.kernels import fp8 as kfp8
from autoprec.kernels.fp8 import E4M3, E5M2, RECIPES, amax_scale, fp8_linear
from autoprec.policy import Policy, Rule
from autoprec.policy.checks import FP8_SCALINGS

ao = pytest.importorskip("torchao.float8")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402
from torchao.float8.float8_utils import tensor_to_scale  # noqa: E402


def _side_by_side(m: int, k: int, n: int, recipe: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    """Float8Linear(recipe) and fp8_linear on the same x [m, k], weight [n, k], bias and grad_output;
    returns both (output, grad_x, grad_W, grad_bias)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    go = torch.randn(m, n, generator=g).to(dtype)
    lin = torch.nn.Linear(k, n, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    ref = Float8Linear.from_float(lin, config=ao.Float8LinearConfig.from_recipe_name(recipe))
    xr = x.clone().requires_grad_()
    out_r = ref(xr)
    out_r.backward(go)
    xo, wo, bo = (t.clone().requires_grad_() for t in (x, w, b))
    out_o = fp8_linear(xo, wo, bo, recipe)
    out_o.backward(go)
    return (out_o, xo.grad, wo.grad, bo.grad), (out_r, xr.grad, ref.weight.grad, ref.bias.grad)


def _assert_identical(ours, theirs):
    for name, a, b in zip(("output", "grad_x", "grad_W", "grad_bias"), ours, theirs):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torchao_float8linear_64x128x96(recipe, dtype):
    _assert_identical(*_side_by_side(64, 128, 96, recipe, dtype))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_matches_torchao_float8linear_256x512x1376(recipe):
    _assert_identical(*_side_by_side(256, 512, 1376, recipe))


def test_matches_convert_to_float8_training_on_3d_inputs():
    """A module converted by torchao's own entry point, [B, T, K] input (leading dims flattened)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    x = torch.randn(2, 5, 64)
    for recipe in RECIPES:
        conv = ao.convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(64, 48)),
                                             config=ao.Float8LinearConfig.from_recipe_name(recipe))
        conv[0].load_state_dict(lin.state_dict())
        assert type(conv[0]).__name__ == "Float8Linear"
        torch.testing.assert_close(fp8_linear(x, lin.weight, lin.bias, recipe), conv(x), rtol=0, atol=0)


def test_recipe_names_are_torchaos_and_the_policys():
    assert RECIPES == tuple(r.value for r in ao.Float8LinearRecipeName) == FP8_SCALINGS


def test_policy_files_with_each_recipe_load_and_round_trip():
    """Existing files (``"rowwise"``, or no field: tensorwise) and the new recipe load unchanged."""
    rules = [{"op_class": "matmul", "dtype": "fp8_e4m3"}]
    base = {"schema_version": 2, "default_dtype": "bf16", "rules": rules}
    assert Policy.from_dict(base).fp8_scaling == "tensorwise"
    for recipe in RECIPES:
        p = Policy.from_dict({**base, "fp8_scaling": recipe})
        assert p.fp8_scaling == recipe and Policy.from_dict(p.to_dict()) == p
    with pytest.raises(autoprec.PolicyError, match="fp8_scaling"):
        Policy.from_dict({"schema_version": 2, "fp8_scaling": "blockwise", "rules": rules})


@pytest.mark.parametrize("dim", [None, -1, 0])
@pytest.mark.parametrize("pow2", [False, True])
def test_amax_scale_is_torchaos_tensor_to_scale(dim, pow2):
    t = torch.randn(33, 17) * torch.logspace(-3, 3, 17)
    gran = ao.ScalingGranularity.TENSORWISE if dim is None else ao.ScalingGranularity.AXISWISE
    for dtype in (E4M3, E5M2):
        want = tensor_to_scale(t, dtype, scaling_granularity=gran, axiswise_dim=dim,
                               round_scales_to_power_of_2=pow2)
        torch.testing.assert_close(amax_scale(t, dtype, dim, pow2), want, rtol=0, atol=0)


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(32, 16)

    def forward(self, x):
        return self.proj(x).relu().sum()


def test_without_torchao_an_fp8_policy_names_pip_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8.float8_linear", None)  # import raises ImportError
    kfp8._torchao.cache_clear()
    kfp8.torchao_config.cache_clear()
    try:
        with pytest.raises(ImportError, match="pip install torchao"):
            fp8_linear(torch.randn(4, 32), torch.randn(16, 32))
        ok, reason = kfp8.fp8_supported("cpu")
        assert not ok and "pip install torchao" in reason
        policy = Policy(default_dtype="fp32", rules=(Rule(op_class="matmul", dtype="fp8_e4m3"),))
        with pytest.raises(Exception, match="pip install torchao") as e:
            autoprec.apply(_Tiny(), policy, torch.randn(4, 32), compile=False, dynamic=False)
        assert "lower_fp8" in str(e.value)
        fp32 = Policy(default_dtype="fp32")
        autoprec.apply(_Tiny(), fp32, torch.randn(4, 32), compile=False, dynamic=False)  # no fp8: no torchao
    finally:
        kfp8._torchao.cache_clear()
        kfp8.torchao_config.cache_clear()
