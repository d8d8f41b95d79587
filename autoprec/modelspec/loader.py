"""Import a model file and collect its entry points into a :class:`ModelSpec`.

See :mod:`autoprec.modelspec` for the contract (``docs/architecture.md#modelpy-contract``).
"""

from __future__ import annotations

import difflib
import functools
import importlib.machinery
import importlib.util
import inspect
import itertools
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoprec.errors import ModelSpecError
from autoprec.kernels.fp8 import quiet_torchao_import
from autoprec.modelspec.batch import default_loss_fn, default_make_optimizer, default_tokens_per_batch
from autoprec.modelspec.batch_check import CheckedGetBatch

__all__ = ["ModelSpec", "load_model_spec"]

_REQUIRED: dict[str, str] = {
    "build_model": "def build_model() -> torch.nn.Module",
    "get_batch": "def get_batch(step: int, device: torch.device) -> dict | tuple | Tensor",
}
_OPTIONAL: dict[str, str] = {
    "loss_fn": "def loss_fn(output, batch) -> torch.Tensor",
    "make_optimizer": "def make_optimizer(params) -> torch.optim.Optimizer",
    "tokens_per_batch": "def tokens_per_batch(batch) -> int",
    "get_heldout_batch": "def get_heldout_batch(step: int, device: torch.device)",
}
# Example positional arguments used only to check that each entry point accepts them.
_ARITY: dict[str, tuple[str, ...]] = {
    "build_model": (),
    "get_batch": ("step", "device"),
    "loss_fn": ("output", "batch"),
    "make_optimizer": ("params",),
    "tokens_per_batch": ("batch",),
    "get_heldout_batch": ("step", "device"),
}

_counter = itertools.count()


class _Counted:
    """A model file's ``tokens_per_batch`` whose one-element tensor (or NumPy) result is read as its
    number (``int(mask.sum())``): every tokens/s divides by it and the study stores it as JSON, where a
    tensor made each trial fail ("Object of type Tensor is not JSON serializable"). Any other
    value is returned as it is, for :func:`autoprec.modelspec.validate.validate_spec` to judge."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn

    def __call__(self, batch: Any) -> Any:
        n = self.fn(batch)
        if isinstance(n, torch.Tensor) and n.numel() == 1 and not n.is_complex():
            return n.item()
        if type(n).__module__ == "numpy" and getattr(n, "size", 0) == 1:  # np.int64(...), mask.sum() in numpy
            return n.item()
        return n


@dataclass(frozen=True)
class ModelSpec:
    """The entry points of one model file, with defaults filled in.

    Attributes:
        path: The model file as the user named it (``str``; not resolved).
        build_model: ``() -> nn.Module`` building the model with fp32 weights on CPU.
        get_batch: ``(step, device) -> batch``; deterministic in ``step``. A batch is a dict
            (called as ``model(**batch)``), a tuple/list (``model(*batch)``) or a tensor. Wrapped
            in a :class:`~autoprec.modelspec.batch_check.CheckedGetBatch` (so is ``heldout_batch``):
            each batch is checked as it is returned, and a bad one raises ``ModelSpecError``.
        loss_fn: ``(output, batch) -> Tensor``, a scalar floating-point loss.
        make_optimizer: ``(params) -> torch.optim.Optimizer``.
        tokens_per_batch: ``(batch) -> int``, the tokens (or samples) one batch counts for
            throughput; a one-element tensor the file returns (``mask.sum()``) is read as its
            number (:class:`_Counted`).
        heldout_batch: ``(step, device) -> batch`` from held-out data, or ``None`` when the file
            defines no ``get_heldout_batch``.
    """

    path: str
    build_model: Callable[[], nn.Module]
    get_batch: Callable[[int, torch.device], Any]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    tokens_per_batch: Callable[[Any], int]
    heldout_batch: Callable[[int, torch.device], Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tokens_per_batch, _Counted):
            object.__setattr__(self, "tokens_per_batch", _Counted(self.tokens_per_batch))
        # every batch checked as it is returned (a type, not empty, the first batch's structure)
        for name, entry in (("get_batch", "get_batch"), ("heldout_batch", "get_heldout_batch")):
            fn = getattr(self, name)
            if fn is not None and not isinstance(fn, CheckedGetBatch):
                # held-out batches run through the same model (train --compare): get_batch's structure
                like = self.get_batch if name == "heldout_batch" else None
                object.__setattr__(self, name, CheckedGetBatch(self.path, fn, entry, like=like))


def load_model_spec(path: str | os.PathLike[str]) -> ModelSpec:
    """Import a model file and collect its entry points.

    The file is imported with :mod:`importlib` under a fresh, unique module name (so ``if
    __name__ == "__main__":`` blocks do not run and two loads never share state). Its directory
    is on ``sys.path`` only while it imports, so it can import neighbouring files; the module is
    removed from ``sys.modules`` afterwards and no ``__pycache__`` is written next to it.

    Args:
        path: Path of the model file (usually ``model.py``).

    Returns:
        The :class:`ModelSpec`, with ``loss_fn``, ``make_optimizer`` and ``tokens_per_batch``
        defaulted to :func:`default_loss_fn`, :func:`default_make_optimizer` and
        :func:`default_tokens_per_batch` when the file does not define them.

    Raises:
        ModelSpecError: The file does not exist or is not a file; it has a syntax error (the
            message gives the line and the offending text); importing it raised (type and
            message, with the line in the file); ``build_model`` or ``get_batch`` is missing
            (with a "did you mean" suggestion for near-miss names); an entry point is not
            callable or cannot take the arguments the contract passes.
    """
    shown = os.fspath(path)
    module = _import_file(shown)
    found: dict[str, Callable[..., Any]] = {}
    for name, signature in {**_REQUIRED, **_OPTIONAL}.items():
        if not hasattr(module, name):
            if name in _REQUIRED:
                raise ModelSpecError(_missing_message(shown, name, signature, module))
            continue
        found[name] = _check_entry_point(shown, name, signature, getattr(module, name))

    defaults: dict[str, Callable[..., Any]] = {
        "loss_fn": functools.partial(default_loss_fn, path=shown),
        "make_optimizer": default_make_optimizer,
        "tokens_per_batch": functools.partial(default_tokens_per_batch, path=shown),
    }
    entry = {**defaults, **found}
    return ModelSpec(
        path=shown,
        build_model=_quietly(entry["build_model"]),
        get_batch=entry["get_batch"],
        loss_fn=entry["loss_fn"],
        make_optimizer=entry["make_optimizer"],
        tokens_per_batch=entry["tokens_per_batch"],
        heldout_batch=entry.get("get_heldout_batch"),
    )


def _quietly(build_model: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """``build_model`` run under :func:`quiet_torchao_import`: ``transformers`` imports torchao
    lazily, when a model is first built, as much as when the file is imported."""
    @functools.wraps(build_model)
    def build() -> nn.Module:
        with quiet_torchao_import():
            return build_model()

    return build


def _import_file(shown: str) -> Any:
    """Execute the file as a fresh module and return it; see :func:`load_model_spec`."""
    filename = os.path.abspath(shown)
    if not os.path.exists(filename):
        raise ModelSpecError(f"model file not found: {shown}")
    if not os.path.isfile(filename):
        raise ModelSpecError(f"model file is not a regular file: {shown}")

    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(filename))[0]) or "model"
    mod_name = f"_autoprec_user_{stem}_{next(_counter)}"
    loader = importlib.machinery.SourceFileLoader(mod_name, filename)
    spec = importlib.util.spec_from_file_location(mod_name, filename, loader=loader)
    if spec is None:  # pragma: no cover - only for exotic paths
        raise ModelSpecError(f"cannot import model file {shown}")
    module = importlib.util.module_from_spec(spec)

    directory = os.path.dirname(filename)
    sys.path.insert(0, directory)
    sys.modules[mod_name] = module  # dataclasses/typing in the file look themselves up here
    saved_dont_write = sys.dont_write_bytecode
    sys.dont_write_bytecode = True
    try:
        with quiet_torchao_import():  # transformers imports torchao when installed
            loader.exec_module(module)
    except SyntaxError as e:
        if e.filename and os.path.abspath(e.filename) == filename:
            text = (e.text or "").rstrip("\n").strip()
            raise ModelSpecError(
                f"syntax error in {shown}, line {e.lineno}: {e.msg}" + (f"\n    {text}" if text else "")
            ) from e
        raise ModelSpecError(_import_failure_message(shown, filename, e)) from e
    except (Exception, SystemExit) as e:
        raise ModelSpecError(_import_failure_message(shown, filename, e)) from e
    finally:
        sys.dont_write_bytecode = saved_dont_write
        sys.modules.pop(mod_name, None)
        try:
            sys.path.remove(directory)  # the first occurrence: the entry inserted above
        except ValueError:
            pass
    return module


def _import_failure_message(shown: str, filename: str, exc: BaseException) -> str:
    """Describe an exception raised while the model file was executing."""
    line = ""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if os.path.abspath(frame.filename) == filename:
            line = f" (line {frame.lineno}: {(frame.line or '').strip()})"
            break
    return f"error while importing {shown}{line}: {type(exc).__name__}: {exc}"


def _missing_message(shown: str, name: str, signature: str, module: Any) -> str:
    """Message for a missing required entry point, with a suggestion for near misses."""
    known = set(_REQUIRED) | set(_OPTIONAL)
    candidates = {n.lower(): n for n in vars(module) if not n.startswith("__") and n not in known}
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    hint = f"; did you mean {candidates[close[0]]!r}?" if close else ""
    return f"{shown} does not define {name}; expected `{signature}`{hint}"


def _check_entry_point(shown: str, name: str, signature: str, obj: Any) -> Callable[..., Any]:
    """Check that ``obj`` is callable with the contract's positional arguments."""
    if not callable(obj):
        raise ModelSpecError(
            f"{shown}: {name} is a {type(obj).__name__}, not callable; expected `{signature}`"
        )
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return obj
    try:
        sig.bind(*_ARITY[name])
    except TypeError as e:
        raise ModelSpecError(
            f"{shown}: {name}{sig} cannot be called as {name}({', '.join(_ARITY[name])}) ({e}); "
            f"expected `{signature}`"
        ) from e
    return obj
