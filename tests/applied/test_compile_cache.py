"""``autoprec train`` and ``autoprec bench`` right after ``tune`` reuse the compiled graph from
Inductor's caches (the AOTAutograd and FX graph caches), and the commands say what the caches
served."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import EXAMPLES

CACHE_LINE = re.compile(r"Inductor caches: AOTAutograd (\d+) hits?, (\d+) miss(?:es)?")


def _run(args, env):
    r = subprocess.run([sys.executable, "-m", "autoprec.cli", *args], capture_output=True, text=True,
                       env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r.stdout + r.stderr


@pytest.mark.heavy
def test_train_and_bench_after_tune_hit_the_compile_caches(tmp_path):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "OMP_NUM_THREADS": "1"}
    policy = tmp_path / "p.json"
    # two repeated blocks: the tuned graph is compiled in regions, whose graphs must come out the
    # same in another process for the caches to hit (a flat MLP would not check that)
    model = str(EXAMPLES / "tiny_mlp.py")
    tuned = _run(["tune", model, "--out", str(policy), "--trials", "3", "--finalists", "1", "--traj-steps",
                  "0"], env)
    hits, misses = map(int, CACHE_LINE.search(tuned).groups())
    assert misses >= 2  # a fresh cache: the baselines and the finalist compiled for real
    trained = _run(["train", model, "--policy", str(policy), "--steps", "2"], env)
    line = next(ln for ln in trained.splitlines() if "first step" in ln)
    assert CACHE_LINE.search(line).groups() == ("1", "0"), line  # the tuned graph, reused
    out = tmp_path / "bench.json"
    benched = _run(["bench", model, "--policy", str(policy), "--configs", "policy_compiled", "--steps", "1",
                    "--json", str(out)], env)
    line = next(ln for ln in benched.splitlines() if "policy_compiled: grad_rel_l2" in ln)
    assert CACHE_LINE.search(line).groups() == ("1", "0"), line
    rows = json.loads(out.read_text())["configs"]
    assert CACHE_LINE.search(rows["policy_compiled"]["compile_cache"]).groups() == ("1", "0")
    assert rows["fp32_eager"]["compile_cache"] is None  # an eager row compiles nothing
    again = tmp_path / "cold"
    cold = _run(["train", model, "--policy", str(policy), "--steps", "2"],
                {**env, "TORCHINDUCTOR_CACHE_DIR": str(again)})
    line = next(ln for ln in cold.splitlines() if "first step" in ln)
    assert CACHE_LINE.search(line).groups() == ("0", "1"), line  # another cache: compiled again
