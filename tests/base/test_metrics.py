"""The drift metrics (autoprec.metrics) against their definitions computed directly in float64
(docs/architecture.md#measurements)."""

from __future__ import annotations

import math

import pytest
import torch

from autoprec.metrics import grad_errors, grad_rel_l2, grad_sqnr_db_min


def _pair(dtype: torch.dtype):
    ref = [torch.randn(64, 32), torch.randn(32), torch.zeros(8)]  # a zero gradient: no SQNR
    grads = [r.to(dtype).float() if dtype != torch.float32 else r + 1e-4 * torch.randn_like(r) for r in ref]
    return grads, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_metrics_match_their_float64_definitions(dtype):
    grads, ref = _pair(dtype)
    g64 = torch.cat([g.double().flatten() for g in grads])
    r64 = torch.cat([r.double().flatten() for r in ref])
    expected = float((g64 - r64).norm() / r64.norm())
    assert grad_rel_l2(grads, ref) == pytest.approx(expected, rel=1e-12)
    per = [20 * math.log10(float(r.double().norm() / (g.double() - r.double()).norm()))
           for g, r in zip(grads[:2], ref[:2], strict=True)]
    assert grad_sqnr_db_min(grads, ref) == pytest.approx(min(per), rel=1e-12)
    errors = grad_errors(grads, ref)
    assert len(errors[0]) == len(errors[1]) == 3 and errors[1][2] == 0.0
    assert grad_rel_l2(grads, ref, errors) == grad_rel_l2(grads, ref)  # precomputed errors: same value
    # one rounding to bf16 (unit round-off 2^-9) or fp16 (2^-11) per element bounds the drift
    if dtype != torch.float32:
        assert expected < (2 ** -8 if dtype == torch.bfloat16 else 2 ** -10)


def test_non_finite_gradients_give_inf_and_minus_inf():
    grads, ref = _pair(torch.float32)
    grads[1][3] = float("inf")
    assert grad_rel_l2(grads, ref) == math.inf
    assert grad_sqnr_db_min(grads, ref) == -math.inf
    assert grad_errors([], []) == ([], [])
