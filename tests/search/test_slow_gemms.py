"""Where torch.autocast's native GEMMs are slow (an AVX2-only CPU: bf16 ~60-90x fp32), its drift is
measured with them computed in fp32 (the same roundings) and its speed natively, in one step; where
they alone exceed the slow-step limit it is not timed or compiled at all (autoprec/search/kernel_choice.py,
Harness.measure's ``fp32_gemms``, autoprec/search/autocast_baseline.py: its drift on batch 0, or not run)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from autoprec.measure import Harness
from autoprec.measure import harness as harness_mod
from autoprec.modelspec import load_model_spec
from autoprec.search.autocast_baseline import EMULATE_AT, AutocastBaseline, autocast_gemms_in_fp32
from autoprec.search.contest import Contest
from autoprec.search.drift_budget import DriftBudget
from autoprec.search.progress import Clock
from tests.conftest import MODELS, spy_fp32_gemms

#: torch.autocast(bf16) running natively (no emulation, it can win).
AC = AutocastBaseline(torch.bfloat16)


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
    modes, Spy = spy_fp32_gemms(monkeypatch, harness_mod)
    timed_in_mode: list[bool] = []
    real_time = Harness._time

    def spy_time(self, *a, **kw):
        timed_in_mode.append(isinstance(_get_current_dispatch_mode(), Spy))
        return real_time(self, *a, **kw)

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
    why = "native bf16 GEMMs measured 63.5x fp32's time, fp32-compute 1.08x"
    emulated = AutocastBaseline(torch.bfloat16, emulated=why)
    assert emulated.drift_on_batch_0(True, False, False) == f"drift on batch 0 only ({why})"
    assert emulated.drift_on_batch_0(True, True, False) is None  # timed (CUDA)
    assert emulated.drift_on_batch_0(True, False, True) is None  # random numbers
    assert emulated.drift_on_batch_0(False, False, False) is None  # not compiled
    assert AC.drift_on_batch_0(True, False, False) is None  # native GEMMs not slow


def test_a_bar_drifting_on_batch_0_only_is_judged_on_batch_0(monkeypatch):
    """torch.autocast + torch.compile cut after batch 0 is a bar only if its batch-0 drift is within
    the budget on batch 0 (auto rule, torch.autocast's [1e-3, 3e-3, 3e-3, 3e-3]): 1.1e-3 is 1.1x
    batch 0's, over the 2% margin, though under the 4-batch mean (2.5e-3); 1.0e-3 is a bar."""
    from autoprec.measure import Measurement, Timing
    from autoprec.policy import Policy
    from autoprec.search import contest as contest_mod

    speeds = {"twin": 0.060, "torch.autocast + torch.compile": 0.050, "fp32 eager": 0.100}
    monkeypatch.setattr(contest_mod, "time_interleaved", lambda h, configs, **kw: {
        c.name: Timing.from_steps([speeds[c.name] * (1 + 0.01 * i) for i in range(6)], 100.0, rounds=3)
        for c in configs})

    from autoprec.measure import Outcome
    from autoprec.search.gates import Candidate, Entry, Role

    monkeypatch.setattr(contest_mod, "compile_graph", lambda gm, budget=1.0, dynamic=None, **kw: gm)

    class H:
        random = False
        graph_module = model = object()
        device = torch.device("cpu")
        batches: list = []

        def measure(self, fn, scaler_factory=None, autocast_dtype=None, cut=None, **kw):
            m = Measurement(grad_rel_l2=self.bar_drift, grad_rel_l2_batches=[self.bar_drift])
            stop = cut(m)  # the baseline's own stop: after batch 0
            m.outcome = stop
            return m

    budget = DriftBudget.auto([1e-3, 3e-3, 3e-3, 3e-3])
    twin = Policy.autocast("bf16")

    def best_baseline(bar_drift: float) -> str:
        h = H()
        h.bar_drift = bar_drift
        emulated = AutocastBaseline(torch.bfloat16, emulated="slow")
        sel = Contest(h, budget, True, emulated, None, 0, Clock(), True)
        sel.measure_autocast()
        assert sel.autocast_compiled.outcome == Outcome.cut("drift on batch 0 only (slow)")
        twin_m = Measurement(grad_rel_l2=1e-3, grad_rel_l2_batches=[1e-3] + [3e-3] * 3)
        sel.race([Entry(Candidate("twin", Role.POLICY, twin), object(), twin_m)])
        return sel.decision.best_baseline.name

    assert best_baseline(1.1e-3) == "fp32 eager"
    assert best_baseline(1.0e-3) == "torch.autocast + torch.compile"


def test_autocast_cannot_win_when_its_native_gemms_alone_exceed_the_slow_step_limit():
    """The bound is fp32's GEMM ms times the low end of the native band: an AVX2-like probe (24-layer
    Qwen2: fp32 170 ms, native bf16 39.5-43.3x) is over a 1.70 s limit (6.7 s) and the reason gives
    the numbers; under a 10 s limit, with a fast native kernel (AMX-like 0.17x), a failed or unprobed
    kernel, or no fp32 time, it may win (None); fp16's autocast looks at fp16's kernel."""
    from autoprec.search.autocast_baseline import autocast_cannot_win

    probes = {**_probes((39.5, 43.3), (1.10, 1.27)), "fp32": {"ms": 170.0}}
    why = autocast_cannot_win(probes, torch.bfloat16, 1.70)
    assert why == ("its native bf16 GEMMs alone take 6.71 s or more per step (>= 39.5x fp32's 170 ms at "
                   "the model's forward shapes), over the 1.7 s slow-step limit")
    assert autocast_cannot_win(probes, torch.bfloat16, 10.0) is None
    assert autocast_cannot_win(probes, torch.bfloat16, 6.72) is None  # the low end, not the ratio (7.0 s)
    fast = {**_probes((0.17, 0.25), (1.0, 1.1)), "fp32": {"ms": 170.0}}
    assert autocast_cannot_win(fast, torch.bfloat16, 0.25) is None
    failed = {**_probes((39.5, 43.3), (1.0, 1.1), "no kernel"), "fp32": {"ms": 170.0}}
    assert autocast_cannot_win(failed, torch.bfloat16, 0.25) is None
    assert autocast_cannot_win({**_probes((None, None), (1.0, 1.1)), "fp32": {"ms": 170.0}},
                               torch.bfloat16, 0.25) is None
    assert autocast_cannot_win(_probes((39.5, 43.3), (1.1, 1.2)), torch.bfloat16, 0.25) is None  # no fp32
    assert autocast_cannot_win(probes, torch.float16, 0.25) is None
    assert autocast_cannot_win({}, torch.bfloat16, 0.25) is None


def test_a_bar_that_cannot_win_is_neither_compiled_nor_timed_and_its_row_says_why(monkeypatch):
    """With ``cannot_win`` the selector compiles and measures nothing for torch.autocast + torch.compile
    (a harness whose measure is called fails the test): its row has no speed, drift or peak and
    names the reason; the head-to-head times the finalists and fp32 eager only, and the policy
    file's measured block has no ``speedup_vs_autocast`` (no number to be against). On a graph that
    draws random numbers the bar is compiled and measured as before (its drift is the budget)."""
    from autoprec.measure import Measurement, Timing
    from autoprec.policy import Policy
    from autoprec.search import contest as contest_mod
    from autoprec.search import results
    from autoprec.search.gates import Candidate, Entry, Role
    from autoprec.search.report import format_table

    timed: list[list[str]] = []

    def interleaved(h, configs, **kw):
        timed.append([c.name for c in configs])
        return {c.name: Timing.from_steps([0.05 * (1 + 0.01 * i) for i in range(6)], 100.0, rounds=3)
                for c in configs}

    monkeypatch.setattr(contest_mod, "time_interleaved", interleaved)

    class H:
        random = False
        graph_module = model = object()
        device = torch.device("cpu")
        measured = 0

        def measure(self, *a, **kw):
            H.measured += 1
            return Measurement(grad_rel_l2=1e-3, grad_rel_l2_batches=[1e-3])

    why = "its native bf16 GEMMs alone take 6.71 s or more per step"
    cannot = AutocastBaseline(torch.bfloat16, emulated="slow", cannot_win=why)
    sel = Contest(H(), DriftBudget.fixed(1.0), True, cannot, None, 0, Clock(), True)
    monkeypatch.setattr(contest_mod, "compile_graph", lambda *a, **kw: pytest.fail("compiled torch.autocast"))
    sel.measure_autocast()
    assert H.measured == 0
    assert sel.autocast_compiled.note == f"not compiled: {why}"
    from autoprec.search import study as study_mod
    assert not study_mod._ok(sel.autocast_compiled)  # --max-memory auto: torch.autocast eager's peak then
    fp32 = Policy.fp32()
    m = Measurement(grad_rel_l2=0.0, grad_rel_l2_batches=[0.0] * 4)
    pol, chosen_m = sel.race([Entry(Candidate("fp32 + torch.compile", Role.BASELINE, fp32), object(), m)])
    assert timed == [["fp32 + torch.compile", "fp32 eager"]]

    class Run:
        ac_dtype, quiet = torch.bfloat16, True
        fp32 = Measurement(tokens_per_s=1000.0, step_times=[0.1] * 4)
        autocast = Measurement(grad_rel_l2=1e-3, grad_rel_l2_batches=[1e-3], note=f"not timed: {why}")
        budget = DriftBudget.fixed(1.0)

    block = results.measured_block(Run(), sel, pol, chosen_m, True)
    assert "speedup_vs_autocast" not in block and block["speedup_vs_baseline"] == pytest.approx(1.0)
    rows = results.side_by_side(Run(), sel, chosen_m, True)
    bar = next(r for r in rows if r["config"] == "autocast bf16 + compile")
    assert bar["not_run"] and "vs_autocast" not in rows[-1]
    assert "| vs autocast+compile (not timed) |" in format_table(rows).splitlines()[0]
    line = next(x for x in format_table(rows).splitlines() if x.startswith("| autocast bf16 + compile"))
    assert line == f"| autocast bf16 + compile | — | — |  | — | — | not compiled: {why} |"
    eager_line = next(x for x in format_table(rows).splitlines() if x.startswith("| autocast bf16 eager"))
    assert eager_line.startswith("| autocast bf16 eager | — | — |  | 1.00e-03 |")

    H.random = True
    H.batches = []
    sel = Contest(H(), DriftBudget.fixed(1.0), True, AutocastBaseline(torch.bfloat16, cannot_win=why), None,
                  0, Clock(), True)
    monkeypatch.setattr(contest_mod, "compile_graph", lambda gm, budget=1.0, dynamic=None, **kw: gm)
    sel.measure_autocast()
    assert H.measured == 1 and sel.autocast_compiled.note is None


def test_tune_where_autocast_cannot_win_times_no_native_step_and_writes_no_ratio_to_it(tmp_path, monkeypatch,
                                                                                       capsys):
    """End to end (tiny_mlp, no compile, a probe whose native bf16/fp16 GEMMs are 1e6x fp32's):
    torch.autocast's drift is measured with its GEMMs in fp32, no native step of it runs (one would
    take ~2000 s here), the log and its table row say why, the head-to-head leaves it out and the
    policy file holds no ratio to it."""
    from autoprec.search import kernel_choice
    from autoprec.search import study as study_mod
    from autoprec.search.probe import probe_kernels as real_probe
    from tests.conftest import EXAMPLES

    def timer(kernel, shape, reps, stop_after_s):
        m, k, n = shape
        return [m * k * n * 1e-10 * (1e6 if kernel in ("bf16", "fp16") else 1.0)] * max(reps, 1)

    monkeypatch.setattr(kernel_choice, "probe_kernels", lambda device, shapes=(), weights=None, **kw:
                        real_probe(device, shapes, weights=weights, fp8=False, timer=timer))
    native_steps = []
    real_time = Harness._time

    def spy_time(self, fn, scaler, autocast_dtype, max_step_s):  # timed steps: native ones
        native_steps.extend([autocast_dtype] if autocast_dtype is not None else [])
        return real_time(self, fn, scaler, autocast_dtype, max_step_s)

    monkeypatch.setattr(Harness, "_time", spy_time)
    res = study_mod.tune(EXAMPLES / "tiny_mlp.py", trials=3, compile=False, traj_steps=0,
                         out=tmp_path / "p.json", report=False, progress=False)
    log = capsys.readouterr().out
    assert "its speed is not timed: it cannot win" in log
    assert "torch.autocast eager: not timed, its native bf16 GEMMs alone take" in log
    assert "torch.autocast eager" not in log.split("final head-to-head, interleaved:")[1].splitlines()[0]
    row = next(r for r in res.table if r["config"] == "autocast bf16 eager")
    assert not row["tokens_per_s"] and row["grad_rel_l2"] > 1e-4
    assert "not timed: its native bf16" in row["error"]
    assert "speedup_vs_autocast" not in res.policy.measured and "speedup_vs_baseline" in res.policy.measured
    assert not native_steps
