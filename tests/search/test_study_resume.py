"""The same command twice resumes the same study, even when the probe flips (issue 19 item 3):
the default study name does not depend on the probe's verdict, the first run's decision is
recorded in the study (``autoprec:space``), and the second run searches the study's kernels and
says so (autoprec/search/kernel_choice.py ``adopt_study_kernels``, search/storage.py)."""

from __future__ import annotations

import optuna
import pytest
import torch

from autoprec.policy import Policy
from autoprec.search import attrs, kernel_choice
from autoprec.search import study as study_mod
from autoprec.search.probe import probe_kernels as real_probe
from autoprec.search.storage import MEASURE_VERSION, default_study_name
from tests.conftest import EXAMPLES

#: First run: fp16:fp32 at 1.05x fp32 (kept); second run: 1.30x (excluded). bf16:fp32 at 1.0x both.
RUN_1 = {"bf16": 90.0, "bf16:fp32": 1.0, "fp16": 100.0, "fp16:fp32": 1.05}
RUN_2 = {**RUN_1, "fp16:fp32": 1.30}


def _flipping_probe(factors: dict[str, float]):
    """``probe_kernels`` with a synthetic timer: fp32 M·K·N·1e-10 s per call, a kernel that × its factor."""
    def timer(kernel, shape, reps, stop_after_s):
        m, k, n = shape
        return [m * k * n * 1e-10 * factors.get(kernel, 1.0)] * max(reps, 1)

    def probe(device, shapes=(), weights=None, **kw):
        return real_probe(device, shapes, weights=weights, fp8=False, timer=timer)
    return probe


def test_study_name_is_the_commands_not_the_probes():
    """Model stem, graph fingerprint, device type, forced --dtypes (sorted), measurement version."""
    from autoprec.capture import capture

    gm = capture(torch.nn.Linear(4, 4), torch.randn(2, 4))
    auto = default_study_name("m/model.py", gm, torch.device("cpu"))
    assert auto.startswith("autoprec-model-") and auto.endswith(f"-cpu-m{MEASURE_VERSION}")
    forced = default_study_name("m/model.py", gm, torch.device("cpu"), ["fp16", "bf16"])
    assert forced == auto[:-3] + f"-bf16-fp16-m{MEASURE_VERSION}"


def test_same_command_twice_resumes_the_study_when_the_probe_flips(tmp_path, monkeypatch, capsys):
    out = tmp_path / "p.json"
    kw = dict(trials=3, compile=False, traj_steps=0, out=out, report=False, progress=False)
    monkeypatch.setattr(kernel_choice, "probe_kernels", _flipping_probe(RUN_1))
    first = study_mod.tune(EXAMPLES / "tiny_mlp.py", **kw)
    log1 = capsys.readouterr().out
    assert "fp16:fp32" in log1 and first.study.user_attrs[attrs.SPACE]["dtypes"] == ["fp32", "bf16:fp32",
                                                                                     "fp16:fp32"]
    decision = first.study.user_attrs[attrs.SPACE]["probe"]  # the probe's decision, recorded
    near, native = decision["kernels"]["fp16:fp32"], decision["kernels"]["fp16"]
    assert decision["tol"] == pytest.approx(0.10)
    assert near["kept"] and near["ratio"] == pytest.approx(1.05)
    assert not native["kept"] and native["band"][0] == pytest.approx(100.0)
    n = len(first.study.trials)
    # the file records what was measured, so an edit after it shows (Policy.edited_note)
    written = Policy.load(out)
    assert written.provenance["measured_policy"] == written.measured_key and written.edited_note(out) is None

    monkeypatch.setattr(kernel_choice, "probe_kernels", _flipping_probe(RUN_2))
    second = study_mod.tune(EXAMPLES / "tiny_mlp.py", **kw)
    log2 = capsys.readouterr().out
    assert "probe fp16: " in log2 and "-> excluded" in log2  # its own probe dropped fp16:fp32 ...
    assert ("resuming a study created searching fp32, bf16:fp32, fp16:fp32; this run's probe kept "
            "fp32, bf16:fp32: searching the study's kernels") in log2  # ... and searches the study's
    assert second.study.study_name == first.study.study_name
    # a user could tell a resume only from the trial numbers: it says so, with what it kept
    name = first.study.study_name
    said = f"resuming study {name!r}: 3 trial(s) that count kept (of 3 run), 0 more to reach 3"  # 4 queued
    assert said in log2, log2
    assert "resuming study" not in log1
    db = f"sqlite:///{tmp_path / 'p.optuna.db'}"
    assert [s.study_name for s in optuna.get_all_study_summaries(db)] == [first.study.study_name]
    assert len(optuna.load_study(study_name=first.study.study_name, storage=db).trials) == n  # none re-run
    assert second.study.user_attrs[attrs.SPACE]["probe"] == decision  # the first run's stays


def test_a_trial_cut_short_by_ctrl_c_is_queued_again_once_and_reported_as_interrupted():
    """A user's Ctrl-C left a trial FAIL with partial numbers and no note, and the resumed tune
    sampled another policy in its place: opening the study queues its parameters again (once), and
    the report's row says it was interrupted."""
    import optuna

    from autoprec.search import attrs
    from autoprec.search.report import INTERRUPTED_NOTE, trial_rows
    from autoprec.search.workers import requeue_interrupted, retry_of

    study = optuna.create_study(directions=["maximize", "minimize", "minimize"])
    dist = {"lm_head": optuna.distributions.CategoricalDistribution(["fp32", "bf16"])}
    study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL, params={"lm_head": "fp32"},
                                              distributions=dist, user_attrs={attrs.INTERRUPTED: True}))
    failed = {attrs.ERROR: "non-finite loss"}
    study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL, params={"lm_head": "bf16"},
                                              distributions=dist, user_attrs=failed))
    assert requeue_interrupted(study) == [0]  # the interrupted one only, not the one that failed
    waiting = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert len(waiting) == 1 and waiting[0].params == {"lm_head": "fp32"} and retry_of(waiting[0]) == [0]
    assert requeue_interrupted(study) == []  # once
    rows = {r["number"]: r for r in trial_rows(study)}
    assert rows[0]["error"] == INTERRUPTED_NOTE and rows[1]["error"] == "non-finite loss"
