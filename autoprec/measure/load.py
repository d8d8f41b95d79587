"""Is the machine busy? Load detection before and between the phases of ``tune`` and ``bench``
(docs/architecture.md#measurements).

A second process spinning on the same cores makes every step time garbage (issue 19: a 1-thread
matmul loop beside a 2-thread tune slowed steps up to 70x), so each phase boundary re-checks:

- **Load from other processes**, three ways: the 1-minute load average (Linux proc(5),
  ``/proc/loadavg``; ``os.getloadavg``) less this process's own share of it (its CPU time from
  ``os.times`` plus its live descendants', e.g. Inductor's compile workers, from
  ``/proc/<pid>/stat``, folded with the load average's own 60 s decay); and, because the load
  average lags by about a minute, the CPU time every other process used during a short sleep
  (``/proc/stat``'s aggregate ``cpu`` line, proc(5), less this process's own), which does not.
  When only the load average says busy, a longer sample (:data:`CONFIRM_S`) decides: idle too, the
  load average is that of processes that ended (a run right after another) and is left out.
- **A calibration matmul** (fp32 512x512x512, the median of a few reps,
  :func:`autoprec.device.time_matmul`), compared with the fastest one this process has timed.

The machine is busy when other processes use more than :data:`BUSY_CORES` of the cores this
process may run on (``len(os.sched_getaffinity(0))``; of ``os.cpu_count()`` in all). The
calibration decides alone only where neither load reading exists (no ``/proc``, no load
average): busy when it is over :data:`BUSY_SLOWDOWN` times the fastest after
:data:`CALIB_RETRIES` re-timings. Where the readings say no other process uses the cores, a slow
calibration is this process's own doing (its Inductor compile workers, its threads still
spinning after a phase; an idle 2-core machine measured 2.71x after the baselines of a fresh
``make tune``, other processes at 0.00 cores), which stopping "other jobs" cannot mend: it is
re-timed and recorded, never a warning. A busy check is logged as one
warning on the ``autoprec`` logger (stderr in the CLI) and recorded; under ``strict`` it raises
:class:`BusyMachineError` (CLI exit 2) instead.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from autoprec.device import time_matmul
from autoprec.errors import AutoprecError
from autoprec.metrics import median

__all__ = ["BUSY_CORES", "BUSY_SLOWDOWN", "CALIB_PAUSE_S", "CALIB_RETRIES", "CONFIRM_S", "BusyMachineError",
           "LoadCheck", "LoadMonitor"]

#: Other processes using more than this many cores (of those this process may use) make the machine busy.
BUSY_CORES = 0.5
#: A calibration matmul this many times slower than the fastest one timed makes the machine busy.
BUSY_SLOWDOWN = 1.5
#: The calibration: fp32 ``CALIB_N``-cubed matmuls, the median of ``CALIB_REPS`` (about 5 ms each on
#: the reference machine), stopping after ``CALIB_CAP_S`` seconds.
CALIB_N, CALIB_REPS, CALIB_CAP_S = 512, 9, 2.0
#: Re-timings of a calibration over :data:`BUSY_SLOWDOWN` (after :data:`CALIB_PAUSE_S` each; the
#: fastest counts): one slow run is not a verdict.
CALIB_RETRIES = 2
#: Seconds of pause before a calibration is re-timed (this process's own threads settle).
CALIB_PAUSE_S = 0.5
#: Seconds of the sleep over which other processes' CPU use is read from ``/proc/stat``.
SAMPLE_S = 0.25
#: Seconds of a second, longer sleep read when the load average says busy and the short sample
#: says idle: the load average of processes that ended (a tune right after another) decays over
#: minutes; when this sample is idle too, the load average is judged stale and left out.
CONFIRM_S = 2.0
#: The 1-minute load average's time constant in seconds (the kernel's ``EXP_1``: 5 s ticks, e^-5/60).
LOADAVG_TAU_S = 60.0
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # clock ticks per second (proc(5))
_FASTEST: dict[tuple[str, int], float] = {}  # (device, torch threads) -> fastest calibration seconds


class BusyMachineError(AutoprecError):
    """The machine is busy and ``--strict-timing`` asked for an error, not a warning (CLI exit 2)."""


@dataclass(frozen=True)
class LoadCheck:
    """One load check.

    Attributes:
        phase: When it was taken (``start``, ``after baselines``, ...).
        loadavg_1m: The 1-minute load average (runnable + uninterruptible tasks), or None.
        own_cores: This process's (and its descendants') share of it, in cores.
        others_avg: ``loadavg_1m - own_cores`` (cores, ≥ 0; None without a load average).
        others_now: Cores other processes used during a :data:`SAMPLE_S` sleep (None without /proc/stat).
        cores: Cores this process may run on (its affinity mask). cpu_count: Cores of the machine.
        threads: ``torch.get_num_threads()``.
        calib_s: Seconds of the calibration matmul (median; the fastest of its re-timings when the
            first was over :data:`BUSY_SLOWDOWN`).
        slowdown: ``calib_s`` over the fastest calibration of this process (1.0: as fast).
        busy: The verdict.
        stale_avg: The load average was left out: over :data:`BUSY_CORES` while both samples
            (:data:`SAMPLE_S`, then :data:`CONFIRM_S`; ``others_now`` is the larger) saw other
            processes idle, as after processes that ended.
    """

    phase: str
    loadavg_1m: float | None
    own_cores: float
    others_avg: float | None
    others_now: float | None
    cores: int
    cpu_count: int
    threads: int
    calib_s: float
    slowdown: float
    busy: bool
    stale_avg: bool = False

    def others(self) -> float:
        """Cores other processes use, the larger of the two readings (the sample alone when the load
        average is :attr:`stale_avg`), beyond the cores outside this process's affinity mask (a
        process there does not compete with it)."""
        avg = None if self.stale_avg else self.others_avg
        seen = max(x for x in (avg, self.others_now, 0.0) if x is not None)
        return max(0.0, seen - (self.cpu_count - self.cores))

    @property
    def load_known(self) -> bool:
        """Whether other processes' use of the cores was read (the load average or ``/proc/stat``)."""
        return self.others_avg is not None or self.others_now is not None

    def verdict(self) -> bool:
        """Busy: other processes use over :data:`BUSY_CORES` cores; or, with no load reading at all,
        the calibration is over :data:`BUSY_SLOWDOWN` times the fastest (the module docstring)."""
        if self.load_known:
            return self.others() > BUSY_CORES
        return self.slowdown > BUSY_SLOWDOWN

    def describe(self) -> str:
        """One line: the load, the cores, the slowdown."""
        la = f"load average {self.loadavg_1m:.2f}" if self.loadavg_1m is not None else "no load average"
        now = f", {self.others_now:.2f} just now" if self.others_now is not None else ""
        now += " (the load average left out: it decays from processes that ended)" if self.stale_avg else ""
        return (f"{la} ({self.own_cores:.2f} of it this process; other processes use {self.others():.2f} "
                f"cores{now}) on {self.cores} cores (of {self.cpu_count}), torch threads {self.threads}; "
                f"calibration matmul {self.calib_s * 1e3:.3g} ms = {self.slowdown:.2f}x the fastest")


class LoadMonitor:
    """Checks the machine's load when asked (:meth:`check`) and keeps every check.

    Args:
        device: Where the calibration matmul runs (a CUDA device's load is still the CPU's).
        strict: Raise :class:`BusyMachineError` on a busy check instead of warning.
        sample_s: Seconds of sleep over which other processes' CPU use is read (0: skip).
    """

    def __init__(self, device: torch.device, strict: bool = False, sample_s: float = SAMPLE_S) -> None:
        self.device, self.strict, self.sample_s = device, strict, sample_s
        self.checks: list[LoadCheck] = []
        self.records: list[dict[str, Any]] = []  # the checks as dicts (a result's "load" entry)
        self._own = _OwnCpu()

    @classmethod
    def start(cls, device: torch.device, strict: bool = False) -> LoadMonitor:
        """A monitor that has made its first check (``start``). Raises as :meth:`check`."""
        m = cls(device, strict)
        m.check("start")
        return m

    @property
    def busy(self) -> bool:
        """Whether any check found the machine busy."""
        return any(c.busy for c in self.checks)

    def check(self, phase: str) -> LoadCheck:
        """Measure the load now, record it, and warn (or raise) when the machine is busy.

        Returns:
            The :class:`LoadCheck`.

        Raises:
            BusyMachineError: the machine is busy and the monitor is ``strict``; names the load.
        """
        others_now = _others_during_sleep(self.sample_s) if self.sample_s > 0 else None
        own = self._own.cores()
        la = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        stale = False
        if la is not None and la - own > BUSY_CORES and others_now is not None and others_now <= BUSY_CORES:
            confirm = _others_during_sleep(CONFIRM_S)  # busy by the lagging average only: look longer
            others_now = max(others_now, confirm if confirm is not None else math.inf)
            stale = others_now <= BUSY_CORES
        key = (str(self.device), torch.get_num_threads())
        calib = _calibrate(self.device)
        for _ in range(CALIB_RETRIES):  # one slow run is no verdict: this process's threads may be settling
            if calib <= BUSY_SLOWDOWN * _FASTEST.get(key, math.inf):
                break
            time.sleep(CALIB_PAUSE_S)
            calib = min(calib, _calibrate(self.device))
        fastest = _FASTEST[key] = min(_FASTEST.get(key, math.inf), calib)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        c = LoadCheck(phase, la, own, None if la is None else max(0.0, la - own), others_now, cores,
                      os.cpu_count() or cores, torch.get_num_threads(), calib, calib / fastest, False, stale)
        c = _replace_busy(c, c.verdict())
        self.checks.append(c)
        self.records.append(asdict(c))
        if c.busy:
            text = (f"the machine is busy ({phase}): {c.describe()}. Timings are unreliable: stop the other "
                    f"jobs, or run with OMP_NUM_THREADS=1 (torch.set_num_threads(1)) beside them")
            if self.strict:
                raise BusyMachineError(f"{text}; --strict-timing refuses to time on a busy machine")
            logging.getLogger("autoprec").warning("%s", text)
        return c


def _calibrate(device: torch.device) -> float:
    """Seconds of the calibration matmul on ``device``: the median of :data:`CALIB_REPS` fp32
    :data:`CALIB_N`-cubed matmuls (:func:`autoprec.device.time_matmul`)."""
    return median(time_matmul(torch.float32, device, CALIB_N, CALIB_REPS, CALIB_CAP_S))


def _replace_busy(c: LoadCheck, busy: bool) -> LoadCheck:
    return LoadCheck(**{**asdict(c), "busy": busy})


@dataclass
class _OwnCpu:
    """This process's share of the 1-minute load average, in cores: its CPU time (and its live
    descendants') folded with the load average's own decay, as if spread evenly over each interval."""

    t: float = field(default_factory=time.monotonic)
    cpu: float = 0.0
    ema: float = 0.0

    def __post_init__(self) -> None:
        self.cpu = _own_cpu_s()
        age = _process_age_s()
        if age:  # the process so far, at its mean rate
            self.ema = self.cpu / age * (1 - math.exp(-age / LOADAVG_TAU_S))

    def cores(self) -> float:
        now, cpu = time.monotonic(), _own_cpu_s()
        dt = max(now - self.t, 1e-6)
        decay = math.exp(-dt / LOADAVG_TAU_S)
        self.ema = self.ema * decay + max(cpu - self.cpu, 0.0) / dt * (1 - decay)
        self.t, self.cpu = now, cpu
        return self.ema


def _own_cpu_s() -> float:
    """CPU seconds of this process, its reaped children and its live descendants (``os.times``,
    proc(5) ``/proc/<pid>/stat`` utime + stime)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system + sum(
        s[1] for s in _descendants().values())


def _descendants() -> dict[int, tuple[int, float]]:
    """``{pid: (ppid, cpu seconds)}`` of this process's live descendants ({} without /proc)."""
    procs: dict[int, tuple[int, float]] = {}
    try:
        names = [n for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return {}
    for n in names:
        try:
            with open(f"/proc/{n}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces
        except (OSError, IndexError):
            continue  # exited meanwhile
        procs[int(n)] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / _TICK)  # ppid, utime + stime
    mine, frontier = {}, [os.getpid()]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, cpu) in procs.items():
            if ppid == parent and pid not in mine:
                mine[pid] = (ppid, cpu)
                frontier.append(pid)
    return mine


def _process_age_s() -> float | None:
    """Seconds since this process started (proc(5): ``/proc/self/stat`` starttime, ``/proc/uptime``)."""
    try:
        with open("/proc/self/stat") as f:
            start = int(f.read().rsplit(")", 1)[1].split()[19]) / _TICK
        with open("/proc/uptime") as f:
            return max(float(f.read().split()[0]) - start, 1e-3)
    except (OSError, IndexError, ValueError):
        return None


def _busy_ticks() -> float | None:
    """Busy seconds of all CPUs so far: ``/proc/stat``'s ``cpu`` line, all but idle and iowait (and
    guest time, which user time already counts; proc(5)). None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (v + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / _TICK


def _others_during_sleep(seconds: float) -> float | None:
    """Cores other processes used while this one slept ``seconds`` (busy CPU time from /proc/stat
    less this process's own), or None without /proc/stat."""
    b0, own0, t0 = _busy_ticks(), _own_cpu_s(), time.monotonic()
    if b0 is None:
        return None
    time.sleep(seconds)
    b1, own1, dt = _busy_ticks(), _own_cpu_s(), time.monotonic() - t0
    return max(0.0, (b1 - b0) - (own1 - own0)) / dt
