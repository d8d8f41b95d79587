"""Load detection (autoprec/measure/load.py, docs/architecture.md#measurements) with a real burner:
a second process doing 1-thread fp32 matmuls on the same cores, as another user's job would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest
import torch

from autoprec.measure.load import BusyMachineError, LoadMonitor
from tests.conftest import MODELS

BURNER = ("import time, torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\n"
          "end = time.time() + {s}\nwhile time.time() < end:\n    a @ a\n")

pytestmark = [pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads Linux /proc"),
              pytest.mark.serial]  # reads the load: run alone (make test)


@contextmanager
def burner(seconds: float = 20.0):
    """A matmul loop in another process (not a child: a launcher that exits at once leaves it
    orphaned, so this process does not count it as its own), killed on the way out."""
    code = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
            f"{BURNER.format(s=seconds)!r}], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
            "print(p.pid)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    pid = int(out.stdout.strip())
    try:
        time.sleep(2.0)  # torch imported, looping
        yield pid
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_burner_makes_the_machine_busy_and_its_end_settles_the_calibration():
    mon = LoadMonitor(torch.device("cpu"))
    with burner():
        busy = mon.check("with burner")
    assert busy.busy, busy.describe()
    assert busy.others() > 0.5, busy.describe()  # the burner's core, read during the sleep
    time.sleep(1.0)
    idle = mon.check("after burner")
    # the load average lags by a minute: judge the quiet machine by the calibration alone
    assert idle.slowdown < 3.0, idle.describe()


def test_strict_busy_check_raises_naming_the_load():
    mon = LoadMonitor(torch.device("cpu"), strict=True)
    with burner(), pytest.raises(BusyMachineError, match="load average .* cores"):
        mon.check("start")


def test_strict_timing_tune_exits_2_naming_the_load(tmp_path):
    out = tmp_path / "p.json"
    with burner():
        r = subprocess.run([sys.executable, "-m", "autoprec.cli", "tune",
                            str(MODELS / "micro_lm.py"), "--out", str(out), "--trials", "2",
                            "--no-compile", "--traj-steps", "0", "--strict-timing"], capture_output=True,
                           text=True, cwd=tmp_path, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "busy" in r.stderr and "load average" in r.stderr and "--strict-timing" in r.stderr, \
        r.stderr[-2000:]
    assert not out.exists()


def test_a_load_average_left_by_processes_that_ended_is_not_busy(monkeypatch):
    """Right after another run the 1-minute load average still says ~1 core busy for a minute or
    two; when the short and the longer sample both see other processes idle, it is left out
    (a tune with --strict-timing started right after another was refused). A longer sample that
    sees the load keeps the machine busy."""
    from autoprec.measure import load

    samples = []
    monkeypatch.setattr(load.os, "getloadavg", lambda: (1.9, 1.0, 0.5))
    monkeypatch.setattr(load, "_others_during_sleep", lambda s: samples.append(s) or 0.0)
    mon = LoadMonitor(torch.device("cpu"), strict=True)
    c = mon.check("start")
    assert not c.busy and c.stale_avg and samples == [load.SAMPLE_S, load.CONFIRM_S], c.describe()
    assert "left out: it decays from processes that ended" in c.describe() and c.others() == 0.0
    readings = iter([0.0, 0.9])  # idle for the short sample, a core busy over the longer one
    monkeypatch.setattr(load, "_others_during_sleep", lambda s: next(readings))
    with pytest.raises(BusyMachineError, match=r"cores, 0\.90 just now\)"):
        mon.check("after baselines")
    monkeypatch.setattr(load.os, "getloadavg", lambda: (0.1, 0.1, 0.1))  # quiet average: one sample
    samples.clear()
    monkeypatch.setattr(load, "_others_during_sleep", lambda s: samples.append(s) or 0.0)
    assert not mon.check("finalists").stale_avg and samples == [load.SAMPLE_S]


def test_a_slow_calibration_on_an_idle_machine_is_re_timed_and_no_alarm(monkeypatch, caplog):
    """Issue 52: a fresh ``make tune`` on an idle machine warned "busy" with other processes at 0.00
    cores and the calibration at 2.71x its fastest. A slow calibration is re-timed (the fastest
    counts); where the load readings say no other process uses the cores it is this process's own
    doing and never a warning, however slow. Only where no reading exists does it decide alone."""
    import logging

    from autoprec.measure import load

    monkeypatch.setattr(load, "_FASTEST", {})
    monkeypatch.setattr(load, "CALIB_PAUSE_S", 0.0)
    monkeypatch.setattr(load.os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    monkeypatch.setattr(load, "_others_during_sleep", lambda s: 0.0)
    times = iter([0.004, 0.011, 0.0043])  # start; then slow once, re-timed as fast as before
    calls = []
    monkeypatch.setattr(load, "_calibrate", lambda device: calls.append(1) or next(times))
    mon = LoadMonitor(torch.device("cpu"), strict=True)
    mon.check("start")
    c = mon.check("after baselines")
    assert len(calls) == 3 and not c.busy and c.slowdown == pytest.approx(0.0043 / 0.004), c.describe()
    monkeypatch.setattr(load, "_calibrate", lambda device: 0.02)  # slow every time: 5x
    with caplog.at_level(logging.WARNING, logger="autoprec"):
        c = mon.check("after trials")
    assert not c.busy and c.slowdown == pytest.approx(5.0) and not caplog.records, c.describe()
    # with no load reading at all (no load average, no /proc/stat) the calibration decides
    monkeypatch.delattr(load.os, "getloadavg")
    monkeypatch.setattr(load, "_others_during_sleep", lambda s: None)
    with pytest.raises(BusyMachineError, match=r"no load average .* 5\.00x the fastest"):
        mon.check("finalists")
