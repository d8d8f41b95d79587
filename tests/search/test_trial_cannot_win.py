"""A search trial whose native low-precision GEMMs alone are over the slow-step limit, by the kernel
probe's bound, is not run (``autoprec.search.kernel_choice.trial_cannot_win``; its first drift pass
would trip the limit the screening cut applies from batch 0), and the sensitivity of a slow native
kernel is measured with its GEMMs as fp32 products rounded to it (``sensitivity_gemms``)."""

from __future__ import annotations

import optuna
import pytest
import torch
from torch import nn

from autoprec.capture import capture
from autoprec.passes import lowering_passes
from autoprec.policy import Policy, Rule
from autoprec.search import attrs
from autoprec.search.gemms import native_low_counts
from autoprec.search.kernel_choice import native_gemm_floor_s, trial_cannot_win

#: bf16 storage, fp32 compute for every matmul (the search's "bf16:fp32" kernel).
FP32_COMPUTE = Policy(default_dtype="bf16", rules=(Rule(op_class="matmul", dtype="bf16", compute="fp32"),
                                                   Rule(op_class="sensitive", dtype="fp32")))


def _assigned(gm, policy):
    return lowering_passes(gm, policy)[:1](gm, code=False).graph_module  # what a trial fingerprints


@pytest.fixture(scope="module")
def mlp_graph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    return capture(model, torch.randn(4, 16))


def test_native_low_counts_are_the_gemms_computed_natively_in_a_low_dtype(mlp_graph):
    assert native_low_counts(_assigned(mlp_graph, Policy.default("bf16"))) == {
        "bf16": {(4, 16, 32): 1, (4, 32, 8): 1}}
    assert native_low_counts(_assigned(mlp_graph, Policy.default("fp16"))) == {
        "fp16": {(4, 16, 32): 1, (4, 32, 8): 1}}
    assert native_low_counts(_assigned(mlp_graph, FP32_COMPUTE)) == {}
    assert native_low_counts(_assigned(mlp_graph, Policy.fp32())) == {}


def _probes(band=(40.0, 45.0), error=""):
    """A ``KernelProbe.to_dict()``: fp32 1.0 and 0.5 ms at the graph's two shapes, native bf16 ``band``."""
    return {"shapes": [[4, 16, 32], [4, 32, 8]], "weights": [1, 1],
            "fp32": {"ms": 1.5, "per_shape_ms": [1.0, 0.5]},
            "kernels": {"bf16": {"ratio": sum(band) / 2, "band": list(band), "error": error}}}


def test_the_floor_is_fp32s_time_per_shape_times_the_low_end_of_the_native_band(mlp_graph):
    """Σ count × fp32 ms × band low: (2 × 1.0 + 1 × 0.5) × 40 = 100 ms; a shape the probe did not
    time counts 0 (a bound), a failed or unprobed kernel too."""
    counts = {"bf16": {(4, 16, 32): 2, (4, 32, 8): 1, (9, 9, 9): 5}}
    assert native_gemm_floor_s(_probes(), counts) == pytest.approx(0.100)
    assert native_gemm_floor_s(_probes(error="no kernel"), counts) == 0.0
    assert native_gemm_floor_s(_probes(), {"fp16": {(4, 16, 32): 3}}) == 0.0
    gm = _assigned(mlp_graph, Policy.default("bf16"))  # 1.5 ms x 40 = 60 ms
    assert trial_cannot_win(_probes(), gm, 0.05) == (
        "its 2 native bf16 GEMMs alone take 0.06 s or more per step (the kernel probe's bound), over "
        "the 0.05 s slow-step limit")
    assert trial_cannot_win(_probes(), gm, 0.07) is None
    assert trial_cannot_win(_probes(band=(0.2, 0.3)), gm, 0.05) is None  # a fast native kernel
    assert trial_cannot_win(_probes(), _assigned(mlp_graph, FP32_COMPUTE), 1e-9) is None


def test_tune_runs_no_trial_whose_native_gemms_cannot_win(tmp_path, monkeypatch, capsys):
    """End to end (tiny_mlp, ``--dtypes bf16``, a probe whose native bf16 GEMMs are 1e6x fp32's):
    every trial whose assigned graph has a native bf16 GEMM is recorded cut and "not run", with no
    drift batch and no peak; every other trial ran its drift passes; the sensitivity computed its
    GEMMs in fp32 (said in the log); the tune still chooses a policy."""
    from autoprec.capture import capture as cap
    from autoprec.modelspec import load_model_spec
    from autoprec.search import kernel_choice
    from autoprec.search import study as study_mod
    from autoprec.search.probe import probe_kernels as real_probe
    from tests.conftest import EXAMPLES

    def timer(kernel, shape, reps, stop_after_s):
        m, k, n = shape
        return [m * k * n * 1e-10 * (1e6 if kernel == "bf16" else 1.0)] * max(reps, 1)

    monkeypatch.setattr(kernel_choice, "probe_kernels", lambda device, shapes=(), weights=None, **kw:
                        real_probe(device, shapes, weights=weights, fp8=False, timer=timer))
    res = study_mod.tune(EXAMPLES / "tiny_mlp.py", trials=6, compile=False, traj_steps=0, dtypes="bf16",
                         out=tmp_path / "p.json", report=False, progress=False)
    log = capsys.readouterr().out
    assert "sensitivity: bf16 GEMMs computed as fp32 products rounded once to bf16" in log
    spec = load_model_spec(EXAMPLES / "tiny_mlp.py")
    gm = cap(spec.build_model().train(), spec.get_batch(0, torch.device("cpu")))
    done = res.study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    not_run = [t for t in done if "not run" in (t.user_attrs.get(attrs.CUT) or "")]
    assert not_run and len(not_run) < len(done)
    line = next(x for x in log.splitlines() if "screening cut:" in x)
    assert f"(not run: {len(not_run)}" in line, line
    for t in done:
        native = native_low_counts(_assigned(gm, Policy.from_dict(t.user_attrs[attrs.POLICY])))
        assert bool(native) == (t in not_run), t.number
        if t in not_run:
            assert "native bf16 GEMMs alone take" in t.user_attrs[attrs.CUT]
            assert not t.user_attrs[attrs.GRAD_REL_L2_BATCHES] and t.user_attrs[attrs.PEAK_BYTES] is None
            assert t.values[0] == 0.0 and t.values[1] == float("inf")
        else:
            assert t.user_attrs[attrs.GRAD_REL_L2_BATCHES]
    assert res.policy is not None


def test_sensitivity_with_gemms_in_fp32_ranks_as_the_native_kernel_does(monkeypatch):
    """micro_lm, native bf16: each region's sensitivity with its bf16 GEMMs as fp32 products rounded
    to bf16 (the mode counts them) is the native one within 5% (only the summation order differs),
    so the ranking holds."""
    from autoprec.measure import Harness
    from autoprec.modelspec import load_model_spec
    from autoprec.search import trials
    from autoprec.search.space import SearchSpace, find_blocks, outside_matmuls
    from autoprec.search.trials import region_sensitivity
    from tests.conftest import MODELS, spy_fp32_gemms

    modes, _ = spy_fp32_gemms(monkeypatch, trials)

    h = Harness(load_model_spec(MODELS / "micro_lm.py"), torch.device("cpu"), warmup=1, steps=2)
    blocks = find_blocks(h.graph_module)
    space = SearchSpace(["bf16"], blocks, outside_matmuls(h.graph_module, blocks))
    native = region_sensitivity(h, space)
    assert not modes
    emulated = region_sensitivity(h, space, fp32_gemms=torch.bfloat16)
    assert len(modes) == len(native) and all(m.count > 0 for m in modes)
    assert native.keys() == emulated.keys() and len(native) >= 2
    for region, g in native.items():
        assert emulated[region] == pytest.approx(g, rel=0.05), region
    assert sorted(native, key=native.get) == sorted(emulated, key=emulated.get)
