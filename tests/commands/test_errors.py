"""Bad input through the CLI: exit code 2, one message naming the file and the problem, nothing
written (no policy file, no study database, no log, no checkpoint)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from autoprec.cli import main
from autoprec.policy import Policy, Rule

GOOD = """\
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        idx = h.argmax(-1)
        return (h * h).mean() + 0.0 * idx.float().mean()

def build_model():
    torch.manual_seed(0)
    return Net()

def get_batch(step, device):
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(step)).to(device)

def loss_fn(output, batch):
    return output
"""

# name: (text replaced in GOOD, replacement, expected in the message)
BAD = {
    "build_model_int": ("    return Net()", "    return 3", "build_model returned int"),
    "build_model_raises": ("    return Net()", "    raise RuntimeError('no weights')",
                           "build_model() raised RuntimeError: no weights"),
    "get_batch_int": ("    return torch.randn(2, 4, "
                      "generator=torch.Generator().manual_seed(step)).to(device)",
                      "    return 7", "get_batch(0) returned int; expected a Tensor, tuple, list or dict"),
    "get_batch_random": ("generator=torch.Generator().manual_seed(step)", "", "deterministic"),
    "dict_bad_key": ("    return torch.randn(2, 4, generator=torch.Generator().manual_seed(step)).to(device)",
                     "    return {'inputs': torch.ones(2, 4, device=device)}", "key 'inputs'"),
    "loss_item": ("    return output\n", "    return output.item()\n", "loss_fn returned float"),
    "loss_vector": ("    return output\n", "    return output.repeat(3)\n", "expected a scalar"),
    "loss_bool": ("    return output\n", "    return output > 0\n", "floating-point"),
    "loss_detached": ("    return output\n", "    return output.detach()\n", "does not require grad"),
    "optimizer_list": ("def loss_fn", "def make_optimizer(params):\n    return [1]\n\ndef loss_fn",
                       "make_optimizer returned list"),
}


def write_model(tmp_path: Path, text: str = GOOD, name: str = "model.py") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_entry_point_results_exit_2(tmp_path, capsys, name):
    old, new, expected = BAD[name]
    assert old in GOOD
    model = write_model(tmp_path, GOOD.replace(old, new))
    code = main(["tune", str(model), "--out", str(tmp_path / "out" / "p.json"), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert str(model) in err and expected in err, err
    assert "Traceback" not in err
    assert files(tmp_path) == ["model.py"]


def test_tune_bad_args_into_missing_dir_leaves_no_directory(tmp_path, capsys):
    model = write_model(tmp_path)
    code = main(["tune", str(model), "--out", str(tmp_path / "a" / "b" / "p.json"), "--max-drift", "-1",
                 "--device", "cpu"])
    assert code == 2 and "--max-drift" in capsys.readouterr().err
    assert files(tmp_path) == ["model.py"]


def test_make_parents_creates_missing_directories(tmp_path):
    from autoprec.cli_paths import make_parents, remove_if_empty

    made = make_parents(str(tmp_path / "a" / "b" / "p.json"), None)
    assert (tmp_path / "a" / "b").is_dir() and made == [tmp_path / "a", tmp_path / "a" / "b"]
    remove_if_empty(made)
    assert files(tmp_path) == []


def test_report_bare_path_storage(tmp_path, capsys):
    db = tmp_path / "x.db"
    code = main(["report", "--storage", str(db), "--study-name", "s", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and str(db) in err and f"sqlite:///{db}" in err and "Traceback" not in err
    assert files(tmp_path) == []


def test_report_missing_sqlite_file_is_not_created(tmp_path, capsys):
    db = tmp_path / "nope.db"
    code = main(["report", "--storage", f"sqlite:///{db}", "--study-name", "s", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and str(db) in err and "no such study database" in err
    assert files(tmp_path) == []


def write_policy(tmp_path: Path, rules: list[Rule], **provenance) -> Path:
    path = tmp_path / "policy.json"
    Policy(default_dtype="fp32", rules=rules, provenance=provenance).save(path)
    return path


def test_fp8_rule_on_non_matmul_is_refused_at_load(tmp_path, capsys):
    """fp8_e4m3 is a matmul compute dtype: a policy giving it to sensitive ops is refused when it is
    loaded (PolicyError, exit 2, naming the file and the field), not later by the assign pass."""
    model = write_model(tmp_path)
    pol = tmp_path / "fp8.json"
    pol.write_text(json.dumps({**Policy.fp32().to_dict(), "schema_version": 2,
                               "rules": [{"op_class": "sensitive", "dtype": "fp8_e4m3"}]}))
    before = files(tmp_path)
    code = main(["train", str(model), "--policy", str(pol), "--steps", "1", "--no-compile", "--device", "cpu",
                 "--log", str(tmp_path / "log.jsonl"), "--checkpoint", str(tmp_path / "ck.pt")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert str(pol) in err and "rules[0].dtype" in err and "fp8_e4m3" in err and "matmul compute dtype" in err
    assert files(tmp_path) == before


def test_rule_on_integer_node_names_policy_file(tmp_path, capsys):
    model = write_model(tmp_path)
    pol = write_policy(tmp_path, [Rule(dtype="bf16", node="argmax#0")])
    code = main(["show", str(pol), "--model", str(model)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count(str(pol)) == 1 and "non-float node" in err and "argmax" in err


def test_rule_on_graph_input_warns_as_input(tmp_path, capsys):
    model = write_model(tmp_path)
    pol = write_policy(tmp_path, [Rule(dtype="bf16", node="x")])
    with pytest.warns(UserWarning, match="'x', a graph input; inputs are never cast"):
        assert main(["show", str(pol), "--model", str(model)]) == 0


def test_train_fingerprint_warning_then_resume_past_steps(tmp_path, capsys):
    model = write_model(tmp_path)
    pol = write_policy(tmp_path, [], model="other.py", graph_fingerprint="0123456789abcdef")
    ck = tmp_path / "ck.pt"
    args = ["train", str(model), "--policy", str(pol), "--steps", "1", "--no-compile", "--device", "cpu",
            "--checkpoint", str(ck)]
    assert main(args) == 0
    cap = capsys.readouterr()
    assert "warning" in cap.err and "other.py" in cap.err and str(model) in cap.err
    assert "final loss (the last step not skipped)" in cap.out
    before, stamp = files(tmp_path), os.stat(ck).st_mtime_ns
    log = tmp_path / "log.jsonl"
    code = main([*args, "--resume", "--log", str(log)])
    cap = capsys.readouterr()
    assert code == 0, cap.err  # a finished run resumed is a no-op (issue 20, item 5)
    line = f"checkpoint {ck} is at step 1 of --steps 1: the run is complete, nothing to do"
    assert cap.out.splitlines() == [line]
    assert files(tmp_path) == before and os.stat(ck).st_mtime_ns == stamp
    # Both checkpoint checks come before the model file is even loaded (docs/usage.md#train): a
    # model that can no longer be built changes neither the no-op nor the refusal.
    model.write_text(model.read_text() + "\ndef build_model():\n    raise RuntimeError('built')\n")
    assert main([*args, "--resume"]) == 0
    assert capsys.readouterr().out.splitlines() == [line]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {ck} holds a run at step 1" in err and "built" not in err, err



def test_report_creates_out_directory(tmp_path, capsys):
    import optuna

    storage = f"sqlite:///{tmp_path / 's.db'}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    optuna.create_study(study_name="s", storage=storage).optimize(lambda t: t.suggest_float("a", 0, 1),
                                                                  n_trials=1)
    assert main(["report", "--storage", storage, "--study-name", "s", "--out",
                 str(tmp_path / "new" / "r")]) == 0
    assert any((tmp_path / "new").iterdir())
    assert "no tune of this study has finished: the report lists its trials only" in capsys.readouterr().err


def test_report_without_study_name(tmp_path, capsys):
    """--study-name may be left out when the storage holds one study; with two it is required,
    and the message lists them."""
    import optuna

    storage = f"sqlite:///{tmp_path / 's.db'}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    optuna.create_study(study_name="s", storage=storage).optimize(lambda t: t.suggest_float("a", 0, 1),
                                                                  n_trials=1)
    assert main(["report", "--storage", storage, "--out", str(tmp_path / "r")]) == 0
    assert any(p.name.startswith("r") for p in tmp_path.iterdir())
    optuna.create_study(study_name="t", storage=storage)
    assert main(["report", "--storage", storage, "--out", str(tmp_path / "r2")]) == 2
    assert "holds 2 studies; pick one with --study-name: ['s', 't']" in capsys.readouterr().err


#: The CLI's exit code per error class (docs/architecture.md#house-style: bad input 2, a loss
#: scale that cannot recover 1).
EXIT_CODES = {"ModelSpecError": 2, "CaptureError": 2, "PassError": 2, "PolicyError": 2, "SearchError": 2,
              "LossScaleError": 1}


def test_each_error_exits_with_its_code_as_its_docstring_says(monkeypatch, capsys):
    """The CLI turns each error class into its exit code, with one ``error:`` line, and the class's
    docstring names that code."""
    import re

    from autoprec import cli, errors

    classes = [c for c in vars(errors).values()
               if isinstance(c, type) and issubclass(c, errors.AutoprecError)
               and c is not errors.AutoprecError]
    assert {c.__name__ for c in classes} >= set(EXIT_CODES)
    for cls in classes:
        doc = " ".join(cls.__doc__.split())
        documented = re.findall(r"exit(?:s with code)? (\d)", doc)
        assert len(documented) == 1, (cls, doc)
        assert int(documented[0]) == EXIT_CODES.get(cls.__name__, 2), cls

        def raiser(_args, cls=cls):
            raise cls("boom")

        monkeypatch.setitem(cli._COMMANDS, "show", raiser)
        assert cli.main(["show", "p.json"]) == int(documented[0]), cls
        assert "autoprec show: error: boom" in capsys.readouterr().err


def test_report_of_a_tuned_study_has_the_final_choice(tmp_path, capsys):
    """``autoprec report`` on a study ``tune`` finished shows what tune's own report shows beyond
    the trials: the decision, the side-by-side table and the time per phase (it listed the eager
    trials only, so the headline ratio was missing); a study no tune finished says so."""
    from tests.conftest import MODELS

    out = tmp_path / "p.json"
    assert main(["tune", str(MODELS / "micro_lm.py"), "--out", str(out), "--trials", "2", "--no-compile",
                 "--traj-steps", "0", "--dtypes", "bf16"]) == 0
    tuned = (tmp_path / "p.report.md").read_text()
    capsys.readouterr()
    storage = f"sqlite:///{tmp_path / 'p.optuna.db'}"
    assert main(["report", "--storage", storage, "--out", str(tmp_path / "r")]) == 0
    again = (tmp_path / "r.report.md").read_text()
    for section in ("## Side by side", "## Where tuning time went", "| autoprec policy (eager) |"):
        assert section in tuned and section in again, section
    assert "no tune of this study has finished" not in capsys.readouterr().err


def test_train_on_an_empty_batch_names_the_get_batch_call_and_exits_2(tmp_path, capsys):
    """``get_batch(3)`` returning 0 rows ended ``autoprec train`` in a traceback (exit 1) whose advice,
    "skip it in the loop", a CLI user cannot follow; the message names the call and the fix."""
    text = GOOD.replace("    return torch.randn(2, 4, generator",
                        "    rows = 0 if step == 3 else 2\n    return torch.randn(rows, 4, generator")
    model = write_model(tmp_path, text)
    pol = write_policy(tmp_path, [])
    argv = ["train", str(model), "--policy", str(pol), "--steps", "5", "--no-compile", "--device", "cpu"]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{model}: get_batch(3) returned an empty batch (batch has shape (0, 4))" in err, err
    assert "drop_last=True" in err and "Traceback" not in err


def test_train_on_a_batch_of_another_structure_names_the_get_batch_call_and_exits_2(tmp_path, capsys):
    """``get_batch(2)`` returning ``ids.tolist()`` where the others return a tensor trained two steps,
    then ended ``autoprec train`` in a traceback (exit 1) advising to "apply the policy with an
    example batch that holds 3 positional argument(s) more"; the message names the call, what it
    returned and what ``get_batch(0)`` did."""
    text = GOOD.replace("    return torch.randn(2, 4, generator",
                        "    if step == 2:\n        return torch.randn(2, 4).tolist()\n"
                        "    return torch.randn(2, 4, generator")
    model = write_model(tmp_path, text)
    pol = write_policy(tmp_path, [])
    log = tmp_path / "train.jsonl"
    code = main(["train", str(model), "--policy", str(pol), "--steps", "4", "--no-compile", "--device", "cpu",
                 "--log", str(log)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert (f"{model}: get_batch(2) returned list of 2 items, where get_batch(0) returned "
            "Tensor(shape=(2, 4), dtype=torch.float32); every batch must have the first one's "
            "structure") in err
    assert "Traceback" not in err and "positional argument" not in err


@pytest.mark.parametrize("content", ['{"pre": "existing"}', "not json at all\n", None],
                         ids=["json", "text", "model"])
def test_tune_refuses_an_out_that_is_not_a_policy_file_and_keeps_it(tmp_path, capsys, content):
    """A user test's ``--out`` held a JSON file of its own, which a finished tune replaced without a
    word; ``--out model.py`` would lose the model file the same way. Refused before any work."""
    model = write_model(tmp_path)
    out = model if content is None else tmp_path / "out.json"
    if content is not None:
        out.write_text(content)
    before = out.read_bytes()
    assert main(["tune", str(model), "--out", str(out), "--trials", "2", "--no-compile"]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: exists and is not a policy file" in err and "give another path" in err, err
    assert out.read_bytes() == before and not list(tmp_path.glob("*.db"))
    # the Python API, "the tune command as a function", keeps it too (a user test's tune(out=model) lost it)
    import autoprec

    with pytest.raises(autoprec.PolicyError, match="exists and is not a policy file"):
        autoprec.tune(model, out=out, trials=2, compile=False)
    assert out.read_bytes() == before


def test_train_notes_a_policy_file_changed_since_tune_measured_it(tmp_path, capsys):
    model = write_model(tmp_path)
    tuned = Policy.fp32().with_measured({"grad_rel_l2": 1e-7})
    tuned = tuned.with_provenance(measured_policy=tuned.measured_key)
    pol = tmp_path / "p.json"
    Policy.from_dict({**tuned.to_dict(), "default_dtype": "bf16"}).save(pol)  # edited by hand
    assert main(["train", str(model), "--policy", str(pol), "--steps", "1", "--no-compile"]) == 0
    err = capsys.readouterr().err
    assert f"autoprec train: warning: {pol} was changed since tune measured it" in err, err
