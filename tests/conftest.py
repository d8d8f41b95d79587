"""Shared test fixtures and the per-dtype tolerance table (docs/architecture.md#house-style)."""

from __future__ import annotations

import pathlib

import pytest
import torch

#: The repository, its examples, and the model files the tests load (tests/models/); every test
#: file takes its paths from here, whatever folder it sits in.
ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
MODELS = ROOT / "tests" / "models"

#: torch.testing.assert_close default rtol per dtype (PyTorch docs), used as drift tolerances.
RTOL = {torch.float32: 1.3e-6, torch.bfloat16: 1.6e-2, torch.float16: 1e-3}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
