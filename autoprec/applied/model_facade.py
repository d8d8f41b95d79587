"""How a :class:`~autoprec.applied.apply.MixedPrecisionModule` presents its model to trainers that
introspect it, Hugging Face ``Trainer`` first (docs/architecture.md#runtime): :class:`ModelFacade`,
its ``nn.Module`` face (the model's parameters, modules, ``state_dict``, ``config``), the model's
forward signature, and the refusal of ``torch.autocast`` around a policy, of data-parallel wrappers
in the wrong place (docs/distributed.md: ``autoprec.ddp`` and ``autoprec.shard`` wrap the applied
module) and of Parameters replaced since the capture."""

from __future__ import annotations

import copy
import functools
import inspect
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from autoprec.errors import CaptureError

__all__ = ["ModeSnapshot", "ModelFacade", "ParameterSnapshot", "check_no_autocast", "check_not_fully_sharded",
           "check_not_wrapped", "model_attr", "signed_class"]


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


def _fsdp_module() -> type | None:
    """FSDP2's ``FSDPModule`` (``torch.distributed.fsdp``; ``torch.distributed._composable.fsdp`` in
    torch 2.5), the class ``fully_shard`` mixes into a module it wraps; None without it. Not cached
    with ``functools.cache``: a user's ``torch.compile`` of the applied module traces every call's
    check, and Dynamo warns about a cache wrapper (the import after the first is a dict lookup)."""
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


class ModeSnapshot:
    """The training flags of the wrapped model's submodules that the graph was captured with, so a
    training call notices one switched since (``model.model.layers.eval()`` to drop dropout in some
    layers, a frozen BatchNorm switched back by ``model.train()``): the graph keeps its captured
    modes, and the change went unnoticed. Warns once per module; the root's own flag is the
    module's mode (:attr:`ModelFacade.training`), not checked here.

    Args:
        model: The wrapped model, in the modes its graph was captured with.
    """

    def __init__(self, model: nn.Module) -> None:
        self.modes = [m.training for m in model.modules()][1:]
        self.warned = False

    def check(self, model: nn.Module, what: str) -> None:
        """Warn (``UserWarning``, once) when a submodule's flag differs from the capture's (tens of
        microseconds for a few hundred modules)."""
        if self.warned:
            return
        flags = [m.training for m in model.modules()][1:]  # names only when one differs
        if len(flags) != len(self.modes) or flags == self.modes:
            return
        self.warned = True
        now = list(model.named_modules())[1:]
        changed = [(n, m.training) for (n, m), t in zip(now, self.modes) if m.training != t]
        name, mode = changed[0]
        warnings.warn(f"{what}: {len(changed)} submodule(s) are in another mode than the graph was captured "
                      f"with ({name!r} is now in {'training' if mode else 'eval'} mode; e.g. a submodule's "
                      ".eval() after autoprec.apply, or model.train() over one captured in eval mode). The "
                      "graph runs the modes it was captured in (dropout, batch norm statistics); to train "
                      "with these, apply the policy again after setting them", stacklevel=3)


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
        self.params = [(n, p, p.shape, p.dtype) for n, p in model.named_parameters()]

    def check(self, model: nn.Module, what: str) -> None:
        """Raise unless ``model``'s Parameters are the snapshot's (same names, same objects of the
        same shapes and dtypes, same order; about a microsecond per Parameter).
        ``resize_token_embeddings`` keeps the Parameter object and gives it new data of another
        shape; ``model.half()`` / ``model.to(torch.bfloat16)`` on the wrapped model keeps it and
        converts its data (low-precision master weights: updates below their resolution round away, C08).

        Raises:
            ValueError: one was replaced, reshaped, converted, added or removed; names the first and
                what to do.
        """
        now = list(model.named_parameters())
        converted = [(n, p.dtype) for (n, p), (_m, q, _s, dtype) in zip(now, self.params)
                     if p is q and p.dtype != dtype]
        if converted:
            name, dtype = converted[0]
            raise ValueError(f"{what}: the model's Parameter {name!r} is {dtype} since autoprec.apply "
                             f"({len(converted)} converted: e.g. model.half() or model.to(torch.bfloat16) on "
                             "the wrapped model). The Parameters are the fp32 master weights that training "
                             "updates; in a low dtype, updates below its resolution round away (case C08), "
                             "and the policy already decides what computes in bf16/fp16: convert them back "
                             "with model.float()")
        differs = [n for (n, p), (m, q, shape, _d) in zip(now, self.params)
                   if n != m or p is not q or p.shape != shape]
        if not differs and len(now) == len(self.params):
            return
        changed = differs[0] if differs else f"{len(now)} Parameters against {len(self.params)}"
        raise ValueError(f"{what}: the model's Parameters changed since autoprec.apply ({changed}: e.g. "
                         "model.load_state_dict(..., assign=True), resize_token_embeddings or a replaced "
                         "module); the graph reads the ones it captured. Load weights in place "
                         "(mp.load_state_dict(state)) or apply the policy again")


class ModelFacade(nn.Module):
    """The base of :class:`~autoprec.applied.apply.MixedPrecisionModule`: the ``nn.Module`` face it
    shows trainers, optimizers and checkpoints, which is the wrapped model's (``self.model``, set by
    the subclass with ``self._what``, how messages name it): its parameters, buffers, modules and
    ``state_dict`` under the model's own names, its ``config``, ``main_input_name`` and
    ``save_pretrained``; and the refusals of what would silently break the captured graph
    (gradient checkpointing after the capture, a dtype conversion of the master weights, pickling,
    ``load_state_dict(assign=True)``)."""

    #: Trainer passes ``num_items_in_batch`` to models that accept loss kwargs; the graph does not.
    accepts_loss_kwargs = False
    #: Checkpointing would have to be in the captured graph (see :meth:`gradient_checkpointing_enable`).
    supports_gradient_checkpointing = False
    config = model_attr("config", "The wrapped model's ``config`` (Hugging Face models).")
    main_input_name = model_attr("main_input_name", "The wrapped model's ``main_input_name``.")
    _keys_to_ignore_on_save = model_attr("_keys_to_ignore_on_save",
                                         "The wrapped model's (Trainer's resume reads it).")
    model: nn.Module
    _what: str

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The wrapped model's named parameters (fp32 master weights)."""
        return self.model.named_parameters(prefix, recurse, remove_duplicate)

    def named_modules(self, memo: set[nn.Module] | None = None, prefix: str = "",
                      remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Module]]:
        """This module, standing in for the wrapped model's root, then the model's submodules
        under the model's own names, which ``get_submodule``/``get_parameter`` resolve
        (:meth:`get_submodule`). So ``named_modules()`` x
        ``named_parameters(recurse=False)`` reaches every Parameter, as ``DistributedDataParallel``
        collects them (``_build_params_for_reducer``); before, DDP found only the root's direct
        Parameters (none for an ``nn.Sequential``: a SIGSEGV in ``_verify_params_across_processes``).
        """
        memo = set() if memo is None else memo
        if self in memo or self.model in memo:
            return
        if remove_duplicate:
            memo.update((self, self.model))
        yield prefix, self
        for name, child in self.model.named_children():
            yield from child.named_modules(memo, f"{prefix}.{name}" if prefix else name, remove_duplicate)

    def get_submodule(self, target: str) -> nn.Module:
        """This module for ``""``, else the wrapped model's submodule ``target``
        (``self.model.get_submodule``): the names ``named_modules()`` gives, so ``get_parameter``
        resolves ``named_parameters()``' names too. ``nn.Module.get_submodule`` walked this module's
        attributes, where ``model`` is the whole wrapped model (31 of 32 names of a Qwen2 failed).

        Raises:
            AttributeError: the wrapped model has no submodule ``target`` (torch's message).
        """
        return self if target == "" else self.model.get_submodule(target)

    @property
    def _autoprec_wrapped(self) -> nn.Module:
        """The wrapped model, under a name no model's child has (:meth:`_fqn_modifiers`)."""
        return self.model

    def _fqn_modifiers(self) -> dict[str, str]:
        """torch.distributed.checkpoint.state_dict's hook for a module whose state-dict names skip
        an attribute (``_get_fqns`` steps into ``self.<value>`` before it looks ``<key>`` up): each
        child name of the wrapped model goes through :attr:`_autoprec_wrapped`. Without it
        ``get_state_dict``/``set_state_dict`` walked ``mp.transformer`` (AttributeError at a DDP
        run's first save), and a Llama-family ``ForCausalLM``'s child ``model`` resolved to this
        module's ``model``, the whole wrapped model."""
        return dict.fromkeys((name for name, _ in self.model.named_children()), "_autoprec_wrapped")

    def named_children(self) -> Iterator[tuple[str, nn.Module]]:
        """The wrapped model's children (so ``children()``, ``apply(fn)``, ``.to()`` and Trainer's
        weight-decay groups, ``get_parameter_names``, reach the model's modules under its names)."""
        return self.model.named_children()

    def save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's ``save_pretrained`` (Hugging Face models): the files ``from_pretrained``
        of the model's own class loads, weights as trained (they are the model's Parameters).

        Raises:
            TypeError: the wrapped model has no ``save_pretrained``.
        """
        save = self._model_method("save_pretrained", "save mp.state_dict() (the model's keys) instead")
        return save(save_directory, *args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's ``generate`` (Hugging Face models): sampling runs the model's own
        forward on its Parameters (the trained fp32 master weights), not the policy's graph, which
        is a training step's (captured with ``use_cache=False``, at training shapes). The mode is
        the caller's to set, as without autoprec (``mp.eval()`` first: dropout off).

        Returns:
            What ``model.generate`` returns (token ids, ``[batch, prompt + new tokens]``, int64).

        Raises:
            TypeError: the wrapped model has no ``generate``.
        """
        generate = self._model_method("generate", "call the model itself (mp.model) for inference")
        return generate(*args, **kwargs)

    def _model_method(self, name: str, instead: str) -> Callable[..., Any]:
        """The wrapped model's method ``name`` (a Hugging Face model's).

        Raises:
            TypeError: the model has none; the message names it and says what to do ``instead``.
        """
        method = getattr(self.model, name, None)
        if method is None:
            raise TypeError(f"{self._what}: the wrapped model has no {name}; {instead}")
        return method

    def gradient_checkpointing_enable(self, *args: Any, **kwargs: Any) -> None:
        """Refused: the graph is captured and lowered already, so checkpointing the model now would not
        change it.

        Raises:
            ValueError: always; says what to use instead.
        """
        raise ValueError(
            f"{self._what}: gradient checkpointing cannot be switched on after autoprec.apply (the graph is "
            "captured and lowered already). Set TrainingArguments(gradient_checkpointing=False, "
            "activation_checkpointing=False); to trade compute for activation memory, give the policy an "
            "activation_memory_budget below 1.0 and apply with compile=True "
            "(docs/architecture.md#policy-file)")

    activation_checkpointing_enable = gradient_checkpointing_enable

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """The wrapped model's named buffers."""
        return self.model.named_buffers(prefix, recurse, remove_duplicate)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped model's ``state_dict`` (same keys as without autoprec)."""
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load into the wrapped model in place (the graph reads the same tensors)."""
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace the Parameters the graph reads")
        return self.model.load_state_dict(state_dict, strict=strict)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
                              strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        """``nn.Module``'s per-module load step, which a *parent's* ``load_state_dict`` (DDP, a model
        holding this module as a child) calls instead of :meth:`load_state_dict`: the keys under
        ``prefix`` load into the wrapped model, and its missing and unexpected keys are reported
        with the prefix. Without it every key came back unexpected and none missing: a container's
        own state_dict did not load (strict), or the wrapped weights stayed as they were without a
        word (``strict=False``).

        Raises:
            ValueError: the load assigns (``assign=True``): it would replace the Parameters the
                graph reads."""
        if local_metadata.get("assign_to_params_buffers", False):
            raise ValueError("load_state_dict(assign=True) would replace the Parameters the graph reads")
        own = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        try:
            result = self.model.load_state_dict(own, strict=False)
        except RuntimeError as e:  # sizes that do not match: the parent raises with every message
            error_msgs.append(f"under {prefix!r}: {e}")  # the wrapped model's names are without it
            return
        missing_keys += [prefix + k for k in result.missing_keys]
        unexpected_keys += [prefix + k for k in result.unexpected_keys]

    def _apply(self, fn: Any, recurse: bool = True) -> ModelFacade:
        """``nn.Module``'s conversion hook (``.to()``, ``.half()``, ``.cuda()``...), refusing a floating
        dtype other than fp32 before anything is converted.

        Raises:
            ValueError: the conversion would make the model's Parameters, the fp32 master weights
                the graph reads and training updates, another dtype (``mp.to(torch.float16)``,
                ``mp.half()``); the policy decides what computes in bf16/fp16. ``.to(device)`` is
                accepted.
        """
        dtype = fn(torch.zeros((), dtype=torch.float32)).dtype  # what it does to an fp32 tensor
        if dtype != torch.float32:
            raise ValueError(f"{self._what}: this conversion would make the model's Parameters {dtype}; "
                             "they are the fp32 master weights the graph reads and training updates, and the "
                             "policy decides what computes in bf16/fp16 (docs/architecture.md#runtime): move "
                             "the module with .to(device) only")
        return super()._apply(fn, recurse)

    def __deepcopy__(self, memo: dict[int, Any]) -> ModelFacade:
        """A deep copy (an EMA copy): what ``copy.deepcopy``'s default does for a module (its state
        copied, ``nn.Module.__setstate__``), kept so :meth:`__reduce_ex__` can refuse pickling."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return new

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Refused: ``torch.save(mp)`` / ``pickle`` (the per-signature class, compiled code and hooks
        do not pickle; it failed with a PicklingError about the class).

        Raises:
            TypeError: always; says what to save instead.
        """
        raise TypeError(f"{self._what} cannot be pickled (torch.save(mp)): save mp.state_dict() (the "
                        "model's keys) or the model itself, and apply the policy to it again after loading")

    @property
    def training(self) -> bool:
        """The wrapped model's training flag (its root module's), which this module's mode is: in
        training mode a call runs the lowered graph, in eval mode the model's own forward
        (``MixedPrecisionModule.forward``). So ``mp.eval()`` and ``model.eval()`` are one switch,
        and so are ``mp.train()`` and ``model.train()``: before, each module kept a flag of its own,
        and ``model.eval()`` for validation left the module running the training graph (dropout on),
        while ``mp.eval(); model.train()`` trained the model's own fp32 forward, without the policy.
        A new module is in training mode (:class:`~autoprec.applied.apply.MixedPrecisionModule`
        switches a model applied wholly in eval mode to training mode, as the capture traced it);
        the graph keeps the submodule modes it was captured in (:func:`autoprec.capture.capture`)."""
        model = self.__dict__.get("model")
        return True if model is None else model.training

    @training.setter
    def training(self, mode: bool) -> None:
        model = self.__dict__.get("model")  # None while nn.Module.__init__ sets the flag
        if model is not None:
            model.training = mode

    def train(self, mode: bool = True) -> ModelFacade:
        """Set the training flag of the wrapped model and its submodules (``model.train(mode)``),
        which is this module's (:attr:`training`)."""
        self.model.train(mode)
        return self
