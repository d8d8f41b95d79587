"""Run every entry point of a :class:`~autoprec.modelspec.ModelSpec` once and check the results.

See :mod:`autoprec.modelspec` for the contract (``docs/architecture.md#modelpy-contract``).
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from autoprec._torch_compat import pytree
from autoprec.errors import ModelSpecError
from autoprec.modelspec.batch import call_model, describe_value, positional_binding
from autoprec.modelspec.loader import _OPTIONAL, _REQUIRED, ModelSpec

__all__ = ["validate_spec"]


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
    """Structural equality of two batches (tensors by dtype, shape and values, NaN equal to NaN;
    arrays such as numpy's by values)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and a.device == b.device
                and (torch.equal(a, b) or (a.is_floating_point() or a.is_complex())
                     and bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all())))
    if isinstance(a, Mapping) or isinstance(b, Mapping):
        return (isinstance(a, Mapping) and isinstance(b, Mapping) and list(a) == list(b)
                and all(_same_batch(a[k], b[k]) for k in a))
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return (isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b)
                and all(_same_batch(x, y) for x, y in zip(a, b)))
    try:
        eq = a == b
        return bool(eq.all()) if hasattr(eq, "all") and not isinstance(eq, bool) else bool(eq)
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
        raise ModelSpecError(f"{who} returned {describe_value(loss)}; expected a scalar floating-point "
                             f"Tensor; {fix}")
    if not loss.is_floating_point():
        raise ModelSpecError(f"{who} returned {describe_value(loss)}; "
                             "expected a floating-point scalar Tensor")
    if loss.numel() != 1:
        raise ModelSpecError(f"{who} returned {describe_value(loss)}; "
                             "expected a scalar (reduce it, e.g. .mean())")
    if not loss.requires_grad:
        raise ModelSpecError(f"{who} returned a Tensor that does not require grad (detached, or computed "
                             f"under torch.no_grad()); {fix}")


def _check_tokens(spec: ModelSpec, n: Any) -> None:
    """Raise unless ``tokens_per_batch(get_batch(0))`` gave a positive finite count: every tokens/s
    number divides by it (a one-element tensor is read as its number by ``ModelSpec``)."""
    if isinstance(n, bool) or not isinstance(n, (int, float)) or not math.isfinite(n) or n <= 0:
        got = repr(n) if isinstance(n, (int, float)) else describe_value(n)
        raise ModelSpecError(f"{spec.path}: tokens_per_batch(get_batch(0)) returned {got}; expected a "
                             f"positive number of tokens (`{_OPTIONAL['tokens_per_batch']}`), the count "
                             "behind every tokens/s")


def _versions(batch: Any) -> list[int]:
    """The autograd version counter of each tensor leaf of ``batch``: an in-place op on a leaf, or
    on a view of it, bumps its counter (PyTorch autograd mechanics, "In-place correctness checks")."""
    return [t._version for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]


def _copy(batch: Any) -> Any:
    """``batch`` with every tensor leaf cloned (a get_batch may hand out the same tensors each call)."""
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, batch)


def _check_mutation_settles(spec: ModelSpec, model: nn.Module, batch: Any, who: str) -> None:
    """``who`` changed the values of ``batch`` in place on its first call. Harmless when the change
    settles (``labels[labels == pad] = -100`` leaves the batch as it is on a second call: every
    measurement sees the same input); raise when a second forward and loss change it again
    (``x.mul_(2)``): every timed step, drift pass and training step would see another input, and
    the drift against fp32 measures that, not the precision.

    Raises:
        ModelSpecError: naming the batch leaf that keeps changing and the fix."""
    settled = _copy(batch)
    with torch.no_grad():
        _call_entry(spec, "loss_fn", spec.loss_fn, call_model(model, batch), batch)
    if _same_batch(batch, settled):
        return
    where = next((f"batch{pytree.keystr(p)}" for (p, a), b in zip(pytree.tree_flatten_with_path(batch)[0],
                                                                   pytree.tree_leaves(settled))
                  if not _same_batch(a, b)), "the batch")
    raise ModelSpecError(
        f"{spec.path}: {who} changes its input {where} in place, and again on every call (an in-place "
        "op such as x.mul_(2), x += y or x[...] = v on a batch tensor); autoprec runs each batch many "
        "times (the fp32 reference, torch.autocast, every policy), so each would see another input. "
        "Compute on a copy instead (x = x * 2, or x = x.clone() first)")


def validate_spec(spec: ModelSpec, device: torch.device | str = "cpu") -> tuple[nn.Module, Any]:
    """Run every entry point of ``spec`` once and check what it returns
    (docs/architecture.md#modelpy-contract).

    Builds the model once, calls ``get_batch(0, device)`` twice (determinism), runs one forward
    and ``loss_fn`` (no backward), counts the batch's tokens (``tokens_per_batch``), calls
    ``get_heldout_batch(0, device)`` where the file defines it, and builds the optimizer. Cost: one
    model build and one forward pass. The global RNG state (CPU and the device's) is restored
    afterwards, so a later ``build_model()`` initialises the same weights as without the check.

    Args:
        spec: From :func:`load_model_spec`.
        device: Device the batch and model are put on.

    Returns:
        ``(model, batch)``: the built model (on ``device``, train mode) and ``get_batch(0, device)``.

    Raises:
        ModelSpecError: an entry point raised (named, with the line in the file); ``build_model``
            returned no ``nn.Module``; ``get_batch`` returned something other than a Tensor,
            tuple/list or dict, or two different batches for step 0, or a dict key ``forward``
            does not take; the forward raised (for a tuple or list batch the message names how
            its items were bound to ``forward``'s parameters: :func:`positional_binding`); the
            loss is not a floating scalar tensor that requires grad; the forward or ``loss_fn``
            changes the batch in place on every call (:func:`_check_mutation_settles`);
            ``tokens_per_batch`` gave no
            positive number; ``get_heldout_batch`` returned no batch;
            ``make_optimizer`` returned no ``torch.optim.Optimizer``.
    """
    dev = torch.device(device)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        model = _call_entry(spec, "build_model()", spec.build_model)
        if not isinstance(model, nn.Module):
            raise ModelSpecError(f"{spec.path}: build_model returned {describe_value(model)}; "
                                 f"expected a torch.nn.Module (`{_REQUIRED['build_model']}`)")
        model = model.to(dev)
        model.train()
        batch = _call_entry(spec, "get_batch(0, device)", spec.get_batch, 0, dev)  # checked: CheckedGetBatch
        meta = next((p for p, t in pytree.tree_flatten_with_path(batch)[0]
                     if isinstance(t, torch.Tensor) and t.device.type == "meta"), None)
        if meta is not None:
            raise ModelSpecError(f"{spec.path}: get_batch(0, device) returned a tensor on the meta device at "
                                 f"batch{pytree.keystr(meta)} (it has a shape and no values); create the "
                                 f"batch's tensors on the device argument ({dev})")
        again = _call_entry(spec, "get_batch(0, device)", spec.get_batch, 0, dev)
        if not _same_batch(batch, again):
            raise ModelSpecError(f"{spec.path}: get_batch(0, device) returned different batches on two "
                                 "calls; it must be deterministic in step (e.g. seed a "
                                 "torch.Generator with step)")
        if isinstance(batch, Mapping):
            _check_batch_keys(spec, model, batch)
        versions, pristine = _versions(batch), _copy(batch)
        try:
            out = _call_entry(spec, "the model's forward on get_batch(0)", call_model, model, batch)
        except ModelSpecError as e:
            if (bound := positional_binding(model, batch)) is None:
                raise
            raise ModelSpecError(f"{e}; {bound}") from e
        in_forward = _versions(batch) != versions
        loss = _call_entry(spec, "loss_fn", spec.loss_fn, out, batch)
        _check_loss(spec, loss)
        del out, loss
        if _versions(batch) != versions and not _same_batch(batch, pristine):
            _check_mutation_settles(spec, model, batch, "the model's forward" if in_forward else "loss_fn")
        _check_tokens(spec, _call_entry(spec, "tokens_per_batch(batch)", spec.tokens_per_batch, batch))
        if spec.heldout_batch is not None:
            _call_entry(spec, "get_heldout_batch(0, device)", spec.heldout_batch, 0, dev)  # CheckedGetBatch
        params = [p for p in model.parameters() if p.requires_grad]
        opt = _call_entry(spec, "make_optimizer(params)", spec.make_optimizer, params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise ModelSpecError(f"{spec.path}: make_optimizer returned {describe_value(opt)}; "
                                 f"expected a torch.optim.Optimizer (`{_OPTIONAL['make_optimizer']}`)")
    return model, batch
