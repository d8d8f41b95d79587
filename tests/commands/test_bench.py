"""``autoprec bench``: JSON schema, ratio consistency, drift of fp32/low configs, MFU range."""

from __future__ import annotations

import json

import pytest
import torch

from autoprec.cli import main
from autoprec.commands.bench import CONFIGS, format_bench_table, run_bench
from autoprec.commands.bench_mfu import matmul_peak_flops, model_flops
from autoprec.policy import Policy
from tests.conftest import EXAMPLES

TINY = str(EXAMPLES / "tiny_mlp.py")
EAGER = ["fp32_eager", "autocast_eager", "pure_low_eager", "policy_eager"]
ROW_KEYS = {"step_s", "tokens_per_s", "grad_rel_l2", "peak_bytes", "mfu", "ratio_vs_fp32_eager",
            "ratio_vs_autocast_compiled", "steps_timed", "dtype", "compiled", "note", "error",
            "tokens_per_s_band", "step_s_band", "iqr_s", "rel_half_width", "rounds", "vs_autocast_compiled"}


@pytest.fixture(scope="module")
def result():
    return run_bench(TINY, Policy.fp32(), steps=2, warmup=1, device="cpu", configs=EAGER, quiet=True)


def test_schema(result):
    assert {"device", "torch", "date", "configs", "flops", "matmul_peak", "tokens_per_batch",
            "timing"} <= set(result)
    assert result["timing"]["interleaved"] and result["timing"]["max_step_s"] >= 1.0
    assert list(result["configs"]) == EAGER
    for row in result["configs"].values():
        assert ROW_KEYS <= set(row)
    json.dumps(result, allow_nan=False)  # no inf/NaN leaks into the JSON


def test_ratios_consistent(result):
    rows = result["configs"]
    assert rows["fp32_eager"]["ratio_vs_fp32_eager"] == pytest.approx(1.0)
    for r in rows.values():
        assert r["error"] is None
        assert r["ratio_vs_fp32_eager"] == pytest.approx(
            r["tokens_per_s"] / rows["fp32_eager"]["tokens_per_s"])
        assert r["tokens_per_s"] == pytest.approx(result["tokens_per_batch"] / r["step_s"])
        assert r["ratio_vs_autocast_compiled"] is None  # autocast_compiled not run


def test_drift(result):
    rows = result["configs"]
    assert rows["fp32_eager"]["grad_rel_l2"] == pytest.approx(0.0, abs=1e-6)
    assert rows["policy_eager"]["grad_rel_l2"] == pytest.approx(0.0, abs=1e-5)  # fp32 policy, lowered graph
    assert rows["pure_low_eager"]["grad_rel_l2"] > 1e-4
    assert rows["autocast_eager"]["grad_rel_l2"] > 1e-4
    # pure low precision keeps no fp32 master weights: less state than fp32
    assert rows["pure_low_eager"]["peak_bytes"] < rows["fp32_eager"]["peak_bytes"]


def test_mfu_in_range(result):
    for r in result["configs"].values():
        assert 0.0 < r["mfu"] <= 1.0
    assert result["matmul_peak"]["dtype"] == "fp32"


def test_table_lists_every_config(result):
    table = format_bench_table(result)
    for name in EAGER:
        assert f"| {name} |" in table
        r = result["configs"][name]
        band = (f"±{100 * r['rel_half_width']:.1f}%" if r["steps_timed"] > 1  # the noise band
                else "(1 step: no band)")  # a row timed on one step (timed after the rounds, slow)
        assert f"| {r['tokens_per_s']:.0f} {band} |" in table


def test_rows_are_timed_interleaved_with_a_band(result):
    """Every row's tokens/s comes from the same interleaved rounds (issues 18, 19) and has a band,
    except the rows of a dtype this CPU emulates (``timing.timed_after``: one step after them)."""
    rows, after = result["configs"], result["timing"]["timed_after"]
    rounds = {r["rounds"] for n, r in rows.items() if n not in after}
    assert len(rounds) == 1 and rounds.pop() >= 3  # steps=2: the minimum of 3 rounds of 2 steps
    for n, r in rows.items():
        lo, hi = r["tokens_per_s_band"]
        assert lo <= r["tokens_per_s"] <= hi
        assert r["step_s_band"][0] <= r["step_s"] <= r["step_s_band"][1]
        assert r["steps_timed"] == (1 if n in after else 2 * r["rounds"])
        assert r["vs_autocast_compiled"] is None


def test_vs_autocast_compiled_says_tie_within_the_noise():
    """The ``vs autocast+compile`` column: the ratio, and "(tie)" after it within the noise."""
    from autoprec.commands.bench_table import add_ratios, make_row
    from autoprec.measure import Measurement, Timing

    base = [0.10, 0.11, 0.09, 0.10, 0.12, 0.10, 0.095, 0.105]
    timings = {"fp32_eager": Timing.from_steps([3 * t for t in base], 256.0),
               "autocast_compiled": Timing.from_steps(base, 256.0),
               "policy_eager": Timing.from_steps([t * 1.01 for t in base], 256.0),
               "policy_compiled": Timing.from_steps([t / 2 for t in base], 256.0)}
    rows = {n: make_row(Measurement(grad_rel_l2=0.0, loss_rel=0.0), "bf16", False, t, 1.0, 1.0)
            for n, t in timings.items()}
    add_ratios(rows, timings)
    assert rows["policy_eager"]["vs_autocast_compiled"]["tie"]
    assert rows["policy_compiled"]["vs_autocast_compiled"]["winner"] == "row"
    assert rows["fp32_eager"]["vs_autocast_compiled"]["winner"] == "autocast_compiled"
    result = {"configs": rows, "device": "cpu", "torch": "x", "date": "d", "tokens_per_batch": 256.0,
              "flops": {"flops_per_step": 1.0}, "matmul_peak": {"dtype": "bf16", "flops_per_s": 1.0}}
    table = format_bench_table(result)
    line = {n: next(x for x in table.splitlines() if x.startswith(f"| {n} |")) for n in rows}
    assert line["policy_eager"].split(" | ")[5].endswith(" (tie)")
    assert line["policy_compiled"].split(" | ")[5] == "2.00"
    assert line["autocast_compiled"].split(" | ")[5] == "1.00"
    assert line["fp32_eager"].split(" | ")[5] == "0.33"


def test_model_flops_counts_attention():
    import sys

    sys.path.insert(0, str(EXAMPLES))
    import qwen2_05b

    model = qwen2_05b.build_model()  # 0.5B shape: read from model.config
    batch = {"input_ids": torch.zeros(2, 16, dtype=torch.long)}
    f = model_flops(model, batch, tokens=32)
    assert (f["layers"], f["hidden"], f["seq"]) == (24, 896, 16)
    assert f["params_embedding"] == 256 * 896
    assert f["flops_per_step"] == 6 * f["params_matmul"] * 32 + 12 * 24 * 16 * 896 * 32


def test_matmul_peak_positive():
    flops, n = matmul_peak_flops(torch.float32, torch.device("cpu"), max_n=512)
    assert flops > 0 and n == 512


def test_cli_bench_writes_json(tmp_path, capsys):
    pol = tmp_path / "p.json"
    Policy.fp32().save(pol)
    out = tmp_path / "bench.json"
    code = main(["bench", TINY, "--policy", str(pol), "--steps", "1", "--warmup", "0", "--device", "cpu",
                 "--configs", "fp32_eager", "policy_eager", "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert set(data["configs"]) == {"fp32_eager", "policy_eager"}
    assert "| policy_eager |" in capsys.readouterr().out


def test_cli_bench_unknown_config(tmp_path, capsys):
    pol = tmp_path / "p.json"
    Policy.fp32().save(pol)
    assert main(["bench", TINY, "--policy", str(pol), "--configs", "nope"]) == 2
    assert "nope" in capsys.readouterr().err


@pytest.mark.slow
def test_all_configs_including_compiled():
    res = run_bench(TINY, Policy.default("bf16"), steps=2, warmup=1, device="cpu", quiet=True)
    assert list(res["configs"]) == list(CONFIGS)
    rows = res["configs"]
    assert rows["autocast_compiled"]["ratio_vs_autocast_compiled"] == pytest.approx(1.0)
    assert all(r["error"] is None for r in rows.values())


# ------------------------------------------------------------------------------------- issue 11


def test_bench_json_is_written_atomically(tmp_path, monkeypatch):
    """bench.json goes through the package's atomic writer: a failed write leaves the old file
    whole, no temporary file behind, and the file's permission bits kept."""
    import math
    import os

    from autoprec.commands.bench import write_bench_json

    out = tmp_path / "bench.json"
    write_bench_json({"configs": {"a": 1}}, out)
    old = out.read_bytes()
    with pytest.raises(TypeError):
        write_bench_json({"configs": {"a": object()}}, out)  # not JSON: fails before anything is written
    assert out.read_bytes() == old and [p.name for p in tmp_path.iterdir()] == ["bench.json"]

    def boom(*a, **k):
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk on fire"):
        write_bench_json({"configs": {"a": 2}}, out)
    monkeypatch.undo()
    assert out.read_bytes() == old and [p.name for p in tmp_path.iterdir()] == ["bench.json"]
    out.chmod(0o600)
    write_bench_json({"configs": {"a": math.inf}}, out)
    assert out.stat().st_mode & 0o777 == 0o600


def test_bench_json_non_finite_rule_is_the_packages(tmp_path):
    """One rule for non-finite numbers in every JSON file autoprec writes (autoprec._io.json_safe):
    bench.json used to write null where the monitor and --compare write "inf"/"nan"."""
    import math

    from autoprec import _io
    from autoprec.commands import compare
    from autoprec.commands.bench import write_bench_json
    from autoprec.training import monitor

    assert monitor.json_safe is _io.json_safe and compare.json_safe is _io.json_safe
    out = tmp_path / "bench.json"
    data = {"x": math.inf, "y": [-math.inf, math.nan, 1.5], "z": None}
    write_bench_json(data, out)
    assert json.loads(out.read_text()) == _io.json_safe(data) == {"x": "inf", "y": ["-inf", "nan", 1.5],
                                                                  "z": None}


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
def test_bench_autocast_dtype_is_the_packages_rule(monkeypatch, low):
    """bench's autocast (and pure-low) baseline dtype is autoprec.device.autocast_dtype, the rule tune
    and --compare use (it used to pick bf16 on its own, whatever torch's autocast default)."""
    import autoprec.commands.bench_mfu as mfu
    from autoprec.device import autocast_dtype
    from autoprec.dtypes import NAMES

    real = torch.get_autocast_dtype
    monkeypatch.setattr(torch, "get_autocast_dtype", lambda t: low if t == "cpu" else real(t))
    monkeypatch.setattr(mfu, "matmul_peak_flops", lambda dtype, device, **k: (1e9, 512))
    res = run_bench(TINY, Policy.fp32(), steps=1, warmup=0, device="cpu", configs=["autocast_eager"],
                    quiet=True)
    assert res["low_dtype"] == NAMES[autocast_dtype(torch.device("cpu"))] == NAMES[low]
    assert res["configs"]["autocast_eager"]["dtype"] == NAMES[low]
    assert res["configs"]["autocast_eager"]["error"] is None


def test_an_error_from_the_harness_is_reported_as_is():
    """A measurement's ``error`` is the row's error as it is, even one that begins with "too slow":
    only the slow-step rule (``Timing.too_slow``, the test below) marks a row capped."""
    from autoprec.commands.bench_table import make_row
    from autoprec.measure import Measurement, Outcome

    failed = Measurement(outcome=Outcome.failed("too slow: 3 s"))
    row = make_row(failed, "fp32", False, None, flops=1.0, peak=1.0, ratio=10.0)
    assert row["error"] == "too slow: 3 s" and row["capped"] is False and row["note"] is None


def test_a_config_the_slow_step_rule_stops_is_capped():
    from autoprec.commands.bench_table import make_row
    from autoprec.measure import Measurement, Timing, TimingEnd

    t = Timing.from_steps([2.5], 100.0)
    t.end, t.note = TimingEnd.TOO_SLOW, "timing stopped: 2 steps in a row took over the 1.00 s limit"
    row = make_row(Measurement(grad_rel_l2=0.0, loss_rel=0.0), "bf16", False, t, flops=1.0, peak=1.0,
                   ratio=10.0)
    assert row["capped"] and "10x fp32 eager's step" in row["note"] and row["steps_timed"] == 1


def test_configs_whose_dtype_is_too_slow_are_timed_after_the_rounds(monkeypatch):
    """On a CPU that emulates the low dtype (matmul peak over ``max_step_ratio`` x below fp32's), its
    rows are timed after the interleaved rounds, one step each: they can no longer use up the time
    cap before the first round (a fresh AVX2 user's default bench timed no row at all). fp32's rows
    get their rounds; the slow row its one step and a note that says why."""
    import autoprec.commands.bench_mfu as mfu
    from autoprec.device import autocast_dtype
    from autoprec.dtypes import NAMES

    low = NAMES[autocast_dtype(torch.device("cpu"))]
    monkeypatch.setattr(mfu, "matmul_peak_flops",
                        lambda dtype, device, **k: (1e12 if dtype == torch.float32 else 1e10, 512))
    res = run_bench(TINY, Policy.fp32(), steps=2, warmup=1, device="cpu",
                    configs=["fp32_eager", "autocast_eager", "policy_eager"], quiet=True)
    rows, tm = res["configs"], res["timing"]
    assert tm["timed_after"] == ["autocast_eager"] and rows["autocast_eager"]["dtype"] == low
    assert rows["autocast_eager"]["steps_timed"] == 1 and rows["autocast_eager"]["rounds"] == 1
    assert rows["autocast_eager"]["note"].startswith(
        f"timed after the interleaved rounds, one step: {low} matmul measured 100x slower than fp32")
    for name in ("fp32_eager", "policy_eager"):
        assert rows[name]["rounds"] >= tm["min_rounds"] and rows[name]["tokens_per_s"] > 0
        assert rows[name]["note"] is None


def test_skip_slow_skips_the_emulated_baselines_with_the_measured_factor(monkeypatch):
    """``--skip-slow``: the low-dtype baselines of a dtype over ``max_step_ratio`` x slower get a
    skipped row naming the measured factor (the reason :func:`_too_slow` gives), the rest run."""
    import autoprec.commands.bench_mfu as mfu
    from autoprec.device import autocast_dtype
    from autoprec.dtypes import NAMES

    low = NAMES[autocast_dtype(torch.device("cpu"))]
    monkeypatch.setattr(mfu, "matmul_peak_flops",
                        lambda dtype, device, **k: (1e12 if dtype == torch.float32 else 1e10, 512))
    res = run_bench(TINY, Policy.fp32(), steps=2, warmup=1, device="cpu", skip_slow=True,
                    configs=["fp32_eager", "autocast_eager", "pure_low_eager", "policy_eager"], quiet=True)
    rows = res["configs"]
    for name in ("autocast_eager", "pure_low_eager"):
        assert rows[name]["note"] == f"skipped: {low} matmul measured 100x slower than fp32 here"
        assert not rows[name]["tokens_per_s"]  # not run
    assert rows["policy_eager"]["tokens_per_s"] > 0 and res["timing"]["timed_after"] == []


@pytest.mark.parametrize("low_peak", [4e11, 1e10])
def test_each_rows_mfu_is_against_its_own_dtypes_peak(monkeypatch, low_peak):
    """An fp32 row's MFU divides by fp32's matmul peak, a low-precision row's by its dtype's, or
    fp32's where that is higher (an emulated dtype: the same GEMMs run at fp32's rate with fp32
    compute). One peak for every row, the policy's main dtype's, gave fp32_eager 970% MFU against
    the emulated bf16 peak of an AVX2-only CPU. The table names each peak."""
    import autoprec.commands.bench_mfu as mfu
    from autoprec.device import autocast_dtype
    from autoprec.dtypes import NAMES

    low = NAMES[autocast_dtype(torch.device("cpu"))]
    peak = {torch.float32: 1e11, torch.bfloat16: low_peak, torch.float16: low_peak}
    monkeypatch.setattr(mfu, "matmul_peak_flops", lambda dtype, device, **k: (peak[dtype], 512))
    res = run_bench(TINY, Policy.default(low), steps=2, warmup=1, device="cpu",
                    configs=["fp32_eager", "autocast_eager"], quiet=True)
    flops, rows = res["flops"]["flops_per_step"], res["configs"]
    assert res["matmul_peak"]["by_dtype"] == {low: low_peak, "fp32": 1e11}
    assert rows["fp32_eager"]["mfu"] == pytest.approx(flops / rows["fp32_eager"]["step_s"] / 1e11)
    assert rows["autocast_eager"]["mfu"] == pytest.approx(
        flops / rows["autocast_eager"]["step_s"] / max(low_peak, 1e11))
    assert (f"peak of the row's dtype, at least fp32's ({low} {low_peak / 1e12:.3f}, fp32 0.100 TFLOP/s)"
            in format_bench_table(res))


def test_pure_low_compiled_compiles_the_low_dtype_copy():
    """pure_low_compiled is torch.compile of the model cast to the low dtype, as a user compiles it:
    it used to capture the copy, which capture refuses (its parameters are not fp32), so a default
    ``autoprec bench`` failed this row and exited 1 on every model."""
    res = run_bench(TINY, Policy.default("bf16"), steps=1, warmup=1, device="cpu",
                    configs=["fp32_eager", "pure_low_compiled"], quiet=True)
    row = res["configs"]["pure_low_compiled"]
    assert row["error"] is None and row["compiled"] and row["steps_timed"] >= 1
    assert 1e-5 < row["grad_rel_l2"] < 0.1  # rounded to the low dtype, not broken


def test_policy_eager_saves_activations_in_the_policys_dtype_as_apply_eager_does(monkeypatch):
    """A policy's ``saved`` rules (bf16 activations saved for backward, autoprec.applied.saved) are
    what ``policy_eager`` runs, as ``apply(..., compile=False)`` and ``train --no-compile`` run
    them: the row ran the lowered graph without them, so it read grad_rel_l2 0 and fp32's peak for
    a policy that drifts by bf16's rounding and saves half the bytes. Its drift is apply's mean
    over the drift batches against the fp32 graph's, and its peak is fp32's less what the bf16
    copies save (the CPU peak: training state + bytes saved for backward on batch 0)."""
    import autoprec
    import autoprec.commands.bench_mfu as mfu
    from autoprec.measure import SavedBytes
    from autoprec.measure.drift import DRIFT_BATCHES
    from autoprec.metrics import grad_rel_l2
    from autoprec.modelspec import load_model_spec
    from autoprec.policy.rule import Rule
    from tests.conftest import DRIFT

    monkeypatch.setattr(mfu, "matmul_peak_flops", lambda dtype, device, **k: (1e11, 512))  # not measured here
    pol = Policy(default_dtype="fp32", rules=(Rule(op_class="matmul", saved="bf16"),))
    res = run_bench(TINY, pol, steps=1, warmup=0, device="cpu", configs=["fp32_eager", "policy_eager"],
                    rel_band=1.0, quiet=True)  # the timing's fewest rounds: drift and peak are the point
    rows = res["configs"]
    spec = load_model_spec(TINY)

    def grads(policy: Policy, k: int) -> tuple[list[torch.Tensor], int]:
        """Gradients and bytes saved for backward of apply(compile=False) on drift batch k."""
        model = spec.build_model()
        mp = autoprec.apply(model, policy, spec.get_batch(0, "cpu"), compile=False)
        counter = SavedBytes(list(model.parameters()))
        batch = spec.get_batch(k, "cpu")
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
            loss = spec.loss_fn(mp(batch), batch)
        loss.backward()
        return [p.grad for p in model.parameters()], counter.total

    runs = [(grads(Policy.fp32(), k), grads(pol, k)) for k in range(DRIFT_BATCHES)]
    expected = sum(grad_rel_l2(got, ref) for (ref, _), (got, _) in runs) / DRIFT_BATCHES
    (_, fp32_saved), (_, bf16_saved) = runs[0]  # batch 0's pass: the one the row's peak counts
    assert expected > 10 * DRIFT[torch.float32]  # bf16 roundings, not fp32 round-off
    assert rows["policy_eager"]["error"] is None
    assert rows["policy_eager"]["grad_rel_l2"] == pytest.approx(expected, abs=DRIFT[torch.float32])
    assert rows["fp32_eager"]["grad_rel_l2"] == pytest.approx(0.0, abs=DRIFT[torch.float32])
    assert bf16_saved < fp32_saved
    assert rows["fp32_eager"]["peak_bytes"] - rows["policy_eager"]["peak_bytes"] == fp32_saved - bf16_saved
