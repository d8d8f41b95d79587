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
import torch

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


@pytest.mark.heavy
def test_a_graph_and_its_flat_output_copy_compile_to_one_cached_graph(tmp_path, monkeypatch):
    """``tune`` compiles the lowered graph, ``train`` (``apply``) its flat-output copy: both compile
    the flat graph (``compile_graph``), so the second is a cache hit, and the lowered graph's call
    still returns the model's output type. A T5 (dynamic shapes, a ``Seq2SeqLMOutput``) missed
    before: Dynamo traced the output's reconstruction into another graph (examples/t5_seq2seq.py:
    ``train`` after ``tune`` first step 28.9 s, AOTAutograd 0 hits; now 4.1 s, 1 hit)."""
    import transformers

    from autoprec._torch_compat import compile_cache_counts
    from autoprec.applied.compile import compile_graph
    from autoprec.applied.outputs import flat_output_graph
    from autoprec.capture.batches import capture_for
    from autoprec.modelspec import load_model_spec

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=259, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
        relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0, use_cache=False)).train()
    spec = load_model_spec(str(EXAMPLES / "t5_seq2seq.py"))  # its batches, whose shapes vary
    batches = [spec.get_batch(i, "cpu") for i in range(2)]
    gm = capture_for(model, batches)
    counts, outs = [], []
    for g in (gm, flat_output_graph(gm)[0]):
        torch._dynamo.reset()  # a new process as far as Dynamo's in-memory caches go
        before = compile_cache_counts()
        outs.append(compile_graph(g)(**spec.get_batch(0, "cpu")))  # new tensors: Dynamo marks the ones it saw
        counts.append({k: v - before[k] for k, v in compile_cache_counts().items()})
    assert [(c["aot_autograd_hit"], c["aot_autograd_miss"]) for c in counts] == [(0, 1), (1, 0)], counts
    assert isinstance(outs[0], transformers.modeling_outputs.Seq2SeqLMOutput)
    torch.testing.assert_close(outs[0].loss, model(**spec.get_batch(0, "cpu")).loss)
    assert isinstance(outs[1], tuple) and torch.equal(outs[1][0], outs[0].loss)
