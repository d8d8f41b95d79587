"""``--nproc N``: ``autoprec train`` and ``autoprec bench`` on N ranks of this machine, started
with ``torch.distributed.run`` (torchrun); each rank finds its place in the environment torchrun
sets (:func:`autoprec.distributed.ranks.ranks_from_env`), docs/architecture.md#runtime.

A rank's error reaches the user once. Under :func:`launch` a rank does not print its
:class:`~autoprec.errors.AutoprecError` (every rank checks the same input, so all would print the
same line); it records it in torchelastic's error file (:func:`record_rank_error`, the file
torchrun names in ``TORCHELASTIC_ERROR_FILE`` and reads back into its ``ChildFailedError``), and
the launcher prints each distinct message once, naming the ranks that raised it, instead of
torchrun's traceback (:func:`report_failure`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["LAUNCHED_ENV", "launch", "launched_rank", "peer_left", "record_rank_error", "report_failure",
           "strip_nproc"]

#: Set in the ranks' environment by :func:`launch` to the subcommand (``train``, ``bench``): a rank
#: records its errors for the launcher, which names the subcommand in them.
LAUNCHED_ENV = "AUTOPREC_LAUNCHED"
#: torchrun's variable naming each rank's error file (torch.distributed.elastic ``ErrorHandler``).
_ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
#: The key marking an error file :func:`record_rank_error` wrote (torchrun makes up a message for a
#: rank that wrote none: a crash, a signal).
_MARK = "autoprec"
#: The key marking a rank's error as another rank's leaving (:func:`peer_left`).
_PEER = "peer_left"
#: Seconds torchrun gets to stop its ranks after Ctrl-C before it is killed.
_STOP_S = 60.0
#: The exit code of a process that Ctrl-C stopped (128 + SIGINT), the CLI's.
_INTERRUPTED = 130


def strip_nproc(argv: Sequence[str]) -> list[str]:
    """``argv`` without its ``--nproc N`` / ``--nproc=N``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def launch(cmd: str, argv: Sequence[str], nproc: int) -> int:
    """Run ``autoprec <argv>`` (``--nproc`` removed) on ``nproc`` ranks of this machine with
    torchrun (``torch.distributed.run --standalone --nproc-per-node N -m autoprec.cli``: a free
    port on localhost), and wait. Each rank finds its place with :func:`ranks_from_env`.

    The ranks get ``OMP_NUM_THREADS`` = this process's CPUs // ``nproc`` (at least 1) unless it is
    set (torchrun would set 1 and warn), and :data:`LAUNCHED_ENV` = ``cmd``.

    Returns:
        0, or the exit code of the rank that failed first (2 for an autoprec error, 1 for a loss
        scale that collapsed, 1 for a rank killed by a signal); the errors are printed once
        (:func:`report_failure`). 130 when Ctrl-C reached the ranks but not this process.

    Raises:
        KeyboardInterrupt: Ctrl-C here, once torchrun has stopped the ranks (SIGINT to it; killed
            after :data:`_STOP_S` seconds).
    """
    env = {**os.environ, LAUNCHED_ENV: cmd}
    env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // nproc)))
    args = [sys.executable, "-m", "autoprec.commands.launch", json.dumps(strip_nproc(argv)), "--standalone",
            f"--nproc-per-node={nproc}"]
    with subprocess.Popen(args, env=env) as p:
        try:
            return p.wait()
        except BaseException:  # Ctrl-C: torchrun stops its ranks on SIGINT (SIGKILLed, it leaves them)
            p.send_signal(signal.SIGINT)
            try:
                p.wait(timeout=_STOP_S)
            except subprocess.TimeoutExpired:
                p.kill()
            raise


def launched_rank() -> bool:
    """Whether this process is a rank that :func:`launch` started (:data:`LAUNCHED_ENV` set): it
    leaves its errors and interrupts to the launcher to report."""
    return bool(os.environ.get(LAUNCHED_ENV))


def record_rank_error(e: BaseException, peer: bool = False) -> bool:
    """On a rank started by :func:`launch`, write ``e``'s message to torchelastic's error file for
    the launcher to print (True: the caller prints nothing); False elsewhere (the caller prints).
    The file holds the string form of a message that ``torch.distributed.elastic``'s
    ``ProcessFailure`` reads (``{"message": str(e), "timestamp": seconds}``), marked as autoprec's
    (:data:`_MARK`); ``peer``: ``e`` only says another rank left (:func:`peer_left`), and the
    launcher names that rank instead."""
    path = os.environ.get(_ERROR_FILE_ENV)
    if not path or not launched_rank():
        return False
    data = {"message": str(e), "timestamp": str(int(time.time())), _MARK: True, _PEER: peer}
    with open(path, "w") as f:
        json.dump(data, f)
    return True


#: What a collective's error says when the rank at the other end exited (gloo; NCCL).
_PEER_LEFT = ("Connection closed by peer", "Connection reset by peer", "remote process exited")


def peer_left(e: BaseException) -> bool:
    """Whether ``e`` is a collective that broke because another rank exited (a failure there,
    whose own error is the one to read): gloo's "Connection closed by peer", NCCL's "remote
    process exited"."""
    return isinstance(e, RuntimeError) and any(m in str(e) for m in _PEER_LEFT)


def report_failure(cmd: str, failures: dict[int, Any], first: int) -> tuple[str, int]:
    """The lines to print for a failed rank group, and its exit code.

    Args:
        cmd: The subcommand (``train``, ``bench``), for the ``autoprec <cmd>: error:`` prefix.
        failures: torchrun's ``ChildFailedError.failures``: global rank -> ``ProcessFailure``
            (``exitcode``; ``message`` read from the rank's error file, or made up by torchrun;
            ``error_file_data``, marked when :func:`record_rank_error` wrote it).
        first: The rank that failed first (``ChildFailedError.get_first_failure()``).

    Returns:
        ``(text, code)``: each message a rank recorded (:func:`record_rank_error`), once, with the
        ranks that recorded it; for the first failed rank when it recorded none (a crash: its
        traceback is above), its exit code or signal; ranks torchrun stopped after it, and ranks
        whose collective broke because it left (:func:`peer_left`), are not named. ``code`` is
        the first failure's exit code, or 1 for a signal.
    """
    seen: dict[str, list[int]] = {}
    for rank in sorted(failures):
        f = failures[rank]
        if f.error_file_data.get(_MARK) and not f.error_file_data.get(_PEER):
            seen.setdefault(str(f.message), []).append(rank)
    lines = [f"autoprec {cmd}: error on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {msg}"
             for msg, r in seen.items()]
    lost_by = None
    if failures[first].error_file_data.get(_PEER):  # it lost a rank that failed: name that one
        causes = [r for r in failures if not failures[r].error_file_data.get(_PEER)]
        lost_by, first = first, (min(causes, key=lambda r: failures[r].timestamp) if causes else first)
    head = failures[first]
    if not head.error_file_data.get(_MARK):
        how = (f"exit code {head.exitcode}" if head.exitcode >= 0
               else f"signal {-head.exitcode} ({head.signal_name()})")
        if lost_by is not None and lost_by != first and head.exitcode == -signal.SIGTERM:
            # torchrun stopped it after the rank that lost it exited: its own exit (a traceback,
            # then a teardown that hung in gloo's threads) was cut short, not a signal of its own
            how = f"its exit cut short by the launcher once rank {lost_by} lost it"
        lines.append(f"autoprec {cmd}: error: rank {first} failed ({how}); its output is above")
    return "\n".join(lines), head.exitcode if head.exitcode > 0 else 1


def _torchrun(argv: Sequence[str]) -> int:
    """The launcher process: ``argv`` = the ranks' arguments (JSON) then torchrun's options. torchrun
    parses its own options; the ranks' arguments are set after parsing (torchrun's argparse would
    otherwise take ``--log`` for an ambiguous abbreviation of ``--log-dir``, though it comes after
    the script)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args([*argv[1:], "-m", "autoprec.cli"])
    args.training_script_args = json.loads(argv[0])
    # torchrun's own log lines (closing signals, "failed (exitcode: 2)", "Received 2 death signal")
    # repeat what is printed here; each of its loggers sets its own level (LOGLEVEL, WARNING)
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(args)
    except SignalException:  # Ctrl-C: torchrun has stopped the ranks; the caller says so
        return _INTERRUPTED
    except ChildFailedError as e:
        first, failure = e.get_first_failure()
        if failure.exitcode == _INTERRUPTED and not failure.error_file_data.get(_MARK):
            return _INTERRUPTED  # the ranks had Ctrl-C first (one process group)
        text, code = report_failure(os.environ.get(LAUNCHED_ENV, "?"), e.failures, first)
        print(text, file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(_torchrun(sys.argv[1:]))
