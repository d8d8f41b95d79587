"""How a batch is passed to the model, and the defaults of the optional entry points.

See :mod:`autoprec.modelspec` for the contract (``docs/architecture.md#modelpy-contract``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from autoprec.errors import ModelSpecError
from autoprec.modelspec.outputs import training_kwargs

__all__ = ["call_model", "default_loss_fn", "default_make_optimizer", "default_tokens_per_batch",
           "describe_value", "positional_binding", "split_batch"]


def split_batch(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword arguments a batch stands for (docs/architecture.md#modelpy-contract): a
    mapping is ``(), dict(batch)``, a tuple or list ``tuple(batch), {}``, anything else (typically a tensor)
    ``(batch,), {}``."""
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    return (batch,), {}


def positional_binding(model: Any, batch: Any) -> str | None:
    """How a tuple or list batch of two or more items binds to ``model.forward``, for error messages.

    A sequence batch is passed positionally (:func:`split_batch`), so its order must be
    ``forward``'s parameter order; when the forward fails, this names the mapping, e.g.
    ``get_batch returned a list of 3 items, passed positionally: batch[0] -> input_ids,
    batch[1] -> attention_mask, batch[2] -> decoder_input_ids (T5.forward(input_ids, ...))``.

    Args:
        model: The module (or a callable); its ``forward`` (else the callable) is inspected.
        batch: What ``get_batch`` returned.

    Returns:
        The sentence, or None for any other batch or a callable without a signature.
    """
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        return None
    fn = getattr(getattr(model, "_orig_mod", model), "forward", model)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    names, rest = [], None
    for n, p in sig.parameters.items():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(n)
        elif p.kind is p.VAR_POSITIONAL:
            rest = f"*{n}"
            break
    pairs = [f"batch[{i}] -> {names[i] if i < len(names) else rest or '(no parameter: too many items)'}"
             for i in range(len(batch))]
    owner = type(getattr(model, "_orig_mod", model)).__name__ if isinstance(model, nn.Module) else "the model"
    return (f"get_batch returned a {type(batch).__name__} of {len(batch)} items, passed positionally: "
            f"{', '.join(pairs)} ({owner}.forward{sig}); return a dict to pass the items by name")


def call_model(model: Callable[..., Any], batch: Any) -> Any:
    """Call ``model`` on a batch in the form the contract allows (:func:`split_batch`).

    Args:
        model: The module (or any callable with the module's signature).
        batch: A mapping (``model(**batch)``), a tuple or list (``model(*batch)``), or anything
            else, typically a tensor (``model(batch)``).

    The keyword arguments a training capture fixes (``use_cache=False``:
    :func:`~autoprec.modelspec.outputs.training_kwargs`) are added for a module whose forward
    takes them and a batch that does not set them, so the eager FP32 and torch.autocast baselines
    run what the captured graph runs (no KV cache built while training).

    Returns:
        Whatever the model returns.
    """
    args, kwargs = split_batch(batch)
    inner = getattr(model, "_orig_mod", model)  # torch.compile and compile_graph keep the module here
    if isinstance(inner, nn.Module):
        kwargs = {**training_kwargs(inner, args, kwargs), **kwargs}
    return model(*args, **kwargs)


def default_loss_fn(output: Any, batch: Any, *, path: str | None = None) -> torch.Tensor:
    """The loss when the model file defines no ``loss_fn``.

    Takes ``output.loss`` (an attribute, as on Hugging Face ``ModelOutput``, or a ``"loss"`` key
    of a mapping), or ``output`` itself when it is a one-element floating-point tensor.

    Args:
        output: What the model returned.
        batch: The batch (part of the ``loss_fn`` signature; the message reads whether it has ``labels``).
        path: The model file, named in the error message.

    Returns:
        The loss tensor (normally 0-dim, floating point).

    Raises:
        ModelSpecError: The output carries no usable loss (e.g. logits only, or ``loss=None``
            because the batch has no ``labels``); for a tuple or list holding a scalar, the message
            names its index and the ``loss_fn`` that picks it.
    """
    where = path or "your model.py"
    if isinstance(output, torch.Tensor):
        loss, field = output, ""
    elif isinstance(output, Mapping):
        loss = output.get("loss")
        field = f" with loss={describe_value(loss)}" if "loss" in output else ""
    else:
        loss = getattr(output, "loss", None)
        field = f" with loss={describe_value(loss)}" if hasattr(output, "loss") else ""
    if _is_scalar(loss):
        return loss
    scalars = [i for i, t in enumerate(output) if _is_scalar(t)] if isinstance(output, (tuple, list)) else []
    if scalars:
        raise ModelSpecError(
            f"model output has no loss: got {describe_value(output)}, and a tuple is not searched for one; "
            "item "
            f"{scalars[0]} is a one-element tensor"
            f"{' (Hugging Face return_dict=False puts the loss first)' if scalars[0] == 0 else ''}: "
            f"define loss_fn(output, batch) in {where} to pick it, e.g. "
            f"`def loss_fn(output, batch): return output[{scalars[0]}]`")
    has_labels = isinstance(batch, Mapping) and "labels" in batch
    raise ModelSpecError(
        f"model output has no loss: got {describe_value(output)}{field}; define loss_fn(output, batch) "
        f"in {where}" + ("" if has_labels else " (or include labels in the batch so the model computes one)")
    )


def _is_scalar(t: Any) -> bool:
    """Whether ``t`` is a one-element floating tensor (a loss, by shape)."""
    return isinstance(t, torch.Tensor) and t.numel() == 1 and t.is_floating_point()


def scalar_items(output: Any) -> list[torch.Tensor]:
    """The one-element floating tensors among the items of a tuple or list ``output`` (a loss
    among them: ``(loss, logits)``, ``(logits, loss)``); ``[]`` for any other output."""
    return [t for t in output if _is_scalar(t)] if isinstance(output, (tuple, list)) else []


def describe_value(obj: Any) -> str:
    """Short description of a value for error messages (tensors by shape and dtype)."""
    if isinstance(obj, torch.Tensor):
        return f"Tensor(shape={tuple(obj.shape)}, dtype={obj.dtype})"
    if isinstance(obj, Mapping):
        return f"{type(obj).__name__} with keys {list(obj.keys())}"
    if isinstance(obj, (tuple, list)):
        return f"{type(obj).__name__} of {len(obj)} item{'' if len(obj) == 1 else 's'}"
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
        f"cannot count tokens: the batch ({describe_value(batch)}) holds no tensor; "
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
