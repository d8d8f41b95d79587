"""Load a user's ``model.py`` into a :class:`ModelSpec` (DESIGN §2).

The contract a model file fulfils::

    def build_model() -> torch.nn.Module: ...             # required; fp32 weights
    def get_batch(step: int, device: torch.device): ...   # required; deterministic in step
    def loss_fn(output, batch) -> torch.Tensor: ...       # optional; default: output.loss
    def make_optimizer(params) -> torch.optim.Optimizer   # optional; default AdamW
    def tokens_per_batch(batch) -> int: ...               # optional; default: numel of input_ids
    def get_heldout_batch(step, device): ...              # optional; held-out data for drift checks

Everything that can go wrong while loading (file missing, syntax error, exception at import,
missing/misspelt/non-callable entry point, wrong arity) raises :class:`ModelSpecError` with one
message that names the file and says what is expected; the CLI maps it to exit code 2.
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
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoprec.errors import ModelSpecError

__all__ = [
    "ModelSpec",
    "call_model",
    "default_loss_fn",
    "default_make_optimizer",
    "default_tokens_per_batch",
    "load_model_spec",
    "validate_spec",
    "split_batch",
]

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


@dataclass(frozen=True)
class ModelSpec:
    """The entry points of one model file, with defaults filled in.

    Attributes:
        path: The model file as the user named it (``str``; not resolved).
        build_model: ``() -> nn.Module`` building the model with fp32 weights on CPU.
        get_batch: ``(step, device) -> batch``; deterministic in ``step``. A batch is a dict
            (called as ``model(**batch)``), a tuple/list (``model(*batch)``) or a tensor.
        loss_fn: ``(output, batch) -> Tensor``, a scalar floating-point loss.
        make_optimizer: ``(params) -> torch.optim.Optimizer``.
        tokens_per_batch: ``(batch) -> int``, the tokens (or samples) one batch counts for
            throughput.
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

    def check(self, device: torch.device | str = "cpu") -> tuple[nn.Module, Any]:
        """Shorthand for :func:`validate_spec(self, device) <validate_spec>`."""
        return validate_spec(self, device)


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
        build_model=entry["build_model"],
        get_batch=entry["get_batch"],
        loss_fn=entry["loss_fn"],
        make_optimizer=entry["make_optimizer"],
        tokens_per_batch=entry["tokens_per_batch"],
        heldout_batch=entry.get("get_heldout_batch"),
    )


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


def split_batch(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword arguments a batch stands for (DESIGN §2): a mapping is
    ``(), dict(batch)``, a tuple or list ``tuple(batch), {}``, anything else (typically a tensor)
    ``(batch,), {}``."""
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    return (batch,), {}


def call_model(model: Callable[..., Any], batch: Any) -> Any:
    """Call ``model`` on a batch in the form the contract allows (:func:`split_batch`).

    Args:
        model: The module (or any callable with the module's signature).
        batch: A mapping (``model(**batch)``), a tuple or list (``model(*batch)``), or anything
            else, typically a tensor (``model(batch)``).

    Returns:
        Whatever the model returns.
    """
    args, kwargs = split_batch(batch)
    return model(*args, **kwargs)


def default_loss_fn(output: Any, batch: Any, *, path: str | None = None) -> torch.Tensor:
    """The loss when the model file defines no ``loss_fn``.

    Takes ``output.loss`` (an attribute, as on Hugging Face ``ModelOutput``, or a ``"loss"`` key
    of a mapping), or ``output`` itself when it is a one-element floating-point tensor.

    Args:
        output: What the model returned.
        batch: The batch (unused; part of the ``loss_fn`` signature).
        path: The model file, named in the error message.

    Returns:
        The loss tensor (normally 0-dim, floating point).

    Raises:
        ModelSpecError: The output carries no usable loss (e.g. logits only, or ``loss=None``
            because the batch has no ``labels``).
    """
    del batch
    where = path or "your model.py"
    if isinstance(output, torch.Tensor):
        loss, field = output, ""
    elif isinstance(output, Mapping):
        loss = output.get("loss")
        field = f" with loss={_describe(loss)}" if "loss" in output else ""
    else:
        loss = getattr(output, "loss", None)
        field = f" with loss={_describe(loss)}" if hasattr(output, "loss") else ""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point():
        return loss
    raise ModelSpecError(
        f"model output has no loss: got {_describe(output)}{field}; define loss_fn(output, batch) "
        f"in {where} (or include labels in the batch so the model computes one)"
    )


def _describe(obj: Any) -> str:
    """Short description of a value for error messages (tensors by shape and dtype)."""
    if isinstance(obj, torch.Tensor):
        return f"Tensor(shape={tuple(obj.shape)}, dtype={obj.dtype})"
    if isinstance(obj, Mapping):
        return f"{type(obj).__name__} with keys {list(obj.keys())}"
    if isinstance(obj, (tuple, list)):
        return f"{type(obj).__name__} of {len(obj)} items"
    return "None" if obj is None else type(obj).__name__


def default_make_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer when the model file defines no ``make_optimizer``: ``AdamW(lr=3e-4)``.

    Why these defaults: AdamW is the standard optimizer for transformer training and the one
    mixed-precision recipes are validated with; ``lr=3e-4`` is the widely used safe Adam rate for
    small models (stable from random init without warm-up). ``weight_decay=0.0`` (instead of
    PyTorch's 0.01) keeps the update a function of the gradient only, so drift measurements
    between precision policies compare gradients, not a decay term that is identical in both.

    Args:
        params: The parameters to optimize (fp32 master weights).

    Returns:
        A fresh ``torch.optim.AdamW``.
    """
    return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.0)


def default_tokens_per_batch(batch: Any, *, path: str | None = None) -> int:
    """Tokens one batch counts for throughput when the file defines no ``tokens_per_batch``.

    The element count of ``batch["input_ids"]`` if present, else of the first integer tensor in
    the batch (in dict/tuple order, searching nested containers), else the leading dimension
    (batch size) of the first tensor.

    Args:
        batch: A batch as returned by ``get_batch``.
        path: The model file, named in the error message.

    Returns:
        A positive count (tokens, or samples for non-token models).

    Raises:
        ModelSpecError: The batch contains no tensor.
    """
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
        return int(batch["input_ids"].numel())
    tensors = list(_iter_tensors(batch))
    for t in tensors:
        if not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
            return int(t.numel())
    if tensors:
        return int(tensors[0].shape[0]) if tensors[0].dim() > 0 else 1
    raise ModelSpecError(
        f"cannot count tokens: the batch ({_describe(batch)}) holds no tensor; "
        f"define tokens_per_batch(batch) in {path or 'your model.py'}"
    )


def _iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors in a (nested) batch, in order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _iter_tensors(v)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _iter_tensors(v)


_BATCH_TYPES = "a Tensor, tuple or dict"


def _call_entry(spec: ModelSpec, name: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Call a user entry point; anything it raises becomes a :class:`ModelSpecError` naming the
    file, the entry point and (when the frame is in the file) the line."""
    try:
        return fn(*args)
    except ModelSpecError:
        raise
    except Exception as e:
        filename = os.path.abspath(spec.path)
        line = ""
        for frame in reversed(traceback.extract_tb(e.__traceback__)):
            if os.path.abspath(frame.filename) == filename:
                line = f" (line {frame.lineno}: {(frame.line or '').strip()})"
                break
        raise ModelSpecError(f"{spec.path}: {name} raised {type(e).__name__}: {e}{line}") from e


def _same_batch(a: Any, b: Any) -> bool:
    """Structural equality of two batches (tensors by dtype, shape and values)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and a.device == b.device and torch.equal(a, b))
    if isinstance(a, Mapping) or isinstance(b, Mapping):
        return (isinstance(a, Mapping) and isinstance(b, Mapping) and list(a) == list(b)
                and all(_same_batch(a[k], b[k]) for k in a))
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return (isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b)
                and all(_same_batch(x, y) for x, y in zip(a, b)))
    try:
        return bool(a == b)
    except Exception:
        return a is b


def _check_batch_keys(spec: ModelSpec, model: nn.Module, batch: Mapping) -> None:
    """Every key of a dict batch must be a parameter of ``model.forward`` (or it takes ``**kwargs``)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in batch:
        if key not in accepted:
            raise ModelSpecError(
                f"{spec.path}: get_batch returned a dict with key {key!r}, which "
                f"{type(model).__name__}.forward does not accept (its parameters: {', '.join(accepted)})"
            )


def _check_loss(spec: ModelSpec, loss: Any) -> None:
    """The loss must be a one-element floating-point tensor attached to the autograd graph."""
    user = spec.loss_fn if not isinstance(spec.loss_fn, functools.partial) else None
    who = f"{spec.path}: loss_fn" if user is not None else f"{spec.path}: the model's loss (output.loss)"
    fix = "return the loss tensor itself (no .item(), .detach() or float())"
    if not isinstance(loss, torch.Tensor):
        raise ModelSpecError(f"{who} returned {_describe(loss)}; expected a scalar floating-point Tensor; {fix}")
    if not loss.is_floating_point():
        raise ModelSpecError(f"{who} returned {_describe(loss)}; expected a floating-point scalar Tensor")
    if loss.numel() != 1:
        raise ModelSpecError(f"{who} returned {_describe(loss)}; expected a scalar (reduce it, e.g. .mean())")
    if not loss.requires_grad:
        raise ModelSpecError(f"{who} returned a Tensor that does not require grad (detached, or computed "
                             f"under torch.no_grad()); {fix}")


def validate_spec(spec: ModelSpec, device: torch.device | str = "cpu") -> tuple[nn.Module, Any]:
    """Run every entry point of ``spec`` once and check what it returns (DESIGN §2).

    Builds the model once, calls ``get_batch(0, device)`` twice (determinism), runs one forward
    and ``loss_fn`` (no backward), and builds the optimizer. Cost: one model build and one forward
    pass. The global RNG state (CPU and the device's) is restored afterwards, so a later
    ``build_model()`` initialises the same weights as without the check.

    Args:
        spec: From :func:`load_model_spec`.
        device: Device the batch and model are put on.

    Returns:
        ``(model, batch)``: the built model (on ``device``, train mode) and ``get_batch(0, device)``.

    Raises:
        ModelSpecError: an entry point raised (named, with the line in the file); ``build_model``
            returned no ``nn.Module``; ``get_batch`` returned something other than a Tensor,
            tuple/list or dict, or two different batches for step 0, or a dict key ``forward``
            does not take; the loss is not a floating scalar tensor that requires grad;
            ``make_optimizer`` returned no ``torch.optim.Optimizer``.
    """
    dev = torch.device(device)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        model = _call_entry(spec, "build_model()", spec.build_model)
        if not isinstance(model, nn.Module):
            raise ModelSpecError(f"{spec.path}: build_model returned {_describe(model)}; "
                                 f"expected a torch.nn.Module (`{_REQUIRED['build_model']}`)")
        model = model.to(dev)
        model.train()
        batch = _call_entry(spec, "get_batch(0, device)", spec.get_batch, 0, dev)
        if not isinstance(batch, (torch.Tensor, tuple, list, Mapping)):
            raise ModelSpecError(f"{spec.path}: get_batch returned {_describe(batch)}; expected {_BATCH_TYPES}")
        again = _call_entry(spec, "get_batch(0, device)", spec.get_batch, 0, dev)
        if not _same_batch(batch, again):
            raise ModelSpecError(f"{spec.path}: get_batch(0, device) returned different batches on two calls; "
                                 "it must be deterministic in step (e.g. seed a torch.Generator with step)")
        if isinstance(batch, Mapping):
            _check_batch_keys(spec, model, batch)
        out = _call_entry(spec, "the model's forward on get_batch(0)", call_model, model, batch)
        loss = _call_entry(spec, "loss_fn", spec.loss_fn, out, batch)
        _check_loss(spec, loss)
        del out, loss
        params = [p for p in model.parameters() if p.requires_grad]
        opt = _call_entry(spec, "make_optimizer(params)", spec.make_optimizer, params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise ModelSpecError(f"{spec.path}: make_optimizer returned {_describe(opt)}; "
                                 f"expected a torch.optim.Optimizer (`{_OPTIONAL['make_optimizer']}`)")
    return model, batch
