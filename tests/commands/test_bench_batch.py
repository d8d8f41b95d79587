"""``autoprec bench --global-batch N --max-memory M`` (issue 51): the policy at its micro-batch
against fp32 + torch.compile at the largest micro-batch within the budget, in one process, drift
judged by tune's auto rule; a policy for another global batch is refused naming both."""

from __future__ import annotations

import dataclasses
import json

import pytest

from autoprec.cli import main
from autoprec.commands.bench_batch import run_batch_bench
from autoprec.errors import AutoprecError
from autoprec.policy import Batching, Policy
from tests.conftest import EXAMPLES

TINY = EXAMPLES / "tiny_mlp.py"  # file batch 8


def test_bench_at_a_global_batch_gives_each_side_its_own_micro_batch(tmp_path, capsys):
    pol = dataclasses.replace(Policy.fp32(), activation_memory_budget=0.0, batching=Batching(32, 1))
    path = tmp_path / "p.json"
    pol.save(path)
    code = main(["bench", str(TINY), "--policy", str(path), "--global-batch", "32", "--max-memory", "4MiB",
                 "--json", str(tmp_path / "b.json")])
    assert code == 0
    res = json.loads((tmp_path / "b.json").read_text())
    rows = {(r["config"], r["micro_batch"]): r for r in res["rows"]}
    assert res["policy_row"] == "policy @ 32x1" and rows[("policy", 32)]["fits"]
    bar = res["baseline_row"]  # fp32 + torch.compile at its largest micro-batch under 4 MiB
    assert bar.startswith("fp32 + torch.compile @ ")
    m = int(bar.split("@ ")[1].split("x")[0])
    assert rows[("fp32 + torch.compile", m)]["fits"] and m < 32
    assert all(not r["fits"] for (c, k), r in rows.items() if c == "fp32 + torch.compile" and k > m)
    assert res["speedup_vs_baseline"] > 0 and res["within_drift_rule"] is True
    assert "torch.autocast" in res["drift_rule"] and "(the baseline to beat)" in capsys.readouterr().out


def test_a_policy_for_another_global_batch_is_refused(tmp_path):
    path = tmp_path / "p.json"
    dataclasses.replace(Policy.fp32(), batching=Batching(8, 2)).save(path)
    with pytest.raises(AutoprecError, match=r"p.json: trains at micro-batch 8 x 2 accumulated \(global batch "
                                            r"16\), not at --global-batch 32; bench it at --global-batch 16"):
        run_batch_bench(TINY, path, 32, quiet=True)
    assert main(["bench", str(TINY), "--policy", str(path), "--max-memory", "4MiB"]) == 2


def test_bench_global_batch_no_compile_runs_every_side_eagerly_and_needs_the_global_batch(tmp_path, capsys):
    path = tmp_path / "p.json"
    dataclasses.replace(Policy.fp32(), batching=Batching(16, 2)).save(path)
    assert main(["bench", str(TINY), "--policy", str(path), "--no-compile"]) == 2
    assert "--no-compile goes with --global-batch N" in capsys.readouterr().err
    assert main(["bench", str(TINY), "--policy", str(path), "--global-batch", "32", "--no-compile",
                 "--json", str(tmp_path / "b.json")]) == 0
    res = json.loads((tmp_path / "b.json").read_text())
    assert res["policy_row"] == "policy @ 16x2" and res["baseline_row"].startswith("fp32 + eager @ 32x1")
    assert not any("torch.compile" in r["config"] for r in res["rows"])
    assert res["compiled"] is False
    from autoprec.commands.bench_batch import format_batch_table

    table = format_batch_table(res)
    assert "(the faster eager baseline; the baseline to beat is compiled" in table
    assert ("torch.autocast was not run: " in table) == bool(res["autocast_left_out"])


def test_bench_global_batch_refuses_options_it_does_not_read_and_another_models_policy(tmp_path, capsys):
    """``--configs``, ``--steps``, ``--warmup`` and ``--skip-slow`` were accepted and ignored at a
    global batch, and a policy none of whose rules matches the model was measured without a word;
    ``--force`` measures it (as ``bench`` and ``train`` do)."""
    from autoprec.errors import PolicyError
    from autoprec.policy import Rule

    path = tmp_path / "p.json"
    Policy.fp32().save(path)
    base = ["bench", str(TINY), "--policy", str(path), "--global-batch", "16", "--no-compile"]
    assert main([*base, "--configs", "fp32_eager", "--steps", "3"]) == 2
    assert capsys.readouterr().err == (
        "autoprec bench: error: --configs, --steps do not apply with --global-batch (each side's micro-batch "
        "and timing follow tune's micro-batch search): drop them\n")
    assert main([*base, "--skip-slow"]) == 2
    assert "error: --skip-slow does not apply with --global-batch" in capsys.readouterr().err
    other = tmp_path / "other.json"
    Policy(rules=[Rule(dtype="bf16", module="transformer.h.*")]).save(other)
    with pytest.raises(PolicyError, match=r"other.json.*transformer\.h\.\*"):
        run_batch_bench(TINY, other, 16, quiet=True, compile=False)
    res = run_batch_bench(TINY, other, 16, quiet=True, compile=False, force=True)
    assert res["policy_row"].startswith("policy @ ") and [c["phase"] for c in res["load"]] == [
        "start", "before timing", "after timing"]


def test_a_policy_tuned_at_its_micro_batch_is_not_called_another_models(tmp_path, capsys):
    """tune records the graph at the micro-batch it chose (as ``train`` captures it), and bench
    compared that with the graph at the file's batch: every ``--global-batch`` policy whose micro-batch
    differs from the file's got "was tuned on tiny_mlp.py (graph ...), not on this model tiny_mlp.py".
    A policy of another graph at its micro-batch still gets the warning."""
    import torch

    from autoprec.measure import Harness
    from autoprec.modelspec import load_model_spec
    from autoprec.modelspec.micro_batches import MicroBatches
    from autoprec.nodekeys import graph_fingerprint

    cpu = torch.device("cpu")
    micro = MicroBatches(load_model_spec(TINY), 32, 16, cpu).micro_spec()
    tuned = graph_fingerprint(Harness(micro, cpu, drift_batches=1).graph_module)
    path = tmp_path / "p.json"
    for fingerprint, warned in ((tuned, False), ("0123456789abcdef", True)):
        pol = dataclasses.replace(Policy.fp32(), batching=Batching(16, 2),
                                  provenance={"graph_fingerprint": fingerprint, "model": str(TINY)})
        pol.save(path)
        run_batch_bench(TINY, path, 32, compile=False)
        out = capsys.readouterr().out
        assert ("was tuned on" in out) is warned, out
