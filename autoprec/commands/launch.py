"""``--nproc N``: ``autoprec train`` and ``autoprec bench`` on N ranks of this machine, started
with ``torch.distributed.run`` (torchrun); each rank finds its place in the environment torchrun
sets (:func:`autoprec.distributed.ranks.ranks_from_env`), docs/architecture.md#runtime.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

__all__ = ["launch", "strip_nproc"]


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


#: The launcher a rank group runs in: torchrun's own parser for its options, the ranks' arguments
#: set after parsing (torchrun's argparse would otherwise take ``--log`` for an ambiguous
#: abbreviation of ``--log-dir``, though it comes after the script).
_TORCHRUN = ("import json, sys\n"
             "from torch.distributed.run import get_args_parser, run\n"
             "args = get_args_parser().parse_args(sys.argv[2:] + ['-m', 'autoprec.cli'])\n"
             "args.training_script_args = json.loads(sys.argv[1])\n"
             "run(args)\n")


def launch(argv: Sequence[str], nproc: int) -> int:
    """Run ``autoprec <argv>`` (``--nproc`` removed) on ``nproc`` ranks of this machine with
    torchrun (``torch.distributed.run --standalone --nproc-per-node N -m autoprec.cli``: a free
    port on localhost), and wait. Each rank finds its place with :func:`ranks_from_env`.

    Returns:
        torchrun's exit code (non-zero when any rank failed; torchrun then stops the others).
    """
    import json

    cmd = [sys.executable, "-c", _TORCHRUN, json.dumps(strip_nproc(argv)), "--standalone",
           f"--nproc-per-node={nproc}"]
    return subprocess.call(cmd)
