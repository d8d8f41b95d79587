"""The command line's output paths (``--out``, ``--json``, ``--checkpoint``, ...): their missing
parent directories are made before any work and removed again if the command fails, and a path
that cannot be written atomically fails at once (cli.py's exit code 2, nothing written)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from autoprec.errors import AutoprecError

__all__ = ["check_writable", "make_parents", "output_paths", "remove_if_empty"]


def make_parents(*paths: str | None) -> list:
    """Create the missing parent directories of ``paths``; returns those created (outermost first).

    Raises:
        AutoprecError: a parent cannot be created (a file is in the way, no permission); the
            directories created so far are removed again.
    """
    from pathlib import Path

    created = []
    for p in paths:
        if not p:
            continue
        missing = [d for d in reversed(Path(p).absolute().parents) if not d.exists()]
        for d in missing:
            try:
                d.mkdir()
            except OSError as e:
                remove_if_empty(created)
                raise AutoprecError(f"{p}: cannot create the directory {d} ({e.strerror or e})") from None
            created.append(d)
    return created


def check_writable(option: str, path: str, example: str = "policy.json") -> None:
    """Fail before any work when ``path`` cannot be written atomically: it is (or, ending in a
    slash, names) a directory, or its directory takes no new files (files are written to a
    temporary file there, then renamed).

    Raises:
        AutoprecError: naming the option and the path.
    """
    import tempfile

    if os.path.isdir(path) or path.endswith(("/", os.sep)):
        raise AutoprecError(f"{option} {path}: is a directory; give a file path, "
                            f"e.g. {os.path.join(path, example)}")
    try:
        with tempfile.NamedTemporaryFile(dir=os.path.dirname(os.path.abspath(path)),
                                         prefix=".autoprec-check-"):
            pass
    except OSError as e:
        raise AutoprecError(f"{option} {path}: cannot write there ({e.strerror or e})") from None


def remove_if_empty(dirs: list) -> None:
    """Undo :func:`make_parents` for directories a failed command left empty (innermost first)."""
    for d in reversed(dirs):
        try:
            d.rmdir()
        except OSError:
            pass


@contextmanager
def output_paths(*outputs: tuple[str, str | None, str]) -> Iterator[None]:
    """Check a command's output files before any work and undo the check's directories if the
    command fails: for each ``(option, path, example)`` given a path (None: not given; empty:
    refused), its missing parents are made
    (:func:`make_parents`) and the path checked (:func:`check_writable`); an exception in the block
    removes the directories made that it left empty. A ``train --checkpoint`` under a file, or a
    ``bench --json`` naming a directory, failed after all the steps had run (the trained weights lost).

    Raises:
        AutoprecError: as :func:`make_parents` and :func:`check_writable`, before the block runs."""
    for option, path, example in outputs:
        if path is not None and not path.strip():  # --log '' opened '.', --out-dir '' wrote to the cwd
            raise AutoprecError(f"{option} {path!r}: an empty path; give one, e.g. {example}")
    created: list = []
    for option, path, _example in outputs:
        try:
            created += make_parents(path)
        except AutoprecError as e:
            remove_if_empty(created)
            raise AutoprecError(f"{option} {e}") from None
    try:
        for option, path, example in outputs:
            if path:
                check_writable(option, path, example)
        yield
    except BaseException:
        remove_if_empty(created)
        raise
