"""How a :class:`~autoprec.applied.apply.MixedPrecisionModule` presents its model to trainers that
introspect it, Hugging Face ``Trainer`` first (docs/architecture.md#runtime): the model's forward
signature, attributes read through, and the refusal of ``torch.autocast`` around a policy and of
data-parallel wrappers in the wrong place (docs/distributed.md: ``autoprec.ddp`` and
``autoprec.shard`` wrap the applied module)."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

from autoprec.errors import CaptureError

__all__ = ["ParameterSnapshot", "check_no_autocast", "check_not_fully_sharded", "check_not_wrapped",
           "model_attr", "model_submodule", "signed_class"]


def model_attr(name: str, doc: str) -> property:
    """A read-only property reading attribute ``name`` of the wrapped model (``self.model``).

    Args:
        name: The attribute, e.g. ``"config"``.
        doc: The property's docstring.

    Returns:
        The property. Reading it raises ``AttributeError`` when the model has no such attribute,
        so ``getattr(mp, name, default)`` and ``hasattr`` answer as they do for the model.
    """
    def get(self: nn.Module) -> Any:
        model = self.__dict__.get("model")
        if model is None:
            raise AttributeError(name)
        return getattr(model, name)

    return property(get, doc=doc)


#: Subclasses of MixedPrecisionModule whose ``forward`` reports a model's signature, per (class, signature).
_SIGNED: dict[tuple[type, str], type] = {}


def model_submodule(self: nn.Module, target: str) -> nn.Module:
    """``MixedPrecisionModule.get_submodule``: the module itself for ``""``, else the wrapped model's
    submodule ``target`` (``self.model.get_submodule``), the names ``named_modules()`` gives; so
    ``get_parameter`` resolves ``named_parameters()``' names too. ``nn.Module.get_submodule`` walked
    the module's attributes, where ``model`` is the whole wrapped model.

    Raises:
        AttributeError: the wrapped model has no submodule ``target`` (torch's message).
    """
    return self if target == "" else self.__dict__["model"].get_submodule(target)


def signed_class(cls: type, model: nn.Module) -> type:
    """A subclass of ``cls`` whose ``forward`` reports ``model.forward``'s signature.

    Hugging Face ``Trainer`` reads the signature on the instance (which dataset columns to keep,
    ``Trainer._set_signature_columns_if_needed``) and on the class (``find_labels`` and
    ``can_return_loss`` in transformers/utils/generic.py: the label names, without which
    ``evaluate`` reports no ``eval_loss``). The subclass's ``forward`` calls ``cls.forward``
    unchanged; it has ``cls``'s name, module and docstring, and is made once per class and signature.

    Args:
        cls: The module class (``MixedPrecisionModule`` or a subclass).
        model: The wrapped model.

    Returns:
        The subclass, or ``cls`` itself when ``model.forward`` has no signature ``inspect`` can read.
    """
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return cls
    key = (cls, f"{type(model).__module__}.{type(model).__qualname__}{sig}")
    if key not in _SIGNED:
        base = cls.forward

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return base(self, *args, **kwargs)

        functools.update_wrapper(forward, base)
        self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        forward.__signature__ = sig.replace(parameters=[self_param, *sig.parameters.values()])
        _SIGNED[key] = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                                   "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
    return _SIGNED[key]


def check_no_autocast(what: str) -> None:
    """Refuse a call under ``torch.autocast``: autocast recasts the graph's ops, overriding the policy.

    Args:
        what: How the message names the module, e.g. ``"MixedPrecisionModule of Qwen2ForCausalLM"``.

    Raises:
        ValueError: autocast is enabled for ``cpu`` or ``cuda``; the message names the device and dtype
            and what sets it (Trainer's ``bf16``/``fp16``, accelerate's ``mixed_precision``).
    """
    for device_type in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device_type):
            raise ValueError(
                f"{what} was called under torch.autocast({device_type!r}, "
                f"{torch.get_autocast_dtype(device_type)}), e.g. by transformers.Trainer with "
                "TrainingArguments(bf16=True) or fp16=True, or by accelerate's mixed_precision: autocast "
                "would recast the policy's nodes and override its dtypes. The policy already sets each "
                "node's dtype: train with bf16=False and fp16=False (fp16 policies: "
                "autoprec.integrations.transformers.AutoprecTrainer, which adds the loss scaler).")


@functools.cache
def _fsdp_module() -> type | None:
    """FSDP2's ``FSDPModule`` (``torch.distributed.fsdp``; ``torch.distributed._composable.fsdp`` in
    torch 2.5), the class ``fully_shard`` mixes into a module it wraps; None without it."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            return None
    return FSDPModule


def check_not_wrapped(model: nn.Module) -> None:
    """Refuse to apply a policy to a model already wrapped in ``DistributedDataParallel`` or by
    FSDP2's ``fully_shard``: the capture needs the model itself (``torch.export`` fails on the
    wrapper with an empty message).

    Raises:
        CaptureError: names the wrapper and the order that works.
    """
    fsdp = _fsdp_module()
    wrapper = ("DistributedDataParallel" if isinstance(model, nn.parallel.DistributedDataParallel) else
               "fully_shard (FSDP2)" if fsdp is not None and isinstance(model, fsdp) else None)
    if wrapper is not None:
        raise CaptureError(f"apply: the model ({type(model).__name__}) is already wrapped by {wrapper}; "
                           "apply the policy to the model itself, then wrap what apply returns: "
                           "autoprec.ddp(mp) for DDP, autoprec.shard(mp) for FSDP2 (docs/distributed.md)")


def check_not_fully_sharded(module: nn.Module, what: str) -> None:
    """Refuse a call of an applied module that FSDP2's ``fully_shard`` wrapped directly: FSDP2
    finds Parameters through ``children()``, which the applied module hides from it, so the graph
    would not read the Parameters FSDP2 manages and training would go wrong without an error.

    Raises:
        ValueError: names the module and :func:`autoprec.shard`, the wrapper that works.
    """
    fsdp = _fsdp_module()
    if fsdp is not None and isinstance(module, fsdp):
        raise ValueError(f"{what} was wrapped by fully_shard directly; FSDP2 does not see the Parameters "
                         "its graph reads, so training would be wrong: shard it with autoprec.shard(mp) "
                         "instead (docs/distributed.md)")


class ParameterSnapshot:
    """The wrapped model's Parameters as ``apply`` captured them (``named_parameters()``: names and
    the Parameter objects), so a training call notices one replaced since: the graph reads the
    captured ones, so after ``model.load_state_dict(..., assign=True)`` it trained the old tensors
    while the optimizer held the new ones (no gradient reached them), silently, and after
    ``resize_token_embeddings`` it failed inside the graph with a shape error. A deep copy of the
    module (an EMA copy) copies the snapshot with the model, so it matches the copy's Parameters.

    Args:
        model: The wrapped model, as captured.
    """

    def __init__(self, model: nn.Module) -> None:
        self.params = [(n, p, p.shape) for n, p in model.named_parameters()]

    def check(self, model: nn.Module, what: str) -> None:
        """Raise unless ``model``'s Parameters are the snapshot's (same names, same objects of the
        same shapes, same order; about a microsecond per Parameter). ``resize_token_embeddings``
        keeps the Parameter object and gives it new data of another shape.

        Raises:
            ValueError: one was replaced, reshaped, added or removed; names the first and what to do.
        """
        now = list(model.named_parameters())
        differs = [n for (n, p), (m, q, shape) in zip(now, self.params)
                   if n != m or p is not q or p.shape != shape]
        if not differs and len(now) == len(self.params):
            return
        changed = differs[0] if differs else f"{len(now)} Parameters against {len(self.params)}"
        raise ValueError(f"{what}: the model's Parameters changed since autoprec.apply ({changed}: e.g. "
                         "model.load_state_dict(..., assign=True), resize_token_embeddings or a replaced "
                         "module); the graph reads the ones it captured. Load weights in place "
                         "(mp.load_state_dict(state)) or apply the policy again")
