"""CLI: bad model files exit with code 2, name the file and what is missing, write nothing;
``tune`` writes a valid policy and resumes its study; ``train`` trains with it."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from autoprec.cli import main
from autoprec.policy import Batching, Policy
from tests.conftest import EXAMPLES, ROOT

BAD_FILES = {
    "no_build_model.py": ("def get_batch(step, device):\n    return None\n", "build_model"),
    "no_get_batch.py": ("import torch\ndef build_model():\n    return torch.nn.Linear(2, 2)\n", "get_batch"),
    "syntax_error.py": ("def build_model(:\n    pass\n", "syntax error"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_model_file_exits_2_and_writes_nothing(tmp_path, capsys, name):
    text, expected = BAD_FILES[name]
    model = tmp_path / name
    model.write_text(text)
    out = tmp_path / "out" / "policy.json"
    code = main(["tune", str(model), "--out", str(out), "--trials", "1"])
    err = capsys.readouterr().err
    assert code == 2
    assert str(model) in err and expected in err
    assert not out.parent.exists() or not any(out.parent.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_console_script_exit_code(tmp_path):
    model = tmp_path / "m.py"
    model.write_text("def get_batch(step, device):\n    return None\n")
    r = subprocess.run([sys.executable, "-m", "autoprec.cli", "tune", str(model), "--out",
                        str(tmp_path / "p.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "build_model" in r.stderr and str(model) in r.stderr
    assert not (tmp_path / "p.json").exists()


def test_bad_policy_file_exits_2(tmp_path, capsys):
    pol = tmp_path / "p.json"
    pol.write_text(json.dumps({"schema_version": 1, "default_dtype": "fp64"}))
    code = main(["train", str(EXAMPLES / "tiny_mlp.py"), "--policy", str(pol), "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "default_dtype" in err and str(pol) in err


def test_bad_max_drift_exits_2(tmp_path, capsys):
    code = main(["tune", str(EXAMPLES / "tiny_mlp.py"), "--max-drift", "-1", "--out",
                 str(tmp_path / "p.json")])
    assert code == 2 and "--max-drift" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_tune_writes_policy_resumes_and_trains(tmp_path, capsys):
    """Forced bf16 search on a small model, eager (fast): the policy validates, carries its
    measured block, the study resumes without re-measuring, and train uses the policy."""
    out = tmp_path / "p.json"
    Policy.fp32().with_provenance(model="other_model.py").save(out)  # another model's policy there
    args = ["tune", str(EXAMPLES / "tiny_mlp.py"), "--out", str(out), "--trials", "6", "--no-compile",
            "--dtypes", "bf16"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "fp32 eager" in text and "autocast" in text and "autoprec policy" in text
    assert f"note: {out} held a policy tuned for other_model.py; it is replaced by this one, for " in text
    pol = Policy.load(out)
    m = pol.measured
    assert m["drift_budget"] > 0  # torch.autocast's mean grad_rel_l2 (the rule: search/drift_budget.py)
    assert m["tokens_per_s"] > 0 and pol.provenance["model"].endswith("tiny_mlp.py")
    # the ratio that decides first, against the faster bar timed beside the choice, named
    best = pol.provenance["baseline"]
    assert best in ("torch.autocast eager", "all-fp32", "fp32 eager")
    wrote = next(ln for ln in text.splitlines() if ln.startswith(f"wrote {out}: "))
    if "speedup_vs_baseline_lo" in m:  # the decision's band, unless the choice is that baseline
        lo, hi = m["speedup_vs_baseline_lo"], m["speedup_vs_baseline_hi"]
        assert lo < hi, m
        tie = "a tie within the noise: " if lo <= 1.0 <= hi else ""
        paired = m.get("speedup_vs_baseline_paired")
        if paired is not None:
            assert lo <= paired <= hi, m  # the band is the paired ratio's
        ratio = m["speedup_vs_baseline"] if paired is None else paired  # the one the band is of, first
        medians = (f"; medians' ratio {m['speedup_vs_baseline']:.2f}x"
                   if paired is not None and f"{paired:.2f}" != f"{m['speedup_vs_baseline']:.2f}" else "")
        rounds = f", paired rounds{medians}" if paired is not None else ""
        assert (f"tokens/s, {ratio:.2f}x {best} (the baseline to beat; {tie}band {lo:.2f}-{hi:.2f}"
                f"{rounds}), ") in wrote
    else:
        assert m["speedup_vs_baseline"] == 1.0, m
        assert f"tokens/s, 1.00x {best} (the baseline to beat), " in wrote
    assert wrote.count(f"x {best}") == 1 and "x fp32 eager" in wrote
    db = tmp_path / "p.optuna.db"
    assert db.exists()

    import optuna

    study = optuna.load_study(study_name=pol.provenance["study"], storage=f"sqlite:///{db}")
    n = len(study.trials)
    # 6 finished; queued local moves from the autocast twin not reached by then stay WAITING
    assert sum(t.state.is_finished() for t in study.trials) == 6
    # within the drift budget by its rule (a paired test, not m["grad_rel_l2"] <= the mean): the
    # policy is all-fp32 or a trial's whose constraint (DriftBudget.excess) was <= 0
    def form(d):
        return json.dumps({k: v for k, v in d.items() if k not in ("measured", "provenance")}, sort_keys=True)

    feasible = {form(t.user_attrs["autoprec:policy"]) for t in study.trials
                if t.user_attrs.get("autoprec:constraint", 1.0) <= 0}
    assert pol.dtypes_used() == {"fp32"} or form(pol.to_dict()) in feasible
    # Baselines ran first, in order.
    def cls_params(t):
        return {k: t.params[k] for k in ("matmul", "sensitive", "follow")}

    assert cls_params(study.trials[0]) == {"matmul": "fp32", "sensitive": "fp32", "follow": "fp32"}
    # the autocast twin (Policy.autocast) second
    assert cls_params(study.trials[1]) == {"matmul": "bf16", "sensitive": "fp32", "follow": "promote"}
    assert {v for k, v in study.trials[1].params.items() if ":" in k} == {"inherit"}
    # Re-running the same command resumes: no new trials needed.
    assert main(args) == 0
    assert "held a policy tuned for" not in capsys.readouterr().out  # its own model's: no note
    assert len(optuna.load_study(study_name=pol.provenance["study"], storage=f"sqlite:///{db}").trials) == n

    assert main(["train", str(EXAMPLES / "tiny_mlp.py"), "--policy", str(out), "--steps", "20",
                 "--no-compile"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step")]
    first, last = float(lines[0].split()[3]), float(lines[-1].split()[3])
    assert last < first


def test_show_prints_policy(tmp_path, capsys):
    p = tmp_path / "p.json"
    Policy.default().save(p)
    assert main(["show", str(p), "--json"]) == 0
    assert '"schema_version": 1' in capsys.readouterr().out


def test_show_without_model_summarises(capsys):
    """Issue 20, item 8: ``show`` without ``--model`` prints the summary ``--model`` gives (less
    the node matches), not the raw JSON."""
    path = ROOT / "benchmarks" / "results" / "tune_4x_2026-11-30" / "qwen2_tiny.policy.json"
    pol = Policy.load(path)
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert '"schema_version"' not in out
    assert out.startswith(f"{path}: {pol.summary()}\n")
    assert "tuned: model examples/qwen2_tiny.py, graph_fingerprint f62b0d9951a236e6" in out
    assert ("measured: 1241 tokens/s, 1.01x fp32 eager, 27.74x torch.autocast + torch.compile, peak 360.6 MiB"
            in out)  # a compiled tune: its autocast bar was compiled too
    for i, rule in enumerate(pol.rules):
        assert f"rules[{i}] {rule.describe()}\n" in out
    assert "matched nodes" not in out


def test_show_prints_the_policys_batching(tmp_path, capsys):
    """Issue 51: the micro-batch and accumulation a policy trains at are in show's summary line (with
    and without ``--model``) and in ``--json`` (schema 4)."""
    p = tmp_path / "p.json"
    dataclasses.replace(Policy.fp32(), batching=Batching(micro_batch=2, accumulation=4)).save(p)
    shown = "micro-batch 2 x 4 accumulated (global batch 8)"
    assert main(["show", str(p)]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith(shown)
    assert main(["show", str(p), "--model", str(EXAMPLES / "tiny_mlp.py")]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith(shown)
    assert main(["show", str(p), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["schema_version"] == 4 and d["batching"] == {"micro_batch": 2, "accumulation": 4}


@pytest.mark.parametrize("baseline, shown", [
    ("fp32 + torch.compile", "measured: 1600 tokens/s, 1.00x fp32 + torch.compile (the baseline to beat), "
                             "1.05x fp32 eager, 24.00x torch.autocast, peak 1.0 MiB"),
    ("fp32 eager", "measured: 1600 tokens/s, 0.92x fp32 eager (the baseline to beat), 24.00x torch.autocast, "
                   "peak 1.0 MiB"),
    ("torch.autocast + torch.compile", "measured: 1600 tokens/s, 1.10x torch.autocast + torch.compile (the "
                                       "baseline to beat), 1.05x fp32 eager, peak 1.0 MiB"),
    ("fp32 + torch.compile, tie", "measured: 1600 tokens/s, 0.67x fp32 + torch.compile (the baseline to "
                                  "beat; a tie within the noise: band 0.33-1.35, paired rounds; medians' "
                                  "ratio 0.56x), 1.05x fp32 eager"),
    ("fp32 + torch.compile, slower", "measured: 1600 tokens/s, 0.56x fp32 + torch.compile (the baseline to "
                                     "beat; band 0.50-0.62), 1.05x fp32 eager"),
])
def test_show_gives_the_speed_against_the_baseline_to_beat_first_and_once(tmp_path, capsys, baseline, shown):
    """``show`` leads with ``speedup_vs_baseline``, named by ``provenance.baseline``; where that bar is
    fp32 eager or torch.autocast its own ratio is not printed a second time. With the decision's
    paired band it says whether the ratio is a tie (a user read "0.56x the baseline to beat" for a
    policy the head-to-head had found as fast as it, within a band of 0.33-1.35). Paired, it leads
    with the ratio the band is of (a user read "0.92x ... paired 0.72x, band 0.63-0.83")."""
    baseline, _, band = baseline.partition(", ")
    vs = {"fp32 + torch.compile": 1.0, "fp32 eager": 0.92, "torch.autocast + torch.compile": 1.1}[baseline]
    bands = {"tie": (0.33, 1.35), "slower": (0.50, 0.62)}
    extra = {}
    if band:  # the tie's rounds paired (the band is of the paired 0.67x); the slower one's not
        vs = 0.56
        extra = {"speedup_vs_baseline_lo": bands[band][0], "speedup_vs_baseline_hi": bands[band][1]}
        extra |= {"speedup_vs_baseline_paired": 0.67} if band == "tie" else {}
    p = tmp_path / "p.json"
    Policy.fp32().with_provenance(baseline=baseline).with_measured(
        {"tokens_per_s": 1600.0, "speedup_vs_baseline": vs, "speedup_vs_fp32": 0.92 if vs == 0.92 else 1.05,
         "speedup_vs_autocast": 1.1 if vs == 1.1 else 24.0, "peak_bytes": 2.0**20, **extra}).save(p)
    assert main(["show", str(p)]) == 0
    assert shown in capsys.readouterr().out




def test_show_leads_a_global_batch_policy_with_what_it_trains_at(tmp_path, capsys):
    """``show`` on a ``tune --global-batch`` policy printed the contest's numbers at the model file's
    batch first ("18767 tokens/s ... peak 2.7 MiB, memory budget 2.1 MiB": a policy over its own
    budget, at a micro-batch it does not train at). It leads with the micro-batch x accumulation's."""
    p = tmp_path / "p.json"
    dataclasses.replace(Policy.fp32(), batching=Batching(micro_batch=2, accumulation=8)).with_provenance(
        baseline="fp32 + torch.compile").with_measured(
        {"tokens_per_s": 18767.0, "speedup_vs_baseline": 1.0, "peak_bytes": 2.7 * 2**20,
         "global_batch": 16.0, "micro_batch_tokens_per_s": 13378.0, "micro_batch_peak_bytes": 2.0 * 2**20,
         "micro_batch_grad_rel_l2": 0.0, "memory_budget_bytes": 2.1 * 2**20, "baseline_micro_batch": 2.0,
         "baseline_micro_batch_tokens_per_s": 13000.0, "speedup_vs_baseline_at_global_batch": 1.03}).save(p)
    assert main(["show", str(p)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == ("measured at global batch 16, micro-batch 2 x 8 accumulated (global batch 16): 13378 "
                        "tokens/s, grad_rel_l2 0 (accumulated), peak 2.0 MiB (budget 2.1 MiB); 1.03x the "
                        "baseline to beat at its own micro-batch 2 (13000 tokens/s)")
    assert lines[3].startswith("measured at the model file's batch, without accumulation (the contest of "
                               "policies): 18767 tokens/s, 1.00x fp32 + torch.compile")
    assert "micro_batch" not in lines[3] and "budget" not in lines[3]
    pol = Policy.load(p)  # the band last ("1.03x, band 0.79-1.14 the baseline to beat" read oddly)
    pol.with_measured({**pol.measured, "speedup_vs_baseline_at_global_batch_lo": 0.95,
                       "speedup_vs_baseline_at_global_batch_hi": 1.10}).save(p)
    assert main(["show", str(p)]) == 0
    assert capsys.readouterr().out.splitlines()[2].endswith(
        "; 1.03x the baseline to beat at its own micro-batch 2 (13000 tokens/s; band 0.95-1.10)")

#: A command warning as bench's rows do (the same warning once per apply, each apply's capture
#: changing the filters), run by the real CLI in a subprocess (pytest records warnings instead).
_WARNS_TWICE = """
import logging, sys, warnings
import autoprec.cli as cli

def warns(_args):
    for text in ("autoprec: the same thing", "autoprec: the same thing", "autoprec: another thing"):
        warnings.warn(text, stacklevel=1)
        with warnings.catch_warnings():  # as each capture does: Python's "once" registry is cleared
            warnings.filterwarnings("ignore", message="unrelated")
    logging.getLogger("autoprec").info("capturing")
    return 0

cli._COMMANDS["show"] = warns
sys.exit(cli.main(["show", sys.argv[1]]))
"""


def test_each_autoprec_warning_is_printed_once_and_by_rank_0_only(tmp_path):
    """bench --nproc 2 printed one warning 16 times: once per row's apply, on both ranks."""
    p = tmp_path / "p.json"
    Policy.fp32().save(p)

    def run(**env: str) -> str:
        r = subprocess.run([sys.executable, "-c", _WARNS_TWICE, str(p)], capture_output=True, text=True,
                           timeout=120, env={**os.environ, **env})
        assert r.returncode == 0, r.stderr
        return r.stderr

    err = run()
    assert err.count("autoprec show: warning: the same thing") == 1, err
    assert err.count("autoprec show: warning: another thing") == 1 and "[autoprec] capturing" in err, err
    assert run(AUTOPREC_LAUNCHED="show", RANK="1") == ""  # a rank other than 0: rank 0 speaks for it
    assert run(AUTOPREC_LAUNCHED="show", RANK="0").count("warning: the same thing") == 1


@pytest.mark.parametrize("compiled, name", [(True, "torch.autocast + torch.compile"),
                                            (False, "torch.autocast eager")])
def test_show_names_the_torch_autocast_the_policy_was_timed_against(tmp_path, capsys, compiled, name):
    """An eager-tuned policy's autocast ratio is against torch.autocast eager; show said
    "torch.autocast" whichever it was."""
    p = tmp_path / "p.json"
    Policy.fp32().with_provenance(baseline="fp32 eager", compiled=compiled).with_measured(
        {"tokens_per_s": 1600.0, "speedup_vs_baseline": 1.0, "speedup_vs_fp32": 1.0,
         "speedup_vs_autocast": 5.17}).save(p)
    assert main(["show", str(p)]) == 0
    assert f"5.17x {name}\n" in capsys.readouterr().out


DROPOUT_MODEL = """\
import torch
from torch import nn

def build_model():
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))

def get_batch(step, device):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).to(device)

def loss_fn(out, batch):
    return out.pow(2).mean()
"""


def test_train_twice_trains_the_same_numbers_and_seed_changes_them(tmp_path):
    """A user ran the same ``autoprec train`` twice on a dropout model (whose build_model seeds
    nothing) and got other losses (4.8572 against 4.8620): ``--seed`` (default 0) seeds the global
    generators before the model is built and before step 0."""
    import json

    from autoprec.cli import main
    from autoprec.policy import Policy

    model = tmp_path / "drop.py"
    model.write_text(DROPOUT_MODEL)
    Policy.fp32().save(tmp_path / "p.json")

    def losses(name, *extra):
        log = tmp_path / f"{name}.jsonl"
        assert main(["train", str(model), "--policy", str(tmp_path / "p.json"), "--steps", "3",
                     "--no-compile", "--log", str(log), *extra]) == 0
        return [json.loads(line)["loss"] for line in log.read_text().splitlines()]

    first = losses("a")
    assert losses("b") == first and len(first) == 3
    assert losses("c", "--seed", "5") != first
