"""Shared test fixtures and the per-dtype tolerance table (docs/architecture.md#house-style)."""

from __future__ import annotations

import pathlib

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

#: torch.testing.assert_close default rtol per dtype (PyTorch docs), used as drift tolerances.
RTOL = {torch.float32: 1.3e-6, torch.bfloat16: 1.6e-2, torch.float16: 1e-3}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
