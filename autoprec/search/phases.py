"""Progress over ``tune``'s long phases and where their compile time goes (docs/architecture.md#search,
"Progress and time").

Optuna's bar covers the trials; :func:`phase_bar` gives the other long phases one tqdm bar each
(baselines, sensitivity, finalists and their head-to-head, memory fit), on stderr as Optuna's.
Inductor compiles lazily, in the first steps a compiled graph runs, so the seconds they take fall
inside whichever phase runs those steps; :func:`accounted` moves them from that phase to
``compile_s``, measured by Dynamo's own process-wide compile timers (:func:`compile_seconds`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from autoprec._torch_compat import dynamo_compile_seconds

__all__ = ["PhaseBar", "accounted", "compile_seconds", "phase_bar"]

#: The longest step label a bar shows.
_LABEL = 60


def compile_seconds() -> float:
    """Seconds this process has spent compiling with Dynamo/Inductor so far, forward frames and
    the backward graphs AOTAutograd compiles lazily at the first ``backward()``
    (:func:`autoprec._torch_compat.dynamo_compile_seconds`; 0.0 before anything compiled)."""
    return dynamo_compile_seconds()


@contextlib.contextmanager
def accounted(clock: Any, name: str, compile_name: str = "compile_s") -> Iterator[None]:
    """Time the body as phase ``name`` of ``clock`` (a :class:`~autoprec.search.progress.Clock`),
    less the compile seconds spent inside it (:func:`compile_seconds`), which go to
    ``compile_name``; so ``name`` + ``compile_name`` is the body's wall time. Also when the body
    raises."""
    c0 = compile_seconds()
    try:
        with clock(name):
            yield
    finally:
        c1 = compile_seconds()
        spent = c1 - c0 if c1 >= c0 else c1  # Dynamo was reset in between: what it counted since
        spent = min(max(spent, 0.0), clock.times.get(name, 0.0))
        clock.times[name] = clock.times.get(name, 0.0) - spent
        clock.times[compile_name] = clock.times.get(compile_name, 0.0) + spent


class PhaseBar:
    """A tqdm bar over one phase's steps, on stderr; does nothing when disabled.

    Args:
        desc: The phase, shown as ``[autoprec] <desc>``.
        total: Steps expected (None: unknown, the bar counts).
        enabled: Show it (``tune(progress=True)`` and not ``quiet``).
    """

    def __init__(self, desc: str, total: int | None, enabled: bool) -> None:
        self._bar = None
        self._open = False  # a step has begun and is not counted yet
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=f"[autoprec] {desc}", file=sys.stderr, unit="step",
                             dynamic_ncols=True)

    def set_total(self, total: int | None) -> None:
        """Say how many steps the phase has, once it is known."""
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def step(self, what: str) -> None:
        """Begin step ``what`` (shown beside the bar); the step begun before it is counted done."""
        if self._bar is None:
            return
        if self._open:
            self._bar.update(1)
        self._bar.set_postfix_str(what if len(what) <= _LABEL else what[: _LABEL - 1] + "…")
        self._open = True

    def close(self) -> None:
        """Count the last step begun and close the bar (idempotent)."""
        if self._bar is None:
            return
        if self._open:
            self._bar.update(1)
            self._open = False
        self._bar.close()
        self._bar = None


@contextlib.contextmanager
def phase_bar(desc: str, total: int | None, enabled: bool) -> Iterator[PhaseBar]:
    """A :class:`PhaseBar` closed when the body ends (also when it raises)."""
    bar = PhaseBar(desc, total, enabled)
    try:
        yield bar
    finally:
        bar.close()
