"""``benchmarks/gpu_check.sh --dry-run``: every step of the GPU check on the CPU, tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.heavy  # the whole script on the CPU, eager rows (issue 52: its dry run is in make test)
def test_gpu_check_dry_run(tmp_path):
    # ~1.5 min on an idle 2-core CPU (imports, capture, probes, tune, the twin rows, bench); the
    # script's own step limits allow a loaded machine up to 600 s.
    out = tmp_path / "gpu"
    env = os.environ | {"PY": sys.executable}
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(out), "--dry-run", "--fp8"],
                       capture_output=True, text=True, env=env, timeout=660)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"] is True and summary["policy_source"] == "tune"
    assert all(s["rc"] == 0 for s in summary["steps"].values()), summary
    assert set(summary["steps"]) == {"wheels", "env", "tune", "twin", "bench", "tune_fp8", "bench_fp8"}
    twin = json.loads((out / "twin" / "twin_vs_autocast.json").read_text())
    assert set(twin["eager"]) == {"autocast_eager", "twin_eager"}
    assert all(r["median_s"] > 0 for r in twin["eager"].values()) and "cpu_flags" in twin["machine"]
    fp8 = json.loads((out / "fp8" / "policy.json").read_text())  # the fp8 tune ran and wrote a policy
    assert fp8["schema_version"] in (1, 2) and (out / "fp8" / "bench.json").stat().st_size > 0
    env_info = json.loads((out / "env.json").read_text())
    assert env_info["torch"] and "cpu_flags" in env_info
    policy = json.loads((out / "policy.json").read_text())
    assert policy["schema_version"] == 1
    bench = json.loads((out / "bench.json").read_text())
    assert bench["partial"] is False
    assert bench["configs"]["fp32_eager"]["ratio_vs_fp32_eager"] == 1.0
    assert "| policy_eager |" in (out / "bench.md").read_text()
    for log in ("gpu_check.log", "tune.log", "bench.log"):
        assert (out / log).stat().st_size > 0


@pytest.mark.heavy  # ~35 s: the micro-batch part (issue 51 done-when 5's GPU run), eager on the CPU
def test_gpu_check_dry_run_global_batch(tmp_path):
    out = tmp_path / "gpu"
    env = os.environ | {"PY": sys.executable}
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(out), "--dry-run",
                        "--global-batch", "4"], capture_output=True, text=True, env=env, timeout=500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["global_batch"] == 4
    assert set(summary["steps"]) == {"wheels", "env", "tune_batch", "bench_batch"}
    assert all(s["rc"] == 0 for s in summary["steps"].values()), summary
    policy = json.loads((out / "batch" / "policy.json").read_text())
    assert policy["schema_version"] == 4 and policy["batching"]["micro_batch"] * policy["batching"][
        "accumulation"] == 4
    bench = json.loads((out / "batch" / "bench.json").read_text())
    assert bench["global_batch"] == 4 and bench["speedup_vs_baseline"] > 0
    assert not (out / "twin").exists() and not (out / "policy.json").exists()  # nothing else ran


def test_gpu_check_usage_says_which_argument_was_wrong():
    cases = {(): "no OUTDIR given",
             ("--dry-run", "out"): "the first argument must be OUTDIR, got option --dry-run",
             ("out", "--global-batch"): "--global-batch needs a value",
             ("out", "--global-batch", "x"): "--global-batch must be a positive integer, got 'x'",
             ("out", "--gb", "4"): "unknown argument '--gb'"}
    for args, why in cases.items():
        r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), *args], capture_output=True,
                           text=True)
        assert r.returncode == 2 and why in r.stderr and "usage:" in r.stderr, (args, r.stderr)
