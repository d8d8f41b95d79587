"""Issue 20, "memory pre-check in the Python API": ``autoprec.tune`` refuses a byte budget below
the fp32 parameters, gradients and optimizer state before any capture or measurement, as the CLI
does (``check_memory_floor``)."""

from __future__ import annotations

import pytest

import autoprec
from autoprec.errors import SearchError
from autoprec.search import study
from tests.conftest import MODELS

WIDE = str(MODELS / "wide_mlp.py")


def test_api_tune_refuses_an_impossible_budget_before_capture(tmp_path, monkeypatch):
    def no_capture(*_a, **_k):
        raise AssertionError("capture, probe and baselines must not start")

    monkeypatch.setattr(study, "Harness", no_capture)
    monkeypatch.setattr(study, "LoadMonitor", type("NoLoad", (), {"start": staticmethod(no_capture)}))
    out = tmp_path / "p.json"
    with pytest.raises(SearchError, match=r"max_memory: the budget \(10240 bytes\) is not above"):
        autoprec.tune(WIDE, max_memory="10KiB", out=out, device="cpu", quiet=True)
    assert list(tmp_path.iterdir()) == []
