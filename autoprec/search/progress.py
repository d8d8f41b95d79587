"""What ``tune`` tells the user while it runs: log lines, one line per failed trial, and seconds
per phase."""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autoprec.measure.load import LoadMonitor

__all__ = ["REASON_CHARS", "Clock", "LoadClock", "failed_trial_logger", "log", "quiet_optuna_failures",
           "shorten"]

# Optuna's two warnings per failed trial (optuna/study/_optimize.py, _log_failed_trial).
_OPTUNA_FAILED = re.compile(r"Trial \d+ failed with (parameters: .* because of the following error: |value )")


def log(msg: str, quiet: bool) -> None:
    """Print ``[autoprec] msg`` (flushed) unless ``quiet``."""
    if not quiet:
        print(f"[autoprec] {msg}", flush=True)


class Clock:
    """Accumulates wall-clock seconds (``time.perf_counter``) per phase name."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        """Add the seconds the body takes to phase ``name`` (also when it raises)."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t

    def done(self) -> dict[str, float]:
        """Seconds per phase, plus ``total_s`` since the clock was made."""
        return {**self.times, "total_s": time.perf_counter() - self.t0}


class LoadClock(Clock):
    """A :class:`Clock` that also checks the machine's load when a phase named in ``phases`` begins
    (``{"finalists_s": "after trials"}``: before the finalists' head-to-head;
    :class:`autoprec.measure.load.LoadMonitor`).

    Raises:
        BusyMachineError: as :meth:`autoprec.measure.load.LoadMonitor.check` (a busy machine under
            ``strict``), when a checked phase begins.
    """

    def __init__(self, monitor: LoadMonitor, phases: dict[str, str]) -> None:
        super().__init__()
        self.monitor, self.phases = monitor, dict(phases)

    def __call__(self, name: str):
        """Check the load if ``name`` is a checked phase (once per name), then time the phase."""
        if name in self.phases:
            self.monitor.check(self.phases.pop(name))  # once per phase name
        return super().__call__(name)


class _DropOptunaFailures(logging.Filter):
    """Drops Optuna's "Trial N failed with parameters: … because of the following error: …" and
    "Trial N failed with value …" warnings, except one carrying a traceback (an objective that
    raised: autoprec's objective reports its failures through ``autoprec:error`` instead) other
    than Ctrl-C's (a 45-line ``KeyboardInterrupt`` traceback before the CLI's own one line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[0] if record.exc_info else None
        if exc is not None and issubclass(exc, KeyboardInterrupt):
            return False
        return exc is not None or not _OPTUNA_FAILED.match(record.getMessage())


def quiet_optuna_failures() -> None:
    """Silence Optuna's own per-trial failure warnings (idempotent: the filter is added once, to
    the logger that emits them, ``optuna.study._optimize``); :func:`failed_trial_logger` says
    instead, in one line, why each trial failed."""
    logger = logging.getLogger("optuna.study._optimize")
    if not any(isinstance(f, _DropOptunaFailures) for f in logger.filters):
        logger.addFilter(_DropOptunaFailures())


#: Characters of a failed trial's reason in its log line (the study keeps the whole reason).
REASON_CHARS = 300


def shorten(text: str, limit: int = REASON_CHARS) -> str:
    """``text`` cut to about ``limit`` characters by taking out its middle (`` … ``): a reason's
    head says what failed and its tail where (the first non-finite node and the model's line,
    :func:`autoprec.search.objective.name_nonfinite`), so both stay."""
    if len(text) <= limit:
        return text
    head = limit // 2
    return f"{text[:head]} … {text[len(text) - (limit - head):]}"


def failed_trial_logger(progress: bool) -> Callable[[Any, Any], None]:
    """An Optuna callback ``(study, frozen_trial)`` that, for a trial that ended FAIL with an
    ``autoprec:error`` user attribute, says ``[autoprec] trial N failed: <reason>`` once (e.g.
    ``non-finite loss``, ``lowering failed: …``).

    Args:
        progress: Optuna's progress bar is shown: the line is written through ``tqdm.write`` on
            stderr, above the bar; otherwise it goes to the ``autoprec`` logger at INFO (which the
            CLI prints as ``[autoprec] …``; silent in the Python API unless logging is set up).
    """
    import optuna

    from autoprec.search import attrs

    def callback(_study: Any, trial: Any) -> None:
        if trial.state != optuna.trial.TrialState.FAIL or attrs.ERROR not in trial.user_attrs:
            return
        text = f"trial {trial.number} failed: {shorten(' '.join(str(trial.user_attrs[attrs.ERROR]).split()))}"
        if progress:
            from tqdm import tqdm

            tqdm.write(f"[autoprec] {text}", file=sys.stderr)
        else:
            logging.getLogger("autoprec").info("%s", text)

    return callback
