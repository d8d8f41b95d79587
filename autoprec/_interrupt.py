"""Ctrl-C that is never lost.

Python raises ``KeyboardInterrupt`` wherever the main thread happens to be when SIGINT arrives.
Inside a weakref callback or ``__del__`` the exception is printed and ignored ("Exception
ignored in ..."), and a library may turn it into another error on its way out (Optuna's trial
loop has raised ``UnboundLocalError`` for it). :func:`catch_sigint` remembers that SIGINT came;
:func:`check` raises ``KeyboardInterrupt`` again at the next safe point (between trials, before
a file is written), :func:`deferred` holds it back while files that belong together are written,
and :func:`interrupted` lets the CLI report any error that follows as the interrupt it was.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

_seen = threading.Event()


@contextlib.contextmanager
def catch_sigint() -> Iterator[None]:
    """Within the block, SIGINT raises ``KeyboardInterrupt`` as usual and is also remembered
    (:func:`interrupted`, :func:`check`). Only in the main thread (where Python runs signal
    handlers); elsewhere the block runs unchanged. The previous handler is restored on exit."""
    if threading.current_thread() is threading.main_thread():
        _seen.clear()
    with _on_sigint(raises=True):
        yield


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Within the block SIGINT is only remembered, not raised: files written together (a policy
    and its report) are all written; :func:`check` after the block raises it. Only in the main
    thread; elsewhere the block runs unchanged. The previous handler is restored on exit."""
    with _on_sigint(raises=False):
        yield


@contextlib.contextmanager
def _on_sigint(raises: bool) -> Iterator[None]:
    """A SIGINT handler that remembers the signal (and raises ``KeyboardInterrupt`` if ``raises``)
    for the block, in the main thread only; the previous handler is restored on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        _seen.set()
        if raises:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def interrupted() -> bool:
    """True once SIGINT came inside the current :func:`catch_sigint` block."""
    return _seen.is_set()


def check() -> None:
    """Raise ``KeyboardInterrupt`` if SIGINT came, even when the first one was swallowed.

    Raises:
        KeyboardInterrupt: SIGINT came inside the current :func:`catch_sigint` block.
    """
    if _seen.is_set():
        raise KeyboardInterrupt
