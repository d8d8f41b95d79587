"""Bad command-line input fails before any work, naming the option; Ctrl-C is never lost;
studies are not resumed across search spaces; eager selection re-measures all-fp32."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import weakref

import optuna
import pytest

from autoprec import Policy, cli
from autoprec._interrupt import catch_sigint, check, interrupted
from autoprec.cli import main
from autoprec.errors import LossScaleError, SearchError
from autoprec.search import attrs
from autoprec.search import storage as storage_mod
from autoprec.search.space import SearchSpace
from tests.conftest import EXAMPLES, MODELS

MICRO = str(MODELS / "micro_lm.py")


@pytest.mark.parametrize("argv, option", [
    (["tune", MICRO, "--trials", "0"], "--trials"),
    (["tune", MICRO, "--trials", "-1"], "--trials"),
    (["tune", MICRO, "--timeout", "0"], "--timeout"),
    (["tune", MICRO, "--timeout", "nan"], "--timeout"),
    (["tune", MICRO, "--finalists", "0"], "--finalists"),
    (["tune", MICRO, "--traj-steps", "-5"], "--traj-steps"),
    (["train", MICRO, "--policy", "p.json", "--steps", "0"], "--steps"),
    (["train", MICRO, "--policy", "p.json", "--max-grad-norm", "-1"], "--max-grad-norm"),
    (["bench", MICRO, "--policy", "p.json", "--steps", "0"], "--steps"),
    (["bench", MICRO, "--policy", "p.json", "--warmup", "x"], "--warmup"),
])
def test_bad_numbers_exit_2_naming_the_option(argv, option, capsys, tmp_path, monkeypatch):
    """Counts and durations out of range are rejected by the parser (exit 2) before anything runs."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert f"argument {option}" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def _tune_rc(argv, capsys):
    rc = main(["tune", MICRO, "--trials", "1", "--no-compile", *argv])
    return rc, capsys.readouterr().err


def test_out_is_a_directory(tmp_path, capsys):
    """--out naming a directory fails before the search (it used to fail at the final rename)."""
    rc, err = _tune_rc(["--out", str(tmp_path)], capsys)
    assert rc == 2 and f"--out {tmp_path}: is a directory" in err
    assert list(tmp_path.iterdir()) == []


def test_out_under_a_file(tmp_path, capsys):
    """--out below a regular file: the message names the path, nothing is created."""
    f = tmp_path / "model.py"
    f.write_text("")
    rc, err = _tune_rc(["--out", str(f / "p.json")], capsys)
    assert rc == 2 and f"--out {f / 'p.json'}: cannot write there" in err
    assert [p.name for p in tmp_path.iterdir()] == ["model.py"]


def test_out_in_an_uncreatable_directory(tmp_path, capsys):
    """A parent that cannot be created (a file in the way) is named; nothing is left behind."""
    (tmp_path / "f").write_text("")
    rc, err = _tune_rc(["--out", str(tmp_path / "a" / "b" / "p.json"), "--storage",
                        f"sqlite:///{tmp_path / 'f' / 'x' / 's.db'}"], capsys)
    assert rc == 2 and "cannot create the directory" in err and str(tmp_path / "f" / "x") in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_bad_storage_url(tmp_path, capsys):
    """An unknown database dialect fails before the model is built, naming the URL."""
    rc, err = _tune_rc(["--out", str(tmp_path / "p.json"), "--storage", "bogus://x"], capsys)
    assert rc == 2 and "--storage 'bogus://x': not a usable database URL" in err
    rc, err = _tune_rc(["--out", str(tmp_path / "p.json"), "--storage", "study.db"], capsys)
    assert rc == 2 and "use sqlite:///study.db" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the swallowed one
def test_swallowed_ctrl_c_is_raised_again():
    """SIGINT that lands in a weakref callback is printed and ignored by Python; check() raises it
    again at the next safe point."""
    class Obj:
        pass

    hits = []

    def callback(_ref):
        hits.append(1)
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs here; Python ignores its exception

    with catch_sigint():
        o = Obj()
        ref = weakref.ref(o, callback)
        del o
        assert hits == [1] and ref() is None  # still running: the KeyboardInterrupt was swallowed
        assert interrupted()
        with pytest.raises(KeyboardInterrupt):
            check()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_error_after_ctrl_c_is_reported_as_the_interrupt(monkeypatch, capsys):
    """An exception raised on the way out of an interrupt (Optuna has turned one into an
    UnboundLocalError) exits 130 with the interrupt message, not a traceback."""
    def cmd(_args):
        try:
            os.kill(os.getpid(), signal.SIGINT)
        except KeyboardInterrupt:
            raise UnboundLocalError("cannot access local variable 'updated_state'") from None
        return 0

    monkeypatch.setitem(cli._COMMANDS, "show", cmd)
    assert main(["show", "p.json"]) == 130
    assert "autoprec show: interrupted after" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the swallowed one
def test_command_that_ran_on_after_a_swallowed_ctrl_c_exits_130(monkeypatch, capsys):
    """A Ctrl-C that Python swallowed (weakref callback) and the command then finishing: the user
    asked it to stop, so the exit code says so (its files are complete: written atomically)."""
    class Obj:
        pass

    def cmd(_args):
        o = Obj()
        ref = weakref.ref(o, lambda _r: os.kill(os.getpid(), signal.SIGINT))
        del o
        assert ref() is None
        return 0

    monkeypatch.setitem(cli._COMMANDS, "show", cmd)
    assert main(["show", "p.json"]) == 130
    assert "autoprec show: interrupted after" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_loss_scale_error_exits_1(monkeypatch, capsys):
    """A run that stops because the loss scale collapsed is a failure (1), not bad input (2)."""
    def cmd(_args):
        raise LossScaleError("forward produced non-finite values at node up/linear#0")

    monkeypatch.setitem(cli._COMMANDS, "show", cmd)
    assert main(["show", "p.json"]) == 1
    assert "non-finite values at node up/linear#0" in capsys.readouterr().err


def test_dtype_choices_are_in_a_fixed_order():
    """Two probes that order bf16/fp16 differently by speed give the same categorical choices,
    so a re-run resumes the study instead of failing in Optuna."""
    assert (SearchSpace(["fp16", "bf16"]).dtypes == SearchSpace(["bf16", "fp16"]).dtypes
            == ["fp32", "bf16", "fp16"])
    assert SearchSpace(["fp16", "bf16"]).low_dtypes[0] == "fp16"  # fastest first is kept where it matters


def test_study_of_another_search_space_is_not_resumed(tmp_path):
    """A study sampled with other dtypes (e.g. other --dtypes) is refused with a message naming it
    and both dtype lists, already before the baselines (read-only precheck); an unstamped old
    study is read off its trials' distributions."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    storage_mod.precheck_study(url, "s", SearchSpace(["bf16"]))  # no database yet: passes, creates nothing
    assert list(tmp_path.iterdir()) == []
    st = storage_mod.open_study(url, "s")
    storage_mod.check_study(st, "mem", SearchSpace([]))
    st.optimize(lambda t: (SearchSpace([]).suggest(t), (1.0, 0.0, 0.0))[1], n_trials=1)
    storage_mod.check_study(st, "mem", SearchSpace([]))  # same space: resumes
    with pytest.raises(SearchError, match=r"study 's' in mem searched the dtypes fp32; this run searches "
                                          r"fp32, bf16 .*another --study-name"):
        storage_mod.check_study(st, "mem", SearchSpace(["bf16"]))
    with pytest.raises(SearchError, match=f"study 's' in {url} searched the dtypes fp32;"):
        storage_mod.precheck_study(url, "s", SearchSpace(["bf16"]))
    storage_mod.precheck_study(url, "other", SearchSpace(["bf16"]))  # another study name: passes
    st.set_user_attr(attrs.SPACE, None)  # as a study from before the stamp
    with pytest.raises(SearchError, match="searched the dtypes fp32;"):
        storage_mod.check_study(st, "mem", SearchSpace(["bf16"]))


@pytest.mark.heavy
def test_autocast_overflow_with_max_drift_still_writes_a_policy(tmp_path):
    """C01 with fp16 searched: torch.autocast's own drift is infinite, so --max-drift is required;
    given it, the tune writes a valid policy (fp32 matmul) whose measured block leaves the infinite
    autocast drift out instead of failing at the very end."""
    model = MODELS / "c01_overflow.py"
    out = tmp_path / "p.json"
    cmd = [sys.executable, "-m", "autoprec.cli", "tune", str(model), "--out", str(out), "--trials", "4",
           "--no-compile", "--dtypes", "fp16", "--traj-steps", "0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "drift budget is not finite" in r.stderr and "--max-drift" in r.stderr
    assert not out.exists() and not (tmp_path / "p.optuna.db").exists()
    r = subprocess.run(cmd + ["--max-drift", "0.01"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    pol = Policy.load(out)
    assert "autocast_grad_rel_l2" not in pol.measured and pol.measured["grad_rel_l2"] <= 0.01
    study = optuna.load_study(study_name=pol.provenance["study"],
                              storage=f"sqlite:///{tmp_path / 'p.optuna.db'}")
    lowered = [t for t in study.trials if "fp16" in json.dumps(t.user_attrs.get(attrs.POLICY))]
    assert any(t.values is None or not t.values[1] <= 0.01 for t in lowered)  # the overflow was caught


def test_train_reports_a_module_rule_that_matches_no_node(tmp_path):
    """docs/architecture.md#policy-file: a rule that matches no node is reported; the CLI prints it as its own
    warning (no Python source line), and training goes on."""
    pol = Policy.from_dict({**Policy.fp32().to_dict(),
                            "rules": [{"module": "model.layers.*", "op_class": "matmul", "dtype": "bf16"}]})
    pol.save(tmp_path / "p.json")
    r = subprocess.run([sys.executable, "-m", "autoprec.cli", "train", MICRO, "--policy",
                        str(tmp_path / "p.json"), "--steps", "1", "--no-compile", "--force"],
                       capture_output=True, text=True, timeout=300)
    # --force: a policy none of whose rules matches is refused otherwise
    # (tests/applied/test_foreign_policy.py)
    err = r.stderr
    assert r.returncode == 0, err[-2000:]
    assert (f"autoprec train: warning: {tmp_path / 'p.json'}: rules[0] model.layers.*:matmul->bf16 matches "
            "no node of this graph"
            in err), err
    assert "warnings.warn" not in err


def test_bench_error_names_the_policy_file(tmp_path, capsys):
    """A policy that does not fit the model fails bench with the policy file named, as in train/show."""
    p = tmp_path / "int_node.json"  # a node rule on an integer node (ids.roll): the assign pass refuses it
    Policy.from_dict({**Policy.fp32().to_dict(), "rules": [{"node": "roll#0", "dtype": "fp16"}]}).save(p)
    rc = main(["bench", MICRO, "--policy", str(p), "--configs", "policy_eager", "--steps", "1", "--warmup",
               "0"])
    err = capsys.readouterr().err
    assert rc == 2 and f"autoprec bench: error: {p}: [assign_dtypes]" in err and "roll#0" in err, err


def test_bench_refuses_the_policy_of_another_model_as_train_does(tmp_path, capsys):
    """A policy whose module rules match no node of this model (tuned on another) was timed by bench
    as this model's policy, exit 0; now bench refuses it as train does (exit 2, naming the file and
    --force), and with --force it measures it, warning that it was tuned on another graph."""
    p = tmp_path / "other.json"
    Policy.from_dict({**Policy.default("bf16").to_dict(),
                      "rules": [{"module": "model.layers.0.*", "op_class": "matmul", "dtype": "fp32"}],
                      "provenance": {"model": "other.py", "graph_fingerprint": "0123456789abcdef"}}).save(p)
    argv = ["bench", MICRO, "--policy", str(p), "--configs", "policy_eager", "--steps", "1", "--warmup", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"autoprec bench: error: {p}: none of its 1 module/node rule matches" in err and "--force" in err
    assert main(argv + ["--force"]) == 0
    out = capsys.readouterr().out
    assert f"warning: {p} was tuned on other.py (graph 0123456789abcdef), not on this model" in out


def test_checkpoint_every_without_a_checkpoint_path_is_refused(capsys):
    """``train --checkpoint-every 1`` without ``--checkpoint`` saved nothing and exited 0."""
    assert main(["train", MICRO, "--policy", "p.json", "--checkpoint-every", "1"]) == 2
    assert "--checkpoint-every needs --checkpoint PATH" in capsys.readouterr().err


def test_storage_that_is_not_a_database(tmp_path, capsys):
    """An existing file that is not SQLite (as --storage, or the default database beside --out),
    a directory as the database, and a server URL whose driver is missing or server unreachable
    all fail before the model is measured, naming the file or URL; nothing is overwritten."""
    junk = tmp_path / "notdb.db"
    junk.write_text("junk")
    rc, err = _tune_rc(["--out", str(tmp_path / "p.json"), "--storage", f"sqlite:///{junk}"], capsys)
    assert rc == 2 and f"--storage: {junk} exists and is not a SQLite database" in err
    (tmp_path / "q.optuna.db").write_text("junk")
    rc, err = _tune_rc(["--out", str(tmp_path / "q.json")], capsys)
    assert rc == 2 and f"--out: {tmp_path / 'q.optuna.db'} exists and is not a SQLite database" in err
    (tmp_path / "sdir").mkdir()
    rc, err = _tune_rc(["--out", str(tmp_path / "r.json"), "--storage", f"sqlite:///{tmp_path / 'sdir'}"],
                       capsys)
    assert rc == 2 and "is a directory, not a SQLite study database" in err
    rc, err = _tune_rc(["--out", str(tmp_path / "s.json"), "--storage", "postgresql://u@nohost.invalid/db"],
                       capsys)
    assert rc == 2 and "--storage 'postgresql://u@nohost.invalid/db': cannot connect" in err
    assert junk.read_text() == "junk" and (tmp_path / "q.optuna.db").read_text() == "junk"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notdb.db", "q.optuna.db", "sdir"]


def test_out_with_a_trailing_slash_names_a_directory(tmp_path, capsys):
    """`--out new/` means a directory: refused, instead of writing a policy file called `new`."""
    rc, err = _tune_rc(["--out", str(tmp_path / "new") + "/"], capsys)
    assert rc == 2 and "is a directory; give a file path" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("extra, says", [
    ([], "with --checkpoint, --resume continues from the last checkpoint"),
    (["--compare", "fp32,autocast"], "kept under --out-dir's compare_state/: the same command with --resume"),
])
def test_train_interrupt_says_how_to_resume(monkeypatch, capsys, extra, says):
    """`train` and `train --compare` keep their progress in different places (--checkpoint, or
    --out-dir's compare_state/): the interrupt message names the right one."""
    def cmd(_args):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli._COMMANDS, "train", cmd)
    assert main(["train", "m.py", "--policy", "p.json", *extra]) == 130
    err = capsys.readouterr().err
    assert "autoprec train: interrupted after" in err and says in err


@pytest.mark.parametrize("cmd, option, where, says", [
    ("train", "--checkpoint", "under_file", "cannot create the directory"),
    ("train", "--checkpoint", "dir", "is a directory; give a file path"),
    ("train", "--log", "dir", "is a directory; give a file path"),
    ("compare", "--out-dir", "file", "cannot write there"),
    ("bench", "--json", "dir", "is a directory; give a file path"),
    ("bench", "--md", "under_file", "cannot create the directory"),
    ("train", "--log", "empty", "an empty path"),
    ("compare", "--out-dir", "empty", "an empty path"),
    ("train", "--checkpoint", "empty", "an empty path"),
    ("bench", "--json", "model", "exists and is not a bench JSON file, which writing there would change"),
    ("bench", "--md", "model", "exists and is not a bench table"),
    ("train", "--log", "model", "exists and is not a JSONL log"),
])
def test_train_and_bench_check_their_output_paths_before_any_work(tmp_path, capsys, monkeypatch, cmd, option,
                                                                  where, says):
    """A user's ``train --checkpoint`` whose parent was a file ran all 200 steps, then failed at the
    first save with a traceback (the trained weights lost); ``bench --json DIR`` measured everything,
    then failed. Each output path is now checked as tune's ``--out`` is: exit 2 naming the option,
    before the model is built or anything is timed, and nothing is left behind."""
    from autoprec.commands import bench, train

    def no_work(*a, **k):
        raise AssertionError("the work started before the output path was checked")

    monkeypatch.setattr(train, "train", no_work)
    monkeypatch.setattr(bench, "run_bench", no_work)
    monkeypatch.setattr(cli, "_validate_model", no_work)
    pol = tmp_path / "p.json"
    Policy.fp32().save(pol)
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    (tmp_path / "d").mkdir()
    model = tmp_path / "model.py"  # a user's file that bench --json replaced, and train --log appended to
    model.write_text((EXAMPLES / "tiny_mlp.py").read_text())
    path = {"under_file": blocker / "new" / "out.x", "dir": tmp_path / "d", "file": blocker,
            "empty": "", "model": model}[where]
    argv = {"train": ["train", str(EXAMPLES / "tiny_mlp.py"), "--policy", str(pol), "--steps", "2"],
            "compare": ["train", str(EXAMPLES / "tiny_mlp.py"), "--policy", str(pol), "--compare", "fp32"],
            "bench": ["bench", str(EXAMPLES / "tiny_mlp.py"), "--policy", str(pol)]}[cmd]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert main([*argv, option, str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{option} {path if path else repr('')}" in err and says in err, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    assert model.read_text() == (EXAMPLES / "tiny_mlp.py").read_text()


def test_output_files_a_command_wrote_may_be_replaced(tmp_path):
    """What bench and train write themselves (a rerun's) is not refused: bench JSON, a bench table,
    a JSONL log, an empty file."""
    from autoprec.cli_paths import BENCH_MD_MARK, Output, bench_json, bench_table, jsonl_log, output_paths

    (tmp_path / "b.json").write_text(json.dumps({"machine": {}, "autoprec": "0", "configs": {}}))
    (tmp_path / "b.md").write_text(f"{BENCH_MD_MARK}\nnote\n\n| config | dtype |\n|---|---|\n")
    (tmp_path / "l.jsonl").write_text('{"step": 0}\n')
    (tmp_path / "empty.md").write_text("")
    with output_paths(Output("--json", str(tmp_path / "b.json"), "b.json", bench_json, "x"),
                      Output("--md", str(tmp_path / "b.md"), "b.md", bench_table, "x"),
                      Output("--md", str(tmp_path / "empty.md"), "b.md", bench_table, "x"),
                      Output("--log", str(tmp_path / "l.jsonl"), "l.jsonl", jsonl_log, "x")):
        pass
    assert not bench_json(str(tmp_path / "l.jsonl")) and not jsonl_log(str(tmp_path / "b.md"))
    # a user's Markdown with a table, a one-line policy file: not ours (a bench replaced the one, a
    # train --log appended to the other)
    (tmp_path / "NOTES.md").write_text("# Notes\n\n| config | value |\n|---|---|\n")
    (tmp_path / "p.json").write_text(Policy.fp32().to_json().replace("\n", "") + "\n")
    assert not bench_table(str(tmp_path / "NOTES.md")) and not jsonl_log(str(tmp_path / "p.json"))
