"""Why a capture failed, in words: the :class:`~autoprec.errors.CaptureError` message of a failed
``torch.export`` (docs/architecture.md#design-choices: "Capture failures are a CaptureError naming the
model's source line").

The message names the cause (a data-dependent branch or size, an op without a fake (meta)
implementation, a tensor converted outside torch, an output type export cannot flatten, an error of
the model's own code, or torch's message), where it happened (the innermost frame of the model's
code, ``file:line (function): code``, with the submodule's dotted path and class) and what to do.
"""

from __future__ import annotations

import functools
import inspect
import re
from types import TracebackType
from typing import Any

import torch
from torch import nn

from autoprec._torch_compat import fake_tensor_errors
from autoprec.modelspec import positional_binding
from autoprec.source import is_user_file

__all__ = ["checkpointing_refused", "explain_failure"]


def explain_failure(e: BaseException, model: nn.Module, example_batch: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> str:
    """The :class:`~autoprec.errors.CaptureError` message for ``torch.export``'s exception ``e``.

    Args:
        e: What ``torch.export.export`` raised (``UserError``, ``GuardOnDataDependentSymNode``, an
            error of the model's code, ...); its ``__cause__`` chain is searched too.
        model: The model being captured (names the class and the submodule at fault).
        example_batch: The batch as ``get_batch`` returned it (a list gets a note on how its items
            were bound to ``forward``'s parameters, :func:`autoprec.modelspec.positional_binding`).
        args, kwargs: ``example_batch`` as ``autoprec.modelspec.split_batch`` splits it.

    Returns:
        ``"autoprec could not capture M: the example batch ... does not match forward(...)"`` when the
        batch does not bind to ``forward``'s signature; ``"autoprec could not capture M: forward()
        itself raised <type> on the example batch ..."`` when the model, run eagerly on it
        (:func:`_eager_error`), raises too: the model's own error is the cause, with its line and
        message (labels the model's ``labels.view(-1)`` cannot take fail either way; export's
        message for such an error read as a tracing limit); else ``"torch.export could not capture M: <cause>,
        at <file:line (function): code> [in module 'a.b' (Cls)].\n  <torch's type>: <its first
        line>\n  What to do: <advice>"``.
    """
    msg = _binding_error(model, args, kwargs) or _explain(e, model, _eager_error(model, args, kwargs))
    if isinstance(example_batch, list) and (bound := positional_binding(model, example_batch)):
        msg += f"\n  Note: {bound}."  # a list is bound like a tuple; say so (issue 20)
    return msg


def _where(exc: BaseException, model: nn.Module | None = None) -> str:
    """The innermost user-code frame of a traceback, as ``file:line (function): code``.

    When that frame is a method of a submodule of ``model``, the module's dotted path and class
    are named too (``in module 'layers.0.mlp' (MyMLP)``). Where a library module's own forward,
    called from there (or from no user frame at all), reads a tensor's value on its failing line
    (``BatchNorm2d(momentum=None)``: ``float(self.num_batches_tracked)``), that line is named
    instead, marked as the library's code (:data:`_IN_LIBRARY`), with the user frame it was called
    from; no frame at all: ``"unknown location"``.
    """
    tb, user, library, depth = exc.__traceback__, None, None, 0
    modules = {id(m) for m in model.modules()} if model is not None else set()
    while tb is not None:
        depth += 1
        if is_user_file(tb.tb_frame.f_code.co_filename):
            user = (depth, tb)
        elif id(tb.tb_frame.f_locals.get("self")) in modules:
            library = (depth, tb)
        tb = tb.tb_next
    if library is not None and (user is None or library[0] > user[0]) and _reads_value(library[1]):
        where = _frame_at(library[1], model) + _IN_LIBRARY
        return where if user is None else f"{where} (called from {_frame_at(user[1], model)})"
    return "unknown location" if user is None else _frame_at(user[1], model)


def _reads_value(tb: TracebackType) -> bool:
    """Whether a traceback entry's source line reads a tensor's value in Python: a conversion
    (``float(...)``, ``int(...)``, ``bool(...)``, ``.item()``, ``.tolist()``) or a branch."""
    import linecache

    line = linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno).strip()
    return bool(re.search(r"\b(?:float|int|bool)\(|\.item\(|\.tolist\(", line)) or line.startswith(
        ("if ", "elif ", "while ", "assert "))


def _frame_at(tb: TracebackType, model: nn.Module | None) -> str:
    """A traceback entry as ``file:line (function): code [in module 'a.b' (Cls)]``."""
    import linecache

    frame, lineno = tb.tb_frame, tb.tb_lineno
    fname = frame.f_code.co_filename
    line = linecache.getline(fname, lineno).strip()
    where = f"{fname}:{lineno} ({frame.f_code.co_name}): {line}"
    owner = frame.f_locals.get("self")
    if isinstance(owner, nn.Module):
        path = next((n for n, m in (model.named_modules() if model is not None else []) if m is owner), None)
        label = "the root module" if path == "" else f"module {path!r}" if path else "module"
        where += f" [in {label} ({type(owner).__name__})]"
    return where



# torch messages that name an op the fake-tensor tracer cannot run (group 1 is the op).
_OP_PATTERNS = (
    re.compile(r"no fake impl registered for <CustomOpDef\((\S+)\)>"),
    re.compile(r"(?:operator|op) '?([\w.]+::[\w.]+)'? (?:does not|doesn't) have"),
    re.compile(r"Could not run '([\w.]+::[\w.]+)' with arguments from the 'Meta' backend"),
    re.compile(r"(\.numpy\(\)|\.tolist\(\)|data_ptr|data pointer)"),
)
_CONTROL_FLOW = ("data-dependent Python control flow (an `if` on tensor values) cannot be captured; "
                 "rewrite it with torch.where / torch.cond, or move it out of forward().")


def _cause(e: BaseException) -> tuple[str, str]:
    """What failed and what to do, from the exception (or one it was raised from)."""
    dynamic_shape_error, unsupported_op_error = fake_tensor_errors()
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    chain = [e]
    while chain[-1].__cause__ is not None and len(chain) < 8:
        chain.append(chain[-1].__cause__)
    for x in chain:
        text = str(x)
        if isinstance(x, GuardOnDataDependentSymNode) or "data-dependent expression" in text:
            return "a data-dependent branch", _CONTROL_FLOW
        if isinstance(x, dynamic_shape_error):
            return (f"the op {x.func} has an output shape that depends on tensor values",
                    "compute it with fixed-shape ops (e.g. a mask and torch.where instead of boolean "
                    "indexing or nonzero), or move it out of forward().")
        op = str(x.func) if isinstance(x, unsupported_op_error) else next(
            (m.group(1) for p in _OP_PATTERNS if (m := p.search(text))), None)
        if op is not None and op.startswith((".", "data")):
            what = f"Tensor{op}" if op.startswith(".") else "reading a tensor's data pointer"
            return (f"an unsupported op: {what} needs tensor data outside torch",
                    "keep the computation in torch ops (a traced tensor has no data to convert), "
                    "or move it out of forward().")
        if op is not None:
            return (f"an unsupported op: {op} has no fake (meta) implementation, so it cannot be traced",
                    f"register one with torch.library.register_fake({op!r}) (output shapes and dtypes "
                    "only), compute it with standard torch ops, or move it out of forward().")
        if m := re.search(r"Found (<class '[^']+'>|\S+) in output", text):
            return (f"an output of type {m.group(1)} that torch.export cannot flatten",
                    "return tensors, None, numbers, strings, or tuples/lists/dicts/ModelOutput dataclasses "
                    "of them, or register the type with torch.utils._pytree.register_pytree_node.")
    return ("torch.export cannot trace this code (torch's message follows; the original exception is "
            "chained as __cause__)",
            "change or move that line out of forward(); torch.export's documentation lists what "
            "non-strict export traces (https://pytorch.org/docs/stable/export.html).")


def _eager_error(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Exception | None:
    """What ``model``'s forward raises on the batch when run eagerly, without torch.export (no
    gradients recorded; the global RNG state restored after), or None when it runs."""
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - whatever the model's own code raises is the cause
        return err
    return None


def _binding_error(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The CaptureError message when the batch does not bind to ``model.forward``'s signature, else None."""
    try:
        inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as e:
        return (f"autoprec could not capture {type(model).__name__}: the example batch ({len(args)} "
                f"positional, keywords {list(kwargs)}) does not match "
                f"forward{inspect.signature(model.forward)}: {e}.\n  What to do: make get_batch return what "
                "forward() takes (a dict is passed as keyword arguments, a tuple or list as positional ones, "
                "a tensor as the one argument; docs/architecture.md#modelpy-contract).")
    except ValueError:  # no signature to check against
        return None
    return None


def _explain(e: BaseException, model: nn.Module, eager: Exception | None = None) -> str:
    """The :class:`CaptureError` message for a failed export: cause, where, torch's line, what to do;
    with ``eager`` (the same forward's error without export) that error is the cause."""
    if eager is not None:
        where, first = _where(eager, model), str(eager).strip().splitlines()[0] if str(eager).strip() else ""
        return (f"autoprec could not capture {type(model).__name__}: forward() itself raised "
                f"{type(eager).__name__} on the example batch, without autoprec or torch.export (not a "
                f"tracing limit), at {where}.\n  {type(eager).__name__}: {first}\n  What to do: fix that "
                "line of the model code, or the batch get_batch returns: the same call fails in plain "
                "PyTorch.")
    cause, todo = _cause(e)
    where = _where(e, model)
    if todo is _CONTROL_FLOW and _IN_LIBRARY in where:
        cause, todo = ("a value read from a tensor in a library module's own forward",
                       "that module, as configured, reads tensor values in Python (e.g. "
                       "BatchNorm's momentum=None keeps a cumulative average through its batch "
                       "counter): configure it so it does not (BatchNorm: a momentum such as the "
                       "default 0.1), or replace the module.")
    elif todo is _CONTROL_FLOW and not _is_branch(where):
        cause, todo = (_DATA_DEPENDENT_SIZE,
                       "keep sizes static (e.g. a mask instead of slicing by a tensor's "
                       "value), or bound the value with torch._check(...) (torch.export's docs on "
                       "unbacked sizes), or move it out of forward().")
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return (f"torch.export could not capture {type(model).__name__}: {cause}, at {where}.\n"
            f"  {type(e).__name__}: {first}\n  What to do: {todo}{_experts_hint(model)}")


#: Hugging Face config fields of LayerDrop (Fan et al. 2019, "Reducing Transformer Depth on
#: Demand"): in training a layer is skipped when ``torch.rand([]) < p``, a Python branch on a tensor.
_LAYERDROP_FIELDS = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")


def _experts_hint(model: nn.Module) -> str:
    """For a Hugging Face mixture-of-experts model built with ``experts_implementation="eager"`` (a
    Python loop over the experts the tokens were routed to: data-dependent), the setting that
    captures: transformers' default (``"grouped_mm"``, else ``"batched_mm"``); for a model whose
    config sets LayerDrop (:data:`_LAYERDROP_FIELDS`), that field set to 0.0; else empty.
    transformers 5 sets ``experts_implementation`` on models without experts too (a Wav2Vec2 was
    told about experts for its LayerDrop), so the experts hint needs a module with experts."""
    config = getattr(model, "config", None)
    drops = [f for f in _LAYERDROP_FIELDS if (getattr(config, f, 0) or 0) > 0]
    if drops and model.training:
        given = ", ".join(f"{f}={getattr(config, f)}" for f in drops)
        return (f" This model's config sets LayerDrop ({given}): in training each layer is skipped "
                "when a random number falls below it, a Python branch on a tensor; build it with "
                f"{', '.join(f'{f}=0.0' for f in drops)}.")
    experts = any("expert" in type(m).__name__.lower() for m in model.modules())
    if getattr(config, "_experts_implementation", None) != "eager" or not experts:
        return ""
    return (" This model's config sets experts_implementation='eager', a Python loop over the experts "
            "the tokens were routed to, whose count depends on the data: build it with transformers' "
            "default experts implementation (no experts_implementation argument; 'grouped_mm' or "
            "'batched_mm'), which torch.export captures.")


#: How :func:`_where` marks a location in a library module's code (no frame of the model's files).
_IN_LIBRARY = ", in the library's code, not the model's file"
_DATA_DEPENDENT_SIZE = "a value read from a tensor (.item(), int(tensor)) used as a size or an index"


def _is_branch(where: str) -> bool:
    """Whether the source line :func:`_where` found is Python control flow (``if``/``while``/
    ``assert``, a conditional expression, ``and``/``or``) rather than, e.g., a slice by a
    tensor's value; an unknown line counts as a branch (the advice stays as torch's)."""
    code = where.split("): ", 1)[1].split(" [in ", 1)[0] if "): " in where else ""
    if not code:
        return True
    words = f" {code} "
    return code.startswith(("if ", "elif ", "while ", "assert ")) or any(
        w in words for w in (" if ", " and ", " or ", " not "))



def checkpointing_refused(model: nn.Module, functions: list[Any]) -> str:
    """The :class:`CaptureError` message for a forward that calls ``torch.utils.checkpoint`` (HF's
    ``gradient_checkpointing_enable``, or the model's own calls; ``functions``: what each call
    checkpointed, :func:`autoprec._torch_compat.checkpoint_calls`). ``torch.export`` inlines the
    checkpointed function, so the captured graph would save its activations for backward: no
    recomputation, several times the activation memory, and no word of it."""
    paths = {id(m): n for n, m in model.named_modules()}
    names = list(dict.fromkeys(_checkpointed(f, paths) for f in functions))
    more = f" and {len(names) - 1} more" if len(names) > 1 else ""
    return (f"{type(model).__name__}'s forward uses gradient checkpointing (torch.utils.checkpoint) on "
            f"{names[0]}{more}: torch.export inlines it, so the captured graph would save every activation "
            "for backward, without recomputing any. Turn it off before autoprec.apply "
            "(model.activation_checkpointing_disable(), gradient_checkpointing_disable() before "
            "transformers 5, or your model's own switch); "
            "to trade compute for activation memory, give the policy an activation_memory_budget below 1.0 "
            "(autoprec tune --max-memory) and apply with compile=True: the compiled backward then "
            "recomputes activations (docs/architecture.md#policy-file).")


def _checkpointed(function: Any, paths: dict[int, str]) -> str:
    """What a checkpoint call ran: ``module 'model.layers.0' (Qwen2DecoderLayer)`` for a module, its
    bound method or a ``partial`` of a method with the module first (transformers'
    ``GradientCheckpointingLayer``), else the function's qualified name."""
    owner = None
    while isinstance(function, functools.partial):
        if owner is None and function.args and isinstance(function.args[0], nn.Module):
            owner = function.args[0]
        function = function.func
    if owner is None:
        owner = function if isinstance(function, nn.Module) else getattr(function, "__self__", None)
    if isinstance(owner, nn.Module):
        path = paths.get(id(owner))
        label = "the root module" if path == "" else f"module {path!r}" if path else "a module"
        return f"{label} ({type(owner).__name__})"
    return f"{getattr(function, '__qualname__', None) or repr(function)}()"
