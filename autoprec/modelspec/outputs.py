"""What a captured forward is called with and what it may return (docs/architecture.md#modelpy-contract).

Two rules, each with one home here, used by :mod:`autoprec.capture` and the module
:func:`autoprec.apply` returns:

- **Training call arguments** (:func:`training_kwargs`): training needs no KV cache, so when
  ``forward`` has a ``use_cache`` parameter the batch does not set, or takes ``**kwargs`` and wraps
  a model whose ``forward`` has one (peft's ``PeftModel``: ``get_base_model()``), the forward is
  captured with ``use_cache=False`` (Hugging Face models default to ``use_cache=True`` and then
  return a ``DynamicCache`` / ``EncoderDecoderCache`` inside their output).
- **Outputs** (:func:`prepare_output`): tensors become graph outputs; containers torch's pytree
  knows (tuple, list, dict, ``ModelOutput`` dataclasses, which transformers registers) keep their
  type and fields; ``None``, numbers and strings are constants of the graph; any other value that
  holds no tensor is kept out of the graph and returned unchanged (:class:`Kept`); a value of an
  unregistered type that holds tensors cannot be rebuilt from the graph's outputs and raises
  :class:`~autoprec.errors.CaptureError` naming its type and field path.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from autoprec._torch_compat import pytree
from autoprec.errors import CaptureError

__all__ = ["Kept", "TRAINING_KWARGS", "drop_fixed_kwargs", "grad_leaves", "prepare_output", "training_kwargs"]

#: Keyword arguments a training capture sets when ``forward`` accepts them and the batch does not.
TRAINING_KWARGS: dict[str, Any] = {"use_cache": False}

# Leaves torch.export accepts in an output as constants of the graph (torch/export/_trace.py).
_CONSTANTS = (type(None), bool, int, float, str)
_SEARCH_DEPTH = 4  # how deep inside an unknown object to look for a tensor (DynamicCache: .layers[i].keys)


class Kept:
    """Box for an output value that holds no tensor: it stays out of the graph, and unflattening
    the graph's output returns ``value`` itself (the box is a pytree node with no children whose
    context is the value), so callers get it back unchanged.

    Args:
        value: Any object without tensors (e.g. an enum, a config object).
    """

    def __init__(self, value: Any) -> None:
        self.value = value


pytree.register_pytree_node(
    Kept, lambda k: ([], k.value), lambda children, value: value,
    serialized_type_name="autoprec.modelspec.outputs.Kept",
    flatten_with_keys_fn=lambda k: ([], k.value),
)


def training_kwargs(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of :data:`TRAINING_KWARGS` that a training capture adds to a call.

    A name is added when the call sets it neither by keyword nor positionally and either
    ``inspect.signature(model.forward)`` has it as a named parameter, or ``forward`` takes
    ``**kwargs`` and the model it wraps (peft's ``get_base_model()``, else a child module
    ``base_model`` / ``model`` / ``module``) takes the name by these same rules, up to four wrappers
    deep. A ``**kwargs`` that reaches no model naming it gets nothing (it might reach a forward that
    rejects the name).

    Args:
        model: The model whose ``forward`` is inspected.
        args, kwargs: The call's arguments (:func:`autoprec.modelspec.split_batch` of the batch).

    Returns:
        E.g. ``{"use_cache": False}`` for a Hugging Face causal LM, or a peft ``PeftModelForCausalLM``
        around one, called with ``input_ids`` and ``labels``; ``{}`` when nothing is added (also when
        the signature cannot be read).
    """
    return {k: v for k, v in TRAINING_KWARGS.items()
            if k not in kwargs and _takes(model, k, len(args), _WRAP_DEPTH)}


#: How many ``**kwargs`` wrappers :func:`training_kwargs` looks through (peft: one).
_WRAP_DEPTH = 4
#: Child modules that hold the model a wrapper's ``forward(**kwargs)`` passes its arguments to.
_WRAPPED_ATTRS = ("base_model", "model", "module")


def _wrapped_model(model: nn.Module) -> nn.Module | None:
    """The model a wrapper module passes its ``forward`` arguments to, or None.

    Args:
        model: Any module.

    Returns:
        ``model.get_base_model()`` when the module has that method (peft's ``PeftModel``: the
        transformers model under the adapters), else its first child module among
        ``base_model``, ``model``, ``module``; None when there is none (or it is ``model`` itself).
    """
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base):
        try:
            inner = get_base()
        except Exception:  # a wrapper's own method that cannot answer here: look at its children
            inner = None
        if isinstance(inner, nn.Module) and inner is not model:
            return inner
    children = model.__dict__.get("_modules", {})
    return next((children[a] for a in _WRAPPED_ATTRS
                 if isinstance(children.get(a), nn.Module) and children[a] is not model), None)


def _takes(model: nn.Module, name: str, n_args: int, depth: int) -> bool:
    """Whether ``model``'s forward takes keyword ``name`` and ``n_args`` positional arguments do not
    set it: by name, or through ``**kwargs`` to the model it wraps (``depth`` wrappers at most)."""
    forward = getattr(model, "forward", None)
    positional, named, var_keyword = _forward_params(getattr(forward, "__func__", forward))
    if name in positional[:n_args]:
        return False
    if name in named:
        return True
    inner = _wrapped_model(model) if var_keyword and depth > 0 else None
    return inner is not None and _takes(inner, name, n_args, depth - 1)


@functools.lru_cache(maxsize=256)
def _forward_params(forward: Any) -> tuple[tuple[str, ...], frozenset[str], bool]:
    """``(positional names, named parameters, takes **kwargs)`` of a forward function, read once per
    function (``modelspec.call_model`` asks on every training step). ``self`` is dropped for a plain
    function; ``((), {}, False)`` when the signature cannot be read."""
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return (), frozenset(), False
    if params and params[0].name == "self" and inspect.isfunction(forward):
        params = params[1:]
    positional = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    named = frozenset(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    return positional, named, any(p.kind is p.VAR_KEYWORD for p in params)


def prepare_output(out: Any, model_name: str) -> Any:
    """``out`` with every leaf torch.export cannot return boxed in :class:`Kept`, or an error.

    Args:
        out: What ``forward`` returned (during the export trace: fake tensors inside).
        model_name: The model class, named in the error.

    Returns:
        ``out`` rebuilt with the same containers; tensors and :data:`_CONSTANTS` unchanged, other
        values that hold no tensor boxed.

    Raises:
        CaptureError: A leaf of a type torch's pytree does not know holds tensors (e.g. a
            ``DynamicCache`` when the batch sets ``use_cache=True``); the message names the type,
            the output field path (``output['past_key_values']``), where the tensor sits inside it
            and what to do.
    """
    try:
        pairs, spec = pytree.tree_flatten_with_path(out)
    except ValueError:  # a registered type without key paths: name leaves by position
        leaves, spec = pytree.tree_flatten(out)
        pairs = [(f"<leaf {i}>", leaf) for i, leaf in enumerate(leaves)]
    kept = [_keep(path, leaf, model_name) for path, leaf in pairs]
    return pytree.tree_unflatten(kept, spec)


def _keep(path: Any, leaf: Any, model_name: str) -> Any:
    if isinstance(leaf, torch.Tensor) or isinstance(leaf, _CONSTANTS):
        return leaf
    inner = _tensor_inside(leaf, "", _SEARCH_DEPTH, set())
    if inner is None:
        return Kept(leaf)
    field = "output" + (path if isinstance(path, str) else pytree.keystr(path))
    cls = type(leaf)
    cache = "Cache" in cls.__name__
    raise CaptureError(
        f"autoprec could not capture {model_name}: its output field {field} is a {cls.__name__} "
        f"({cls.__module__}.{cls.__qualname__}) holding tensors (at {cls.__name__}{inner}), a type "
        "torch.export cannot flatten into graph outputs.\n  What to do: "
        + ("a KV cache is not needed for training: set model.config.use_cache = False, or pass "
           "use_cache=False in the batch if forward() accepts it (autoprec passes use_cache=False by "
           "itself only when the batch leaves use_cache out and forward() names a use_cache parameter, "
           "or takes **kwargs and wraps a model whose forward() does, as peft's get_base_model()); "
           if cache else "")
        + "return tensors, None, numbers, strings, or tuples/lists/dicts/ModelOutput dataclasses of "
        f"them from forward(), or register {cls.__name__} with torch.utils._pytree.register_pytree_node."
    )


def _tensor_inside(obj: Any, where: str, depth: int, seen: set[int]) -> str | None:
    """The attribute/item path of a tensor inside ``obj`` (``""`` if ``obj`` is one), or None."""
    if isinstance(obj, torch.Tensor):
        return where
    if depth == 0 or id(obj) in seen or isinstance(obj, (_CONSTANTS, type, nn.Module)):
        return None
    seen.add(id(obj))
    if isinstance(obj, Mapping):
        items = [(f"[{k!r}]", v) for k, v in obj.items()]
    elif isinstance(obj, (tuple, list, set, frozenset)):
        items = [(f"[{i}]", v) for i, v in enumerate(obj)]
    else:
        attrs = getattr(obj, "__dict__", None) or {}
        slots = [s for c in type(obj).__mro__ for s in _slots(c) if hasattr(obj, s)]
        items = [(f".{k}", v) for k, v in {**attrs, **{s: getattr(obj, s) for s in slots}}.items()]
    for key, value in items:
        found = _tensor_inside(value, where + key, depth - 1, seen)
        if found is not None:
            return found
    return None


def _slots(cls: type) -> tuple[str, ...]:
    slots = getattr(cls, "__slots__", ())
    return (slots,) if isinstance(slots, str) else tuple(slots)


def drop_fixed_kwargs(kwargs: dict[str, Any], fixed: Mapping[str, Any], what: str) -> dict[str, Any]:
    """``kwargs`` without the arguments a training capture fixed (:func:`training_kwargs`).

    The graph was traced with ``fixed`` inside it (e.g. ``use_cache=False``), so it takes no such
    argument: passing the same value is allowed and dropped, another value cannot be honoured.

    Args:
        kwargs: The call's keyword arguments.
        fixed: ``gm.meta[autoprec.capture.CALL_KWARGS_META]`` of the captured graph.
        what: The callee, named in the error (e.g. ``"MixedPrecisionModule of Qwen2ForCausalLM"``).

    Returns:
        ``kwargs`` itself when it sets none of ``fixed``, else a copy without them.

    Raises:
        ValueError: The call sets a fixed argument to another value (e.g. ``use_cache=True``).
    """
    if not fixed or fixed.keys().isdisjoint(kwargs):
        return kwargs
    for k, v in fixed.items():
        if k in kwargs and kwargs[k] is not v and kwargs[k] != v:
            raise ValueError(
                f"{what} was captured for training with {k}={v!r} (forward() accepts it and the example "
                f"batch did not set it), so the graph cannot run with {k}={kwargs[k]!r}; drop {k} from the "
                f"call or pass {k}={v!r} (training needs no KV cache; use the model itself for generation)")
    return {k: v for k, v in kwargs.items() if k not in fixed}


def grad_leaves(out: Any) -> list[torch.Tensor]:
    """The floating tensors of a model output that carry gradient, in flatten order (a mapping,
    ``ModelOutput`` included, by its values): what a backward through the output can start from."""
    if isinstance(out, Mapping):
        out = list(out.values())
    return [t for t in pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
