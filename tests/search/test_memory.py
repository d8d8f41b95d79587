"""Memory: what peak_bytes counts on the CPU, the policy's activation memory budget (recomputation
in the compiled graph), and ``autoprec tune --max-memory``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autoprec import Policy, apply
from autoprec.cli import main
from autoprec.errors import SearchError
from autoprec.measure import Harness
from autoprec.modelspec import load_model_spec
from autoprec.search.budgets import parse_max_memory
from autoprec.search.study import tune
from tests.conftest import DRIFT, MODELS

WIDE = str(MODELS / "wide_mlp.py")

TWO_LINEAR = '''
import torch
from torch import nn

def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 16, bias=False), nn.Linear(16, 8, bias=False))

def get_batch(step, device):
    return (torch.ones(4, 32, device=device),)

def loss_fn(out, batch):
    return out.pow(2).mean()
'''


def test_parse_max_memory():
    assert parse_max_memory(None) is None and parse_max_memory("none") is None
    assert parse_max_memory("auto") == ("autocast", 1.0)
    assert parse_max_memory("0.8x") == ("fp32", 0.8)
    assert parse_max_memory("300MiB") == ("bytes", 300 * 2**20)
    assert parse_max_memory("2 GiB") == ("bytes", 2 * 2**30)
    assert parse_max_memory("1.5GB") == ("bytes", 1.5e9)
    assert parse_max_memory("5e8") == ("bytes", 5e8)
    assert parse_max_memory(123456) == ("bytes", 123456.0)
    for bad in ("lots", "3 TiB", "1e300GiB", "inf", "--3MiB"):
        with pytest.raises(SearchError, match="--max-memory: expected 'auto'"):
            parse_max_memory(bad)
    for bad in ("-3MiB", "0x", "-0.5x", "0", "-1e3", "0%", "-5%", 0, -2):
        with pytest.raises(SearchError) as e:
            parse_max_memory(bad)
        assert str(e.value) == f"--max-memory: must be positive (> 0), got {bad!r}"
    with pytest.raises(SearchError, match=r"above 0% and at most 100%; got '101%'"):
        parse_max_memory("101%")
    for bad in ("1.5", "1.5b", 1.5):  # "1.5" was read as 2 bytes: "the budget (2 bytes)"
        with pytest.raises(SearchError, match=r"is 1.5 bytes \(a number without a unit is bytes, and bytes "
                                              r"are whole\): .*e\.g\. '1\.5x'.*'90%'.*'1\.5GiB'"):
            parse_max_memory(bad)
    with pytest.raises(SearchError, match=r"and bytes are whole\): write whole bytes \('1500001'\)"):
        parse_max_memory("1500000.7")


def test_saved_parameters_are_counted_once(tmp_path):
    """peak_bytes = activations saved for backward + 16 bytes per fp32 parameter (weights,
    gradients, two AdamW moments). The second Linear keeps its weight for the input gradient:
    that tensor is the parameter itself and allocates nothing, so it is not counted again."""
    f = tmp_path / "two_linear.py"
    f.write_text(TWO_LINEAR)
    h = Harness(load_model_spec(f), torch.device("cpu"), warmup=1, steps=1)
    state = (32 * 16 + 16 * 8) * 4 * 4
    assert h.state_bytes == state
    saved = (4 * 32 + 4 * 16 + 4 * 8) * 4  # x (for W1's grad), h (for W2's grad), out (for pow)
    assert h.drift(h.model).peak_bytes == state + saved


@pytest.fixture(scope="module")
def wide_compiled():
    """WideMLP's fp32 policy compiled at activation memory budgets 1.0 and 0.0 (two compiles,
    shared by the tests below): ``{budget: Measurement}`` and the harness's state bytes."""
    h = Harness(load_model_spec(WIDE), torch.device("cpu"), warmup=1, steps=1)
    ms = {b: h.drift(apply(h.model, dataclasses.replace(Policy.fp32(), activation_memory_budget=b),
                           h.batches[0]))
          for b in (1.0, 0.0)}
    return ms, h.state_bytes


@pytest.mark.heavy
def test_activation_memory_budget_recomputes_and_keeps_gradients(wide_compiled):
    """A policy's activation_memory_budget reaches the partitioner: 0.0 saves far less for backward
    than 1.0 (Inductor's default) and the gradients stay those of FP32."""
    ms, state = wide_compiled
    for m in ms.values():
        assert m.grad_rel_l2 < DRIFT[torch.float32]  # fp32 compiled vs fp32 eager, recomputation included
    assert ms[0.0].peak_bytes - state < 0.5 * (ms[1.0].peak_bytes - state)


@pytest.mark.slow  # a full tune (62 s); test_tune_max_memory_tries_both_levers_and_reports_them runs the fit
def test_tune_max_memory_fits_by_recomputation(tmp_path, capsys, wide_compiled):
    """With a memory budget between full recomputation and Inductor's default, the compiled
    policy gets an activation memory budget below 1 and its measured peak fits."""
    peak = {b: m.peak_bytes for b, m in wide_compiled[0].items()}
    budget = int((peak[1.0] + peak[0.0]) / 2)
    out = tmp_path / "p.json"
    # a drift budget only fp32 meets: the chosen policy is fp32 on any CPU, fast bf16 or not
    res = tune(WIDE, trials=2, out=out, max_memory=str(budget), max_drift=1e-5, finalists=1, traj_steps=2,
               progress=False, report=False)
    pol = Policy.load(out)
    assert 0.0 <= pol.activation_memory_budget < 1.0
    assert pol.measured["peak_bytes"] <= budget and pol.measured["memory_budget_bytes"] == budget
    assert res.policy == pol
    log = capsys.readouterr().out
    assert "activation memory budget" in log
    chosen = next(line for line in log.splitlines() if line.startswith("[autoprec] chosen:"))
    assert "fp32 + torch.compile, trial" not in chosen and " with recompute " in chosen, chosen


def test_tune_memory_budget_nothing_fits_eager(tmp_path):
    """Without compile the budget filters the feasible trials by their screening peak: above the
    parameter state but below every trial's peak, nothing fits, the error says so and no policy
    file is written."""
    out = tmp_path / "p.json"
    with pytest.raises(SearchError, match=r"no feasible trial fits the memory budget \(2\.0 MiB; "
                                          r"the smallest peak was \d+\.\d MiB\); without --no-compile"):
        tune(WIDE, trials=1, out=out, max_memory="2MiB", compile=False, progress=False, report=False,
             quiet=True)
    assert not out.exists()


def test_tune_budget_below_parameter_state_fails_before_trials(tmp_path):
    """A budget below the fp32 weights, gradients and AdamW state (16 bytes per parameter) can never
    be met: tune says so before capture, any trial or compile (the Python API's pre-check)."""
    out = tmp_path / "p.json"
    with pytest.raises(SearchError, match=r"max_memory: the budget \(1000 bytes\) is not above the fp32 "
                                          r"parameters, gradients and AdamW state of this model alone: "
                                          r"[\d,]+ parameters need at least 1\.5 MiB"):
        tune(WIDE, trials=1, out=out, max_memory="1000", progress=False, report=False, quiet=True)
    assert not out.exists() and not (tmp_path / "p.optuna.db").exists()


def test_budget_error_names_the_model_files_optimizer(tmp_path):
    """With SGD (no state) the floor is parameters + gradients, and the message says SGD, not
    AdamW: the state is counted from the optimizer make_optimizer returns."""
    sgd = MODELS / "sgd_mlp.py"
    n_params = sum(p.numel() for p in load_model_spec(sgd).build_model().parameters())
    with pytest.raises(SearchError, match=rf"gradients and SGD state of this model alone: {n_params:,} "
                                          rf"parameters need at least {8 * n_params} bytes whatever"):
        tune(sgd, trials=1, out=tmp_path / "p.json", max_memory="1000", compile=False, progress=False,
             report=False, quiet=True, dtypes="bf16")
    assert not (tmp_path / "p.json").exists()


def test_cli_bad_max_memory_exits_2_before_building(tmp_path, capsys):
    out = tmp_path / "sub" / "p.json"
    assert main(["tune", WIDE, "--max-memory", "lots", "--out", str(out)]) == 2
    assert "--max-memory: expected 'auto'" in capsys.readouterr().err
    assert not (tmp_path / "sub").exists()



@pytest.mark.parametrize("value", ["0x", "-1GiB", "-0.5x", "-5%", "-1"])
@pytest.mark.parametrize("command", ["tune", "bench"])
def test_cli_max_memory_not_positive_says_so(tmp_path, capsys, command, value):
    """Every command taking --max-memory names the value and that it must be positive, a leading
    '-' included (argparse alone takes '-1GiB' for an option: "expected one argument")."""
    out = tmp_path / "sub" / "p.json"
    if command == "tune":
        args = ["tune", WIDE, "--out", str(out), "--max-memory", value]
    else:
        Policy.fp32().save(tmp_path / "fp32.json")
        args = ["bench", WIDE, "--policy", str(tmp_path / "fp32.json"), "--global-batch", "8",
                "--max-memory", value, "--device", "cpu"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"autoprec {command}: error: --max-memory: must be positive (> 0), got {value!r}" in err, err
    assert not (tmp_path / "sub").exists()


def test_parser_hands_a_dash_value_to_max_memory_only():
    from autoprec.cli_parser import build_parser

    parse = build_parser().parse_args
    assert parse(["tune", "m.py", "--max-memory", "-1GiB"]).max_memory == "-1GiB"
    assert parse(["bench", "m.py", "--policy", "p", "--max-memory", "-.5x"]).max_memory == "-.5x"
    assert parse(["tune", "m.py", "--max-memory=-2GiB"]).max_memory == "-2GiB"
    with pytest.raises(SystemExit):  # a missing value is still argparse's "expected one argument"
        parse(["tune", "m.py", "--max-memory", "--out", "x.json"])


def test_eager_apply_warns_that_the_budget_needs_compile():
    spec = load_model_spec(MODELS / "micro_lm.py")
    model = spec.build_model()
    pol = dataclasses.replace(Policy.fp32(), activation_memory_budget=0.5)
    with pytest.warns(UserWarning, match="activation_memory_budget 0.5 applies to compiled graphs only"):
        apply(model, pol, spec.get_batch(0, "cpu"), compile=False)


@pytest.mark.parametrize(("model", "optimizer", "factor"), [("sgd_mlp.py", "SGD", 2),
                                                            ("sgd_momentum_mlp.py", "SGD", 3),
                                                            ("wide_mlp.py", "AdamW", 4)])
def test_state_bytes_count_the_model_files_optimizer(model, optimizer, factor):
    """Harness.state_bytes counts the optimizer make_optimizer returns, not AdamW whatever it is:
    parameters + gradients + the optimizer's state tensors (plain SGD keeps none, SGD momentum one
    buffer per parameter, AdamW two moments), i.e. 2x, 3x and 4x the parameter bytes. Counting
    steps a fresh optimizer once: the harness's weights stay bit for bit those of build_model()."""
    spec = load_model_spec(MODELS / model)
    h = Harness(spec, torch.device("cpu"), warmup=1, steps=1)
    param_bytes = sum(p.numel() * p.element_size() for p in h.params)
    assert h.state_bytes == factor * param_bytes and h.optimizer_name == optimizer
    assert h.drift(h.model).peak_bytes > h.state_bytes  # activations on top
    fresh = [p for p in spec.build_model().parameters() if p.requires_grad]
    assert all(torch.equal(p, q) and p.grad is None for p, q in zip(h.params, fresh, strict=True))


@pytest.mark.heavy
def test_tune_max_memory_tries_both_levers_and_reports_them(tmp_path, capsys, wide_compiled):
    """With drift room for low-precision saved activations, the fit tries saved bf16 beside
    recomputation, keeps the faster that fits, and the report lists each point with its lever."""
    from autoprec.search.space import with_saved

    peak = {b: m.peak_bytes for b, m in wide_compiled[0].items()}
    budget = int((peak[1.0] + peak[0.0]) / 2)
    out = tmp_path / "p.json"
    tune(WIDE, trials=1, out=out, max_memory=str(budget), max_drift=0.05, finalists=1, traj_steps=0,
         dtypes="bf16", progress=False)
    pol = Policy.load(out)
    assert pol.measured["peak_bytes"] <= budget
    report = (tmp_path / "p.report.md").read_text()
    section = report.split("## Finalists, with memory levers")[1]
    rows = [r for r in section.splitlines() if r.startswith("| ") and "lever" not in r]
    levers = [r.split(" | ")[1] for r in rows]
    assert "none" in levers and "saved bf16" in levers and any(lv.startswith("recompute") for lv in levers)
    assert any("| * |" in r for r in rows)  # a Pareto front is marked
    used_saved = any(r.saved for r in pol.rules)
    assert used_saved or pol.activation_memory_budget < 1.0
    log = capsys.readouterr().out
    assert "memory lever saved bf16" in log
    # with_saved appends one saved rule per op class
    ws = with_saved(Policy.fp32(), "bf16")
    assert [(r.op_class, r.saved, r.dtype) for r in ws.rules] == [
        ("matmul", "bf16", None), ("sensitive", "bf16", None), ("follow", "bf16", None)]


def test_cli_budget_below_parameter_state_fails_before_capture(tmp_path, capsys, monkeypatch):
    """Issue 20, item 4: a byte budget below the fp32 parameters, gradients and optimizer state is
    refused right after the model is built: exit 2, no capture, no probe, nothing written."""
    import autoprec.cli as cli

    def no_tune(_a):
        raise AssertionError("capture and probing must not start")

    monkeypatch.setattr(cli, "_tune", no_tune)
    out = tmp_path / "sub" / "p.json"
    n_params = sum(p.numel() for p in load_model_spec(WIDE).build_model().parameters())
    assert main(["tune", WIDE, "--max-memory", "10KiB", "--out", str(out), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--max-memory: the budget (10240 bytes) is not above" in err and "AdamW" in err
    assert f"{n_params:,} parameters need at least" in err and f"({16 * n_params:,} bytes)" in err
    assert not (tmp_path / "sub").exists()
    sgd = MODELS / "sgd_mlp.py"  # the model file's optimizer counts
    n_sgd = sum(p.numel() for p in load_model_spec(sgd).build_model().parameters())
    assert main(["tune", str(sgd), "--max-memory", "1000", "--out", str(out), "--device", "cpu"]) == 2
    assert f"SGD state of this model alone: {n_sgd:,} parameters need at least" in capsys.readouterr().err


def test_a_finalist_fitted_with_a_lever_is_named_by_it_and_not_as_the_fp32_baseline():
    """The memory fit turns the all-fp32 finalist into another computation (bf16 saved activations,
    or recomputation, which ``all_fp32`` no longer counts as the baseline): its label drops
    "fp32 + torch.compile" and names the lever; a policy without a lever keeps its label."""
    import dataclasses

    from autoprec.search.contest import fitted_label
    from autoprec.search.space import with_saved

    base = "fp32 + torch.compile, trial 0 (eager 867 tok/s)"
    assert fitted_label(base, with_saved(Policy.fp32(), "bf16")) == (
        "trial 0 (eager 867 tok/s) with saved bf16")
    recompute = dataclasses.replace(Policy.fp32(), activation_memory_budget=0.4)
    assert fitted_label(base, recompute) == "trial 0 (eager 867 tok/s) with recompute 0.4"
    assert fitted_label("all-fp32", recompute) == "all-fp32 with recompute 0.4"
    assert fitted_label("trial 3 (eager 900 tok/s)", with_saved(Policy.default("bf16"), "fp8_e5m2")) == (
        "trial 3 (eager 900 tok/s) with saved fp8_e5m2")
    assert fitted_label(base, Policy.fp32()) == base
