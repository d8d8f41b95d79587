"""The kernel probe (autoprec/search/probe.py) and the kernel choices of the search space:
the keep rule from (mocked) measurements both ways, the model's matmul shapes, kernel choices
-> policy rules, and one real probe at tiny shapes (structure only: speeds are device facts)."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from torch import nn

from autoprec.capture import capture
from autoprec.policy import Rule
from autoprec.search.probe import (
    KERNELS,
    kernel_fields,
    matmul_shape_counts,
    matmul_shapes,
    probe_kernels,
)
from autoprec.search.space import SearchSpace

CPU = torch.device("cpu")
SHAPES = [(1024, 512, 1376), (1024, 512, 512)]


def _timer(factors: dict[str, float], calls: list | None = None):
    """A mocked timer: fp32 takes M·K·N·1e-10 s, a kernel ``factors[kernel]`` times that."""
    def timer(kernel, shape, reps, stop_after_s):
        if calls is not None:
            calls.append((kernel, shape))
        f = factors.get(kernel, 1.0)
        if isinstance(f, Exception):
            raise f
        m, k, n = shape
        return [m * k * n * 1e-10 * f] * max(reps, 1)
    return timer


def test_avx2_like_device_searches_bf16_with_fp32_compute_only():
    """Native bf16 90x slower, bf16 stored and computed in fp32 1.02x: bf16 stays, kernel
    ``bf16:fp32`` only; fp16 (native 100x, fp32-compute 1.3x) goes, with the measured reason."""
    p = probe_kernels(CPU, SHAPES, fp8=False, timer=_timer(
        {"bf16": 90.0, "bf16:fp32": 1.02, "fp16": 100.0, "fp16:fp32": 1.3}))
    assert p.kept() == {"bf16": ["bf16:fp32"]}
    assert p.excluded() == {"fp16": "native 100x slower, fp32-compute 1.3x slower"}
    assert p.low_kernels() == ["bf16:fp32"] and p.low_dtypes() == ["bf16"]
    assert p.kernels["bf16"].ratio == pytest.approx(90.0) and not p.kernels["bf16"].kept
    space = SearchSpace(p.low_kernels())
    assert space.dtypes == ["fp32", "bf16:fp32"]
    base = dict(space.baselines())
    assert base["autocast-equivalent"]["matmul"] == "bf16:fp32"
    # bf16 storage but sensitive, fp32 compute: here that is already low-except-sensitive, not queued twice
    assert base["low-except-sensitive"]["follow"] == "bf16:fp32" and "low-storage fp32-compute" not in base


def test_native_bf16_device_puts_the_native_kernel_first():
    """Native 2.7x faster (AVX512-BF16, AMX, GPU): ``bf16`` native first, ``bf16:fp32`` also kept
    within noise (1.05x <= 1 + TOL); one just beyond noise (1.15x) is not."""
    p = probe_kernels(CPU, SHAPES, fp8=False, timer=_timer(
        {"bf16": 1 / 2.7, "bf16:fp32": 1.05, "fp16": 1 / 2.0, "fp16:fp32": 1.15}))
    assert p.kept() == {"bf16": ["bf16", "bf16:fp32"], "fp16": ["fp16"]}
    assert p.low_kernels() == ["bf16", "fp16", "bf16:fp32"]
    space = SearchSpace(p.low_kernels())
    assert space.dtypes == ["fp32", "bf16", "bf16:fp32", "fp16"]  # fixed order, not by speed
    base = dict(space.baselines())
    assert base["autocast-equivalent"]["matmul"] == "bf16"
    assert base["low-storage fp32-compute"] == {"matmul": "bf16:fp32", "sensitive": "fp32",
                                                "follow": "bf16:fp32"}


def test_all_slower_excludes_every_dtype_with_its_reason():
    p = probe_kernels(CPU, SHAPES, fp8=True, timer=_timer(
        {"bf16": 92.0, "bf16:fp32": 1.4, "fp16": 100.0, "fp16:fp32": 1.5, "fp8_e4m3": 3.0}))
    assert p.kept() == {} and p.low_kernels() == []
    assert p.excluded() == {"bf16": "native 92x slower, fp32-compute 1.4x slower",
                            "fp16": "native 100x slower, fp32-compute 1.5x slower",
                            "fp8_e4m3": "native 3x slower"}
    space = SearchSpace(p.low_kernels())
    assert space.dtypes == ["fp32"] and [n for n, _ in space.baselines()] == ["fp32"]


@pytest.mark.parametrize("factor, kept", [(0.8, True), (1.05, False)])
def test_fp8_is_kept_only_when_it_measures_faster(factor, kept):
    """fp8 stores fp32 (no memory saved), so within-noise is not enough: it must be faster. A
    bf16 kernel at the same 1.05x is kept (its storage halves the bytes)."""
    p = probe_kernels(CPU, SHAPES, fp8=True, timer=_timer({"bf16": 1.05, "fp8_e4m3": factor, "fp16": 9.0,
                                                           "bf16:fp32": 9.0, "fp16:fp32": 9.0}))
    assert p.kernels["fp8_e4m3"].kept is kept and p.kernels["bf16"].kept
    assert ("fp8_e4m3" in p.low_kernels()) is kept


def _noisy_timer(factors: dict[str, list[float]]):
    """fp32 takes 1 ms per call; a kernel's calls take ``factors[kernel]`` ms, one per repeat."""
    def timer(kernel, shape, reps, stop_after_s):
        return [1e-3 * f for f in factors.get(kernel, [1.0] * reps)]
    return timer


def test_a_kernel_near_the_line_is_decided_with_its_noise_band():
    """Synthetic repeats: fp16:fp32's median is 1.13x fp32 (over the 10% line), but its repeats
    reach 1.02x: its band's low end is within 1 + TOL, so it is kept (unsure: the search decides).
    bf16:fp32, whose every repeat is 1.25-1.35x, is out; the point rule alone would drop both."""
    from autoprec.search.probe import ratio_band

    reps = {"fp16:fp32": [1.02, 1.13, 1.20, 1.05, 1.16], "bf16:fp32": [1.25, 1.30, 1.35, 1.28, 1.32],
            "bf16": [90.0] * 5, "fp16": [100.0] * 5}
    p = probe_kernels(CPU, SHAPES[:1], fp8=False, timer=_noisy_timer(reps))
    near, far = p.kernels["fp16:fp32"], p.kernels["bf16:fp32"]
    assert near.ratio == pytest.approx(1.13) and near.band[0] <= 1.05 and near.band[1] >= 1.16 and near.kept
    assert far.band[0] > 1.1 and not far.kept
    assert p.kept() == {"fp16": ["fp16:fp32"]} and "kept: within its noise band" in p.describe("fp16")
    # the band itself: the median's bootstrap over the repeats, seeded, the fp32 runs resampled too
    lo, hi = ratio_band([[1.0, 1.1, 1.2]], [[[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]], [(8, 8, 8)], [1.0])
    assert (lo, hi) == (1.0, 1.2)
    assert ratio_band([[1.1] * 3], [[[1.0] * 3, [1.0] * 3]], [(8, 8, 8)], [1.0]) == (1.1, 1.1)
    assert ratio_band([[]], [[[1.0], [1.0]]], [(8, 8, 8)], [1.0]) == (math.inf, math.inf)


def test_fp8_is_not_probed_without_the_kernel_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "autoprec.kernels.fp8", None)  # import raises ImportError
    calls = []
    p = probe_kernels(CPU, SHAPES, timer=_timer({}, calls))
    assert "fp8_e4m3" not in p.kernels and all(k != "fp8_e4m3" for k, _ in calls)


def test_a_kernel_that_fails_is_excluded_with_the_error():
    p = probe_kernels(CPU, SHAPES, fp8=False,
                      timer=_timer({"fp16": RuntimeError("no fp16 gemm"), "fp16:fp32": 1.5}))
    assert p.excluded()["fp16"] == "native failed: RuntimeError: no fp16 gemm, fp32-compute 1.5x slower"
    assert math.isinf(p.kernels["fp16"].seconds)
    # --dtypes fp16: its native kernel whatever it measured, then its other kernels that ran
    assert p.low_kernels(["fp16"]) == ["fp16", "fp16:fp32"]


def test_forced_dtypes_search_the_native_kernel_first_then_every_other_that_ran():
    """Not only the kept ones: with --dtypes the choices must not depend on timing noise (workers
    forcing the same --dtypes share one study; test_two_workers_share_one_study)."""
    p = probe_kernels(CPU, SHAPES, fp8=False, timer=_timer(
        {"bf16": 90.0, "bf16:fp32": 1.02, "fp16": 100.0, "fp16:fp32": 1.3}))
    assert p.low_kernels(["bf16"]) == ["bf16", "bf16:fp32"]
    assert p.low_kernels(["fp16", "bf16"]) == ["bf16", "fp16", "bf16:fp32", "fp16:fp32"]


def test_time_is_the_weighted_sum_and_a_spent_budget_cuts_slow_kernels_short():
    """fp32's time is Σ count × median; with the wall-clock cap spent (budget 0) a kernel already
    too slow after the first shape is not timed on the rest, its time extrapolated by FLOPs."""
    calls = []
    p = probe_kernels(CPU, SHAPES, fp8=False, weights=[3, 5], budget_s=0.0,
                      timer=_timer({"bf16": 90.0, "bf16:fp32": 1.0, "fp16": 50.0, "fp16:fp32": 1.0}, calls))
    assert p.fp32_s == pytest.approx(sum(w * m * k * n * 1e-10 for w, (m, k, n) in zip([3, 5], SHAPES)))
    assert ("bf16", SHAPES[1]) not in calls and ("bf16:fp32", SHAPES[1]) in calls
    assert p.kernels["bf16"].estimated and p.kernels["bf16"].ratio == pytest.approx(90.0)
    assert not p.kernels["bf16:fp32"].estimated and p.kernels["bf16:fp32"].kept
    assert "~90x slower" in p.kernels["bf16"].describe()


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 16)
        self.w = nn.Parameter(torch.randn(16, 4))

    def forward(self, x):  # x [2, 3, 8]
        for layer in self.layers:
            x = layer(x)
        h = self.head(x)  # linear: (6, 8, 16)
        y = h @ self.w  # matmul [2, 3, 16] @ [16, 4]: (6, 16, 4)
        return torch.bmm(y, y.transpose(1, 2)).sum()  # bmm [2, 3, 4] @ [2, 4, 3]: (6, 4, 3)


def test_matmul_shapes_of_a_captured_model():
    gm = capture(_Tiny(), torch.randn(2, 3, 8))
    assert matmul_shape_counts(gm) == {(6, 8, 8): 2, (6, 8, 16): 1, (6, 16, 4): 1, (6, 4, 3): 1}
    # by total FLOPs (count x M·K·N): 2·384 and 768 (a tie: graph order), then 384, 72
    assert matmul_shapes(gm) == [(6, 8, 8), (6, 8, 16), (6, 16, 4), (6, 4, 3)]
    assert matmul_shapes(gm, top=2) == [(6, 8, 8), (6, 8, 16)]


def test_kernel_choices_become_rules():
    assert kernel_fields("bf16:fp32") == ("bf16", "fp32") and kernel_fields("bf16") == ("bf16", None)
    assert kernel_fields("fp8_e4m3") == ("fp8_e4m3", None)
    with pytest.raises(ValueError, match="unknown kernel choice 'bf8'"):
        kernel_fields("bf8")
    pol = SearchSpace.to_policy({"matmul": "bf16:fp32", "sensitive": "fp32", "follow": "bf16:fp32",
                                 "block:layers.0": "bf16", "block:layers.1": "inherit",
                                 "node:head/linear#0": "fp8_e4m3"})
    assert pol.default_dtype == "bf16"
    assert pol.rules == (
        Rule(op_class="matmul", dtype="bf16", compute="fp32"),
        Rule(op_class="sensitive", dtype="fp32"),
        Rule(op_class="follow", dtype="bf16", compute="fp32"),
        Rule(module="layers.0.*", op_class="matmul", dtype="bf16"),
        Rule(node="head/linear#0", dtype="fp8_e4m3"),
    )
    native = SearchSpace.to_policy({"matmul": "bf16", "sensitive": "fp32", "follow": "auto"})
    assert native.default_dtype == "bf16" and native.rules == (Rule(op_class="sensitive", dtype="fp32"),)
    fp8 = SearchSpace.to_policy({"matmul": "fp8_e4m3", "sensitive": "fp32", "follow": "auto"})
    assert fp8.default_dtype == "fp32" and fp8.rules[0] == Rule(op_class="matmul", dtype="fp8_e4m3")


def test_space_offers_fp8_to_matmuls_only():
    space = SearchSpace(["fp8_e4m3", "bf16:fp32"], blocks=["layers.0"])
    assert space.dtypes == ["fp32", "bf16:fp32", "fp8_e4m3"] and space.float_choices == ["fp32", "bf16:fp32"]
    base = dict(space.baselines())
    assert base["autocast-equivalent"]["matmul"] == "fp8_e4m3"
    assert base["all-low"]["sensitive"] == "bf16:fp32"  # the fastest low-storage kernel
    only_fp8 = SearchSpace(["fp8_e4m3"])
    assert [n for n, _ in only_fp8.baselines()] == ["fp32", "autocast-twin", "autocast-equivalent"]
    with pytest.raises(ValueError, match="unknown kernel choice"):
        SearchSpace(["bf16:fp16"])
    assert list(KERNELS) == ["bf16", "bf16:fp32", "fp16", "fp16:fp32", "fp8_e4m3"]


def test_real_probe_at_tiny_shapes_has_the_documented_structure():
    """Unmocked, fp8 off (speeds are device facts: only the structure is checked)."""
    p = probe_kernels(CPU, [(16, 32, 8), (8, 16, 16)], reps=2, budget_s=0.2, fp8=False, weights=[2, 1])
    d = p.to_dict()
    json.dumps(d, allow_nan=False)
    assert set(d) == {"shapes", "weights", "tol", "fp32", "kernels", "dtypes"}
    assert d["shapes"] == [[16, 32, 8], [8, 16, 16]]
    assert math.isfinite(d["fp32"]["ms"]) and d["fp32"]["ms"] > 0
    assert set(d["kernels"]) == {"bf16", "bf16:fp32", "fp16", "fp16:fp32"}
    for k, row in d["kernels"].items():
        assert row["error"] or (math.isfinite(row["ms"]) and row["ratio"] > 0), k
        assert set(row) == {"dtype", "ms", "ratio", "kept", "estimated", "per_shape_ms", "error", "band"}
        assert row["error"] or row["band"][0] <= row["ratio"] <= row["band"][1], k
    assert set(d["dtypes"]) == {"bf16", "fp16"}
    for dtype, v in d["dtypes"].items():
        assert bool(v["kept"]) != bool(v["reason"]), dtype  # kept kernels, or the reason why not


def test_joining_worker_adopts_the_studys_kernels(monkeypatch):
    """A worker whose probe (--dtypes auto) kept other kernels than the study was created with
    searches the study's (Optuna cannot change a parameter's choices), ordered by its own probe;
    with --dtypes forced it keeps its own space (check_study then refuses a mismatch)."""

    from autoprec.search.kernel_choice import KernelChoice, adopt_study_kernels
    from autoprec.search.space import SearchSpace

    probes = {"kernels": {"bf16": {"ms": 5.0}, "bf16:fp32": {"ms": 20.0}}}
    from autoprec.search import kernel_choice

    # the graph has attention; this run's space, as one whose probe kept no low kernel, has no choice of it
    monkeypatch.setattr(kernel_choice, "has_attention", lambda gm: True)
    own = KernelChoice(probes, SearchSpace(["bf16"], ["b.0"], ["head/linear#0"]), torch.float16)
    assert not own.space.attention
    run = adopt_study_kernels(own, None, CPU, ["fp32", "bf16", "bf16:fp32"], quiet=True)
    assert run.space.attention  # the study's space searched attention: a resume does too (a user's GPT-2)
    assert own.space.dtypes == ["fp32", "bf16"]  # frozen: a new choice, the probe's own unchanged
    assert run.space.dtypes == ["fp32", "bf16", "bf16:fp32"]
    assert run.space.low_kernels == ["bf16", "bf16:fp32"]
    assert run.space.blocks == ["b.0"] and run.space.nodes == ["head/linear#0"]
    assert run.ac_dtype == torch.bfloat16  # torch.autocast over the study's storage dtypes
    assert run.space.twin_dtype == "bf16" and run.space.twin()["matmul"] == "bf16"
    forced = KernelChoice(probes, SearchSpace(["bf16"]), torch.bfloat16, forced=["bf16"])
    assert adopt_study_kernels(forced, None, CPU, ["fp32", "bf16", "bf16:fp32"], quiet=True) is forced


def test_memory_lever_is_a_search_parameter_under_max_memory():
    from autoprec.search.space import SAVED_LEVERS, SearchSpace

    space = SearchSpace(["bf16"], ["b.0"], [], saved=SAVED_LEVERS)
    assert space.saved == ["none", "bf16", "fp8_e5m2"] and space.n_params == 5
    assert all(p["saved"] == "none" for _n, p in space.baselines())
    params = dict(space.baselines()[1][1], saved="fp8_e5m2")
    pol = space.to_policy(params)
    assert [(r.op_class, r.saved) for r in pol.rules if r.saved] == [
        ("matmul", "fp8_e5m2"), ("sensitive", "fp8_e5m2"), ("follow", "fp8_e5m2")]
    assert SearchSpace(["bf16"]).saved == [] and "saved" not in SearchSpace(["bf16"]).baselines()[0][1]


def test_fp8_is_not_probed_where_fp8_supported_says_no(monkeypatch):
    """fp8_supported returns (ok, reason); a False verdict must keep fp8 out of the probe (the
    tuple itself is truthy)."""
    import autoprec.kernels.fp8 as fp8
    from autoprec.search.probe import _fp8_available

    monkeypatch.setattr(fp8, "fp8_supported", lambda device: (False, "no fp8 kernel on this device"))
    assert _fp8_available(torch.device("cpu")) is False
    monkeypatch.setattr(fp8, "fp8_supported", lambda device: (True, "ok"))
    assert _fp8_available(torch.device("cpu")) is True


def test_baselines_compute_in_torch_autocasts_dtype():
    """On CUDA torch.autocast defaults to fp16 while bf16 kernels are as fast (an H200 probe:
    bf16 10.6 ms, fp16 10.8 ms): the twin and its neighbours take fp16, whose drift the budget is,
    not the marginally faster bf16 (~8x the drift, never feasible)."""
    from autoprec.search.space import SearchSpace

    lows = ["bf16", "fp16", "bf16:fp32", "fp16:fp32"]
    base = dict(SearchSpace(lows, twin_dtype="fp16").baselines())
    assert base["autocast-twin"]["matmul"] == "fp16"
    assert base["all-low"]["sensitive"] == "fp16" and base["low-except-sensitive"]["follow"] == "fp16"
    assert base["low-storage fp32-compute"]["matmul"] == "bf16:fp32"  # fastest fp32-compute, as before
    assert SearchSpace(["bf16", "fp16:fp32"], twin_dtype="fp16").twin()["matmul"] == "fp16:fp32"
    assert SearchSpace(lows).twin()["matmul"] == "bf16"  # no autocast dtype given: the fastest
    assert SearchSpace(["bf16"], twin_dtype="fp16").twin()["matmul"] == "bf16"  # fp16 not kept
    assert SearchSpace(["fp8_e4m3", "bf16"], twin_dtype="bf16").twin()["matmul"] == "bf16"


def test_autocast_dtype_follows_native_kernels_only():
    """torch.autocast runs native GEMMs: a kept fp32-compute kernel (1.0-1.4x fp32 on an AVX2-only
    CPU, kept or not from one probe to the next) must not switch the budget's torch.autocast from
    bf16 to fp16 (a user's GPT-2: budget 5.5e-3 in one run, 6.3e-4 in the next, same command)."""
    from autoprec.device import autocast_dtype
    from autoprec.search.kernel_choice import autocast_usable

    assert autocast_usable(["fp16:fp32"]) == []
    assert autocast_dtype(CPU, autocast_usable(["fp16:fp32"])) == torch.bfloat16
    assert autocast_dtype(CPU, autocast_usable(["bf16:fp32", "fp16:fp32"])) == torch.bfloat16
    assert autocast_usable(["fp16", "bf16:fp32", "fp8_e4m3"]) == ["fp16"]
    # bf16's native kernel left out, fp16's kept: torch.autocast in fp16
    assert autocast_dtype(CPU, autocast_usable(["fp16", "bf16:fp32"])) == torch.float16
    assert autocast_dtype(CPU, autocast_usable(["bf16", "fp16"])) == torch.bfloat16
    # --dtypes names the dtypes: the user's choice stands, whatever kernel of it is searched
    assert autocast_usable(["fp16", "fp16:fp32"], forced=["fp16"]) == ["fp16"]
    assert autocast_dtype(CPU, autocast_usable(["fp16:fp32"], forced=["fp16"])) == torch.float16
