"""Where in the model's own source code something comes from: the rule that tells the user's (or
the model library's) code from PyTorch's and autoprec's, for a traceback (capture errors,
:mod:`autoprec.capture.diagnose`) and for a captured node (pass errors, :mod:`autoprec.passes.base`).

``torch.export`` records in ``node.meta["stack_trace"]`` the Python stack that produced each node
of the graph it captures (``File "...", line N, in fn`` then the code line, innermost last; PyTorch
docs, "torch.export IR specification", node metadata). The innermost frame outside torch and
autoprec is the model's line that made the node: for ``self.fc(x)`` the ``forward`` line calling
it, not ``torch/nn/modules/linear.py``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re

import torch
from torch import fx

__all__ = ["is_user_file", "node_source"]


def _package_dir(name: str) -> str | None:
    """The directory of an installed package, with a trailing separator, without importing it."""
    spec = importlib.util.find_spec(name)
    origin = spec.origin if spec is not None else None
    return os.path.join(os.path.dirname(os.path.realpath(origin)), "") if origin else None


#: Directories (and files) whose frames are not the model's code: torch's and autoprec's packages,
#: transformers' ``utils`` (its output and hook wrappers) and :mod:`contextlib`. By the packages'
#: real locations, so a model file kept in a folder that happens to be called ``autoprec`` or
#: ``torch`` still counts as the user's.
_TRANSFORMERS = _package_dir("transformers")
_LIBRARY = tuple(p for p in (
    os.path.join(os.path.dirname(os.path.realpath(torch.__file__)), ""),
    os.path.join(os.path.dirname(os.path.realpath(__file__)), ""),
    os.path.join(_TRANSFORMERS, "utils", "") if _TRANSFORMERS else None,
    os.path.realpath(contextlib.__file__),
) if p)

#: One frame of a Python stack as ``traceback`` formats it (and as torch.export records it).
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)\n(?P<code>[^\n]*)$',
                    re.MULTILINE)


def is_user_file(filename: str) -> bool:
    """Whether a frame of ``filename`` is the model's code (its own file or a model library such as
    ``transformers/models/...``), not torch's, autoprec's or a wrapper's (:data:`_LIBRARY`)."""
    path = os.path.realpath(filename) if os.path.isabs(filename) else filename
    return not (filename.startswith("<") or path.startswith(_LIBRARY))


def node_source(node: fx.Node) -> str | None:
    """The model's source line that produced a captured ``node``, as ``file:line (function): code``
    (the innermost frame of its ``stack_trace`` that :func:`is_user_file` accepts), or None when
    the node has none (placeholders, outputs, casts a pass inserted, graphs traced without
    ``torch.export``)."""
    trace = node.meta.get("stack_trace")
    if not isinstance(trace, str):
        return None
    frames = [m for m in _FRAME.finditer(trace) if is_user_file(m["file"])]
    if not frames:
        return None
    f = frames[-1]
    return f"{f['file']}:{f['line']} ({f['fn']}): {f['code'].strip()}"
