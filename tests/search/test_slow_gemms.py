"""Where torch.autocast's native GEMMs are slow (an AVX2-only CPU: bf16 ~60-90x fp32), its drift is
measured with them computed in fp32 (the same roundings) and its speed natively, in one step
(autoprec/search/kernel_choice.py, Harness.measure's ``fp32_gemms``, Selector's bar on batch 0)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from autoprec.kernels import fp32_gemms
from autoprec.measure import Harness
from autoprec.measure import harness as harness_mod
from autoprec.modelspec import load_model_spec
from autoprec.search.decide import DriftBudget
from autoprec.search.kernel_choice import EMULATE_AT, autocast_gemms_in_fp32
from autoprec.search.progress import Clock
from autoprec.search.select import Selector
from tests.conftest import MODELS


def _probes(native_band, fp32c_band, native_error=""):
    """A ``KernelProbe.to_dict()`` of bf16's two kernels (ratios to fp32's time, with their bands)."""
    kernel = lambda band, err="": {"ratio": band[0] and (band[0] + band[1]) / 2, "band": list(band),  # noqa: E731
                                   "kept": False, "error": err}
    return {"kernels": {"bf16": kernel(native_band, native_error), "bf16:fp32": kernel(fp32c_band)}}


def test_the_probe_decides_from_the_bands_alone():
    """An AVX2-like probe (native 62-65x, fp32-compute 1.03-1.13x) emulates, and says so with the
    measured ratios; AVX512-BF16/AMX-like (native faster), a native band reaching below
    ``EMULATE_AT`` times the other's top, a failed kernel or no band run natively (None); fp16's
    autocast looks at fp16's kernels, which this probe lacks."""
    why = autocast_gemms_in_fp32(_probes((62.4, 64.6), (1.03, 1.13)), torch.bfloat16)
    assert why == "native bf16 GEMMs measured 63.5x fp32's time, fp32-compute 1.08x"
    assert autocast_gemms_in_fp32(_probes((0.17, 0.25), (1.0, 1.1)), torch.bfloat16) is None
    assert autocast_gemms_in_fp32(_probes((EMULATE_AT * 1.1 - 0.01, 9.0), (1.0, 1.1)), torch.bfloat16) is None
    assert autocast_gemms_in_fp32(_probes((EMULATE_AT * 1.1, 9.0), (1.0, 1.1)), torch.bfloat16) is not None
    assert autocast_gemms_in_fp32(_probes((62.4, 64.6), (1.0, 1.1), "no kernel"), torch.bfloat16) is None
    assert autocast_gemms_in_fp32(_probes((None, None), (1.0, 1.1)), torch.bfloat16) is None
    assert autocast_gemms_in_fp32(_probes((62.4, 64.6), (1.03, 1.13)), torch.float16) is None
    assert autocast_gemms_in_fp32({}, torch.bfloat16) is None


@pytest.fixture(scope="module")
def harness():
    return Harness(load_model_spec(MODELS / "micro_lm.py"), torch.device("cpu"), warmup=1, steps=2)


def test_autocast_drift_under_fp32_gemms_is_its_drift_and_its_speed_is_timed_natively(harness, monkeypatch):
    """``measure(..., fp32_gemms=True)``: the drift passes run under Fp32ComputeGemms (GEMMs counted)
    and give native torch.autocast's drift within 2%; the steps are then timed by ``_time`` outside
    the mode (a screened eager measurement would take them from the passes instead)."""
    modes: list[fp32_gemms.Fp32ComputeGemms] = []

    class Spy(fp32_gemms.Fp32ComputeGemms):
        def __init__(self, dtype):
            super().__init__(dtype)
            modes.append(self)

    timed_in_mode: list[bool] = []
    real_time = Harness._time

    def spy_time(self, *a, **kw):
        timed_in_mode.append(isinstance(_get_current_dispatch_mode(), Spy))
        return real_time(self, *a, **kw)

    monkeypatch.setattr(harness_mod, "Fp32ComputeGemms", Spy)
    monkeypatch.setattr(Harness, "_time", spy_time)
    bf16 = torch.bfloat16
    native = harness.measure(harness.model, autocast_dtype=bf16, screen=True)
    assert not modes and not timed_in_mode  # screened: timed from its drift passes
    emulated = harness.measure(harness.model, autocast_dtype=bf16, screen=True, fp32_gemms=True)
    assert len(modes) == harness.drift_batches and all(m.count > 0 for m in modes)
    assert timed_in_mode == [False] and emulated.step_times and emulated.tokens_per_s > 0
    assert emulated.error is None and 1e-5 < native.grad_rel_l2
    assert emulated.grad_rel_l2 == pytest.approx(native.grad_rel_l2, rel=0.02)
    assert emulated.peak_bytes == native.peak_bytes  # what autograd saves is the same bf16 tensors


def test_the_compiled_bar_stops_after_batch_0_only_where_that_loses_nothing():
    """With slow native GEMMs, torch.autocast + torch.compile's drift runs on batch 0 only (the
    reason names the probe's numbers), except without compile, when its timed steps would be
    skipped (CUDA) and on a graph that draws random numbers (its full drift is the compiled
    budget there)."""

    class H:
        random = False
        graph_module = model = object()

    why = "native bf16 GEMMs measured 63.5x fp32's time, fp32-compute 1.08x"
    sel = Selector(H(), DriftBudget.fixed(1.0), True, torch.bfloat16, None, 0, Clock(), True, slow_gemms=why)
    assert sel._bar_on_batch_0(timed=False) == f"drift on batch 0 only ({why})"
    assert sel._bar_on_batch_0(timed=True) is None
    H.random = True
    assert sel._bar_on_batch_0(timed=False) is None
    H.random = False
    assert Selector(H(), DriftBudget.fixed(1.0), False, torch.bfloat16, None, 0, Clock(), True,
                    slow_gemms=why)._bar_on_batch_0(timed=False) is None
    assert Selector(H(), DriftBudget.fixed(1.0), True, torch.bfloat16, None, 0, Clock(),
                    True)._bar_on_batch_0(timed=False) is None


def test_a_bar_drifting_on_batch_0_only_is_judged_on_batch_0(monkeypatch):
    """torch.autocast + torch.compile cut after batch 0 is a bar only if its batch-0 drift is within
    the budget on batch 0 (auto rule, torch.autocast's [1e-3, 3e-3, 3e-3, 3e-3]): 1.1e-3 is 1.1x
    batch 0's, over the 2% margin, though under the 4-batch mean (2.5e-3); 1.0e-3 is a bar."""
    from autoprec.measure import Measurement, Timing
    from autoprec.policy import Policy
    from autoprec.search import select as select_mod

    speeds = {"twin": 0.060, "torch.autocast + torch.compile": 0.050, "fp32 eager": 0.100}
    monkeypatch.setattr(select_mod, "time_interleaved", lambda h, configs, **kw: {
        c.name: Timing.from_steps([speeds[c.name] * (1 + 0.01 * i) for i in range(6)], 100.0, rounds=3)
        for c in configs})

    class H:
        random = False
        graph_module = model = object()

    budget = DriftBudget.auto([1e-3, 3e-3, 3e-3, 3e-3])
    twin = Policy.autocast("bf16")

    def best_baseline(bar_drift: float) -> str:
        sel = Selector(H(), budget, True, torch.bfloat16, None, 0, Clock(), True, slow_gemms="slow")
        sel._autocast_fn = object()
        sel.autocast_compiled = Measurement(grad_rel_l2=bar_drift, grad_rel_l2_batches=[bar_drift],
                                            cut="drift on batch 0 only (slow)")
        sel._head_to_head([("twin", twin, object(), Measurement(grad_rel_l2=1e-3,
                                                                grad_rel_l2_batches=[1e-3] + [3e-3] * 3))])
        return sel.decision.best_baseline.name

    assert best_baseline(1.1e-3) == "fp32 eager"
    assert best_baseline(1.0e-3) == "torch.autocast + torch.compile"
