"""Shared test fixtures, the repository's paths, and the one tolerance table of the tests
(docs/architecture.md#house-style)."""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass

# Under pytest-xdist (make test: two workers on two cores) each worker and the processes its tests
# start use one OpenMP thread, so that the workers do not spin against each other (two processes
# each spinning on every core slow each other 10-70x). Set before torch is imported, as OpenMP
# reads it once.
# Inductor compiles in this process too, not in a pool of compile workers (two per process on two
# cores, each importing torch): with two test workers and the tune and train processes the tests
# start, pools cost more CPU than they save. The compiled kernels are the same.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

#: The repository, its examples, and the model files the tests load (tests/models/); every test
#: file takes its paths from here, whatever folder it sits in.
ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
MODELS = ROOT / "tests" / "models"


# ------------------------------------------------------------------------------ tolerance table
@dataclass(frozen=True)
class Tol:
    """An elementwise tolerance: ``|actual - expected| <= atol + rtol * |expected|``."""

    rtol: float
    atol: float


#: Elementwise closeness of two results computed in ``dtype``: ``torch.testing.assert_close``'s own
#: defaults for that dtype (PyTorch docs, ``torch.testing.assert_close``, the table of default
#: ``rtol``/``atol`` per dtype; ``torch/testing/_comparison.py``'s ``_DTYPE_PRECISIONS``, torch 2.13).
#: The rtol is about one rounding in ``dtype`` (bf16's unit round-off is 2^-9 = 2.0e-3, fp16's
#: 2^-11 = 4.9e-4, fp32's 2^-24 = 6.0e-8), with slack for a few operations.
CLOSE = {
    torch.float64: Tol(rtol=1e-7, atol=1e-7),
    torch.float32: Tol(rtol=1.3e-6, atol=1e-5),
    torch.bfloat16: Tol(rtol=1.6e-2, atol=1e-5),
    torch.float16: Tol(rtol=1e-3, atol=1e-5),
}

#: ``CLOSE``'s rtol alone, for relative quantities (a drift, a relative loss error) bounded by one
#: dtype's rounding, and for elementwise checks with a tighter atol of their own.
RTOL = {dtype: tol.rtol for dtype, tol in CLOSE.items()}

#: Drift of a run against FP32 eager on these tests' tiny models, as a relative error: the gradients'
#: ``autoprec.metrics.grad_rel_l2`` (‖g − g_ref‖ / ‖g_ref‖), the weights' relative L2 after training,
#: the losses' |l − l_ref| / |l_ref|; by the dtype the run computes or reduces in.
DRIFT = {
    # The same FP32 computation in another summation order (Inductor's kernels, compiled regions,
    # recomputation, the math attention kernel for the fused one, two ranks for one process):
    # fp32 round-off compounded over the graph. Measured 2.3e-7 (GPT-2, the compiled FP32 reference
    # against eager, tests/search/test_dropout_defaults.py); docs/architecture.md#regional-compilation
    # states the 1e-5 of the compiled-regions check.
    torch.float32: 1e-5,
    # bf16 instead of fp32 (a bf16 policy's matmuls, a bf16 gradient reduction): a few bf16
    # roundings (unit round-off 2^-9 = 2.0e-3), under CLOSE[bfloat16].rtol.
    torch.bfloat16: 1e-2,
}


if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # in case a plugin imported torch before this file


def pytest_collection_modifyitems(config, items):
    """Run the ``heavy`` tests first (a stable sort: the rest keep their order). pytest-xdist's
    worksteal scheduler splits the list between the two workers and each steals from the other's
    tail when idle, so the last tests to start are short ones and the workers finish together
    (longest-first list scheduling, Graham 1969), instead of one worker running a minute-long
    compile alone at the end. The markers are on the tests that took 15 s or more on a cold run."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def spy_fp32_gemms(monkeypatch, module) -> tuple[list, type]:
    """Replace ``module.Fp32ComputeGemms`` by a subclass that records every instance made, so a test
    sees how many passes ran under the mode and how many GEMMs each computed (``mode.count``).
    Returns ``(instances, the subclass)``."""
    from autoprec.kernels.fp32_gemms import Fp32ComputeGemms

    modes: list = []

    class Spy(Fp32ComputeGemms):
        def __init__(self, dtype):
            super().__init__(dtype)
            modes.append(self)

    monkeypatch.setattr(module, "Fp32ComputeGemms", Spy)
    return modes, Spy
