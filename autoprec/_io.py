"""File writing rules: atomic writes, and the one rule for non-finite numbers in JSON.

Atomic: a file is either the old one or the complete new one, never half written.

Non-finite numbers: every JSON file autoprec writes (``bench.json``, ``convergence.json``, the
``--compare`` state, the monitor's JSONL log) goes through :func:`json_safe`, which writes inf and
NaN as the strings ``"inf"``, ``"-inf"`` and ``"nan"``. The files stay strict JSON (RFC 8259 has
no inf/NaN, and ``json.dumps(..., allow_nan=False)`` refuses them), the strings keep which value
it was (``null`` would not), and ``float()`` reads them back. Policy files hold finite numbers
only (``Policy`` refuses others), so they never need it.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import torch

__all__ = ["atomic_write", "json_safe", "write_json"]


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


def json_safe(x: Any) -> Any:
    """``x`` with every non-finite float replaced by ``"inf"``, ``"-inf"`` or ``"nan"`` (recursively).

    One-element tensors become Python numbers first; dicts (keys as ``str``), lists and tuples
    (as lists) are walked; other values are returned unchanged. See the module docstring for why.
    """
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        x = x.item()
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return x
    if isinstance(x, Mapping):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def write_json(path: str | os.PathLike, obj: Any, indent: int | None = 2) -> None:
    """Write ``json_safe(obj)`` as JSON to ``path`` atomically (:func:`atomic_write`), newline-ended.

    Raises:
        TypeError: ``obj`` holds a value JSON cannot represent (nothing is written).
        OSError: the file system refused the write (an existing ``path`` is left untouched).
    """
    text = json.dumps(json_safe(obj), indent=indent, allow_nan=False) + "\n"
    atomic_write(path, lambda f: f.write(text))
