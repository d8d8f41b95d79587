"""``autoprec bench``: JSON schema, ratio consistency, drift of fp32/low configs, MFU range."""

from __future__ import annotations

import json

import pytest
import torch

from autoprec.bench import CONFIGS, format_bench_table, matmul_peak_flops, model_flops, run_bench
from autoprec.cli import main
from autoprec.policy import Policy
from tests.conftest import EXAMPLES

TINY = str(EXAMPLES / "tiny_mlp.py")
EAGER = ["fp32_eager", "autocast_eager", "pure_low_eager", "policy_eager"]
ROW_KEYS = {"step_s", "tokens_per_s", "grad_rel_l2", "peak_bytes", "mfu", "ratio_vs_fp32_eager",
            "ratio_vs_autocast_compiled", "steps_timed", "dtype", "compiled", "note", "error"}


@pytest.fixture(scope="module")
def result():
    return run_bench(TINY, Policy.fp32(), steps=2, warmup=1, device="cpu", configs=EAGER, quiet=True)


def test_schema(result):
    assert {"device", "torch", "date", "configs", "flops", "matmul_peak", "tokens_per_batch"} <= set(result)
    assert list(result["configs"]) == EAGER
    for row in result["configs"].values():
        assert ROW_KEYS <= set(row)
    json.dumps(result, allow_nan=False)  # no inf/NaN leaks into the JSON


def test_ratios_consistent(result):
    rows = result["configs"]
    assert rows["fp32_eager"]["ratio_vs_fp32_eager"] == pytest.approx(1.0)
    for r in rows.values():
        assert r["error"] is None
        assert r["ratio_vs_fp32_eager"] == pytest.approx(r["tokens_per_s"] / rows["fp32_eager"]["tokens_per_s"])
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
