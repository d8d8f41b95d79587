"""torch.autocast's GEMMs as fp32 products (autoprec/kernels/fp32_gemms.py): the same roundings as a
native low-precision GEMM, so torch.autocast's drift measured under it is its drift."""

from __future__ import annotations

import contextlib

import pytest
import torch

from autoprec.kernels.fp32_gemms import Fp32ComputeGemms


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_each_gemm_is_the_fp32_product_rounded_once(dtype):
    """mm, addmm (with beta/alpha), bmm and baddbmm of low operands give exactly the fp32 product
    of the same values rounded once to the low dtype; each is counted."""
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(8, 16, generator=g).to(dtype), torch.randn(16, 4, generator=g).to(dtype),
               torch.randn(4, generator=g).to(dtype))
    a3, b3, c3 = (torch.randn(2, 8, 16, generator=g).to(dtype), torch.randn(2, 16, 4, generator=g).to(dtype),
                  torch.randn(2, 8, 4, generator=g).to(dtype))
    with Fp32ComputeGemms(dtype) as mode:
        got = [torch.mm(a, b), torch.addmm(c, a, b, beta=0.5, alpha=2.0), torch.bmm(a3, b3),
               torch.baddbmm(c3, a3, b3)]
    want = [torch.mm(a.float(), b.float()), torch.addmm(c.float(), a.float(), b.float(), beta=0.5, alpha=2.0),
            torch.bmm(a3.float(), b3.float()), torch.baddbmm(c3.float(), a3.float(), b3.float())]
    assert mode.count == 4
    for x, y in zip(got, want):
        assert x.dtype == dtype and torch.equal(x, y.to(dtype))


def test_other_gemms_and_ops_run_as_dispatched():
    """fp32 GEMMs, a GEMM of another low dtype and non-GEMM ops are not touched (count 0)."""
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    with Fp32ComputeGemms(torch.bfloat16) as mode:
        assert torch.equal(torch.mm(a, b), a @ b)
        half = torch.mm(a.half(), b.half())
        assert half.dtype == torch.float16
        (a.bfloat16() * 2).sum()
    assert mode.count == 0


def test_only_16_bit_dtypes():
    with pytest.raises(ValueError, match="bf16/fp16 GEMMs, not torch.float32"):
        Fp32ComputeGemms(torch.float32)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 192), torch.nn.GELU(), torch.nn.Linear(192, 64))


def _grads(model: torch.nn.Module, x: torch.Tensor, autocast: bool, mode=None) -> list[torch.Tensor]:
    model.zero_grad()
    with contextlib.ExitStack() as stack:
        if mode is not None:
            stack.enter_context(mode)
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            loss = model(x).float().pow(2).mean()
        loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def test_autocast_training_step_drift_matches_the_native_kernels():
    """A bf16 autocast forward/backward under the mode: every GEMM of both passes goes through it
    (2 forward, 3 backward: the first layer's input needs no gradient) and the gradients' drift
    against fp32 is native autocast's within 2% (summation order is all that differs)."""
    model, x = _mlp(), torch.randn(128, 64, generator=torch.Generator().manual_seed(1))
    ref = _grads(model, x, autocast=False)
    native = _grads(model, x, autocast=True)
    mode = Fp32ComputeGemms(torch.bfloat16)
    emulated = _grads(model, x, autocast=True, mode=mode)
    assert mode.count == 5
    flat = lambda gs: torch.cat([g.flatten() for g in gs])  # noqa: E731
    d_native, d_emulated = _rel(flat(native), flat(ref)), _rel(flat(emulated), flat(ref))
    assert 1e-4 < d_native < 5e-2  # bf16's drift, not fp32's
    assert d_emulated == pytest.approx(d_native, rel=0.02)
    assert _rel(flat(emulated), flat(native)) < 0.25 * d_native


def test_a_compiled_function_runs_eagerly_under_it():
    """Dynamo does not compile under a dispatch mode: a compiled function's GEMMs reach the mode
    (what the harness relies on for a compiled fn's drift passes, docstring of Harness.drift)."""
    model, x = _mlp(), torch.randn(32, 64)
    compiled = torch.compile(model)
    with torch.autocast("cpu", torch.bfloat16), Fp32ComputeGemms(torch.bfloat16) as mode:
        out = compiled(x)
    assert mode.count == 2 and out.dtype == torch.bfloat16
