"""Atomic file writes: a file is either the old one or the complete new one, never half written."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_write"]


def atomic_write(path: str | os.PathLike, write: Callable[[IO[Any]], None], binary: bool = False) -> None:
    """Write ``path`` atomically: ``write(f)`` fills a temporary file in the same directory,
    which is flushed, fsynced and renamed over ``path`` (``os.replace``); the directory is
    fsynced so the rename persists. Parent directories are created; an existing file keeps its
    permission bits (new files get 0o644).

    Raises:
        OSError, or whatever ``write`` raises: the temporary file is removed and an existing
        ``path`` is left untouched.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    mode = target.stat().st_mode & 0o777 if target.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(target.parent)


def _fsync_dir(directory: Path) -> None:
    """Persist the rename itself (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
