"""The load is checked after the finalists' head-to-head too, before anything is written: a user's
one disturbance during those rounds (the ones that decide) went unreported, and the policy file
recorded 0.07x fp32 eager "a tie within the noise" with a 130x-wide band and no busy warning."""

from __future__ import annotations

from autoprec.cli import main
from autoprec.measure import load
from tests.conftest import MODELS


def test_a_machine_busy_during_the_head_to_head_is_checked_and_strict_timing_writes_nothing(
        tmp_path, monkeypatch, capsys):
    phases = []

    def check(self, phase):
        phases.append(phase)
        if phase == "after the head-to-head" and self.strict:
            raise load.BusyMachineError(f"the machine is busy ({phase}): a burner; --strict-timing refuses "
                                        "to time on a busy machine")
        return None

    monkeypatch.setattr(load.LoadMonitor, "check", check)
    out = tmp_path / "p.json"
    argv = ["tune", str(MODELS / "micro_lm.py"), "--out", str(out), "--trials", "2", "--no-compile",
            "--traj-steps", "0", "--dtypes", "bf16"]
    assert main(argv + ["--strict-timing"]) == 2
    err = capsys.readouterr().err
    assert "the machine is busy (after the head-to-head)" in err, err
    assert phases == ["start", "after baselines", "after trials", "after the head-to-head"], phases
    assert not out.exists() and not (tmp_path / "p.report.md").exists()  # nothing half-written
    phases.clear()
    assert main(argv) == 0  # without --strict-timing the same run writes its policy
    assert phases[-1] == "after the head-to-head" and out.is_file()
