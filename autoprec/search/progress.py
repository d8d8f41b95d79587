"""What ``tune`` tells the user while it runs: log lines and seconds per phase."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

__all__ = ["Clock", "log"]


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
