"""``tune`` writes its report and its policy together: a Ctrl-C while the report is written is held
back until the policy is written too, then raised (a late Ctrl-C left a report describing a policy
that was never written, beside an older policy file at ``--out``)."""

from __future__ import annotations

import os
import signal

import pytest

from autoprec._interrupt import catch_sigint
from autoprec.policy import Policy
from autoprec.search import report as report_mod
from autoprec.search import study as study_mod
from tests.conftest import EXAMPLES


def test_ctrl_c_while_the_report_is_written_still_writes_the_policy_then_stops(tmp_path, monkeypatch):
    out = tmp_path / "p.json"
    Policy.default("bf16").save(out)  # an older policy at --out
    real = report_mod.write_report

    def interrupted_report(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C here
        return real(*args, **kwargs)

    monkeypatch.setattr(report_mod, "write_report", interrupted_report)
    with catch_sigint(), pytest.raises(KeyboardInterrupt):
        study_mod.tune(EXAMPLES / "tiny_mlp.py", trials=2, compile=False, traj_steps=0, out=out,
                       report=True, progress=False, quiet=True)
    written = Policy.load(out)
    assert written.provenance.get("study")  # this run's policy, not the older one
    report = (tmp_path / "p.report.md").read_text()
    assert written.summary() in report
