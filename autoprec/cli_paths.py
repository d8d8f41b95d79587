"""The command line's output paths (``--out``, ``--json``, ``--checkpoint``, ...): their missing
parent directories are made before any work and removed again if the command fails, and a path
that cannot be written atomically fails at once (cli.py's exit code 2, nothing written)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

from autoprec.errors import AutoprecError

__all__ = ["BENCH_MD_MARK", "Output", "bench_json", "bench_table", "check_writable", "jsonl_log",
           "make_parents", "output_paths", "remove_if_empty"]


class Output(NamedTuple):
    """One output path of a command, for :func:`output_paths`.

    Attributes:
        option: The option as the user gave it (``"--json"``), named in every message.
        path: The path; None when the option was not given.
        example: A file name for the message that a directory was given (``"bench.json"``).
        ours: For an existing file: whether it is one this command writes (a previous run's), which
            may be replaced or appended to; None: any file may be.
        what: What ``ours`` accepts, for the refusal (``"a bench JSON file"``).
    """

    option: str
    path: str | None
    example: str
    ours: Callable[[str], bool] | None = None
    what: str = ""


def _read_start(path: str, n: int = 65536) -> str:
    """The first ``n`` characters of the text file ``path`` (undecodable bytes replaced)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read(n)


def bench_json(path: str) -> bool:
    """Whether ``path`` holds ``bench --json``'s output (a JSON object with ``machine`` and
    ``autoprec``)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(data, dict) and {"machine", "autoprec"} <= set(data)


#: The first line of a ``bench --md`` file, by which a rerun knows it may replace the file (a
#: user's Markdown with a table in it was replaced by a test that looked for ``| config``).
BENCH_MD_MARK = "<!-- written by autoprec bench -->"


def bench_table(path: str) -> bool:
    """Whether ``path`` holds a table ``bench --md`` wrote (an empty file, or one that starts with
    :data:`BENCH_MD_MARK`)."""
    text = _read_start(path)
    return not text.strip() or text.startswith(BENCH_MD_MARK)


def jsonl_log(path: str) -> bool:
    """Whether ``path`` is a log ``train --log`` may append to: empty, or its first line a step
    record (a JSON object with ``"step"``; a one-line policy file passed a test for any object)."""
    first = _read_start(path).split("\n", 1)[0].strip()
    if not first:
        return True
    try:
        record = json.loads(first)
    except ValueError:
        return False
    return isinstance(record, dict) and "step" in record


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
def output_paths(*outputs: tuple[str, str | None, str] | Output) -> Iterator[None]:
    """Check a command's output files before any work and undo the check's directories if the
    command fails: for each :class:`Output` (or ``(option, path, example)``) given a path (None: not
    given; empty: refused; an existing file that is not ``ours``: refused, as ``bench --json
    model.py`` replaced the model file), its missing parents are made (:func:`make_parents`) and
    the path checked (:func:`check_writable`); an exception in the block removes the directories
    made that it left empty. A ``train --checkpoint`` under a file, or a ``bench --json`` naming a
    directory, failed after all the steps had run (the trained weights lost).

    Raises:
        AutoprecError: as :func:`make_parents` and :func:`check_writable`, and for an empty path or
            a file that is not ``ours``, before the block runs."""
    outs = [Output(*o) for o in outputs]
    for option, path, example, ours, what in outs:
        if path is not None and not path.strip():  # --log '' opened '.', --out-dir '' wrote to the cwd
            raise AutoprecError(f"{option} {path!r}: an empty path; give one, e.g. {example}")
        if path and ours is not None and os.path.isfile(path) and not ours(path):
            raise AutoprecError(f"{option} {path}: exists and is not {what}, which writing there would "
                                "change; give another path, or remove the file")
    created: list = []
    for option, path, _example, _ours, _what in outs:
        try:
            created += make_parents(path)
        except AutoprecError as e:
            remove_if_empty(created)
            raise AutoprecError(f"{option} {e}") from None
    try:
        for option, path, example, _ours, _what in outs:
            if path:
                check_writable(option, path, example)
        yield
    except BaseException:
        remove_if_empty(created)
        raise
