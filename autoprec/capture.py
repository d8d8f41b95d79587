"""Capture a model's forward as an ATen-level ``torch.fx.GraphModule`` (docs/architecture.md#data-flow,
#node-keys-and-op-classes).

``torch.export.export(..., strict=False)`` traces the model's forward (the training IR: ops
such as ``aten.linear``, ``aten.scaled_dot_product_attention`` stay whole) and
``ExportedProgram.module()`` turns it back into a callable ``GraphModule`` whose
``get_attr`` nodes read the *same* ``Parameter`` objects as the model, so gradients land on
the user's parameters and the optimizer, checkpoints and ``state_dict`` keys are unchanged.

Each ``call_function`` node gets a stable key ``<module path>/<op>#<k>`` in
``NodeMeta.key`` (:mod:`autoprec.nodemeta`; k counts that op inside that module in graph order), which
policies use to name nodes; keys do not depend on FX's generated node names.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import logging
import re
import sys
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import fx, nn

from autoprec._torch_compat import export_assert_ops, fake_tensor_errors
from autoprec.dims import export_ranges, export_refined, plan_dims
from autoprec.errors import CaptureError
from autoprec.modelspec import positional_binding, prepare_output, split_batch, training_kwargs
from autoprec.nodekeys import assign_keys, mark_regions
from autoprec.shapes import DIMS_META

__all__ = ["CALL_KWARGS_META", "capture", "quiet_pytree_deprecation"]

_log = logging.getLogger("autoprec")
#: (model class, its source file, the fixed kwargs) already announced: said once per process, however
#: many instances or captures (bench captures twice; a model file loaded again counts as the same)
_announced: set[tuple[str, str, str]] = set()

#: ``gm.meta`` key of the keyword arguments capture fixed for training (e.g. ``{"use_cache": False}``;
#: ``{}`` when none): they are part of the graph, so a call must not pass other values.
CALL_KWARGS_META = "autoprec_call_kwargs"

# Export inserts these runtime checks after `.to()` calls; they assert the fp32 dtype seen at
# trace time and would fail once a pass lowers the producer, so capture removes them.
_ASSERT_OPS = export_assert_ops()


@contextlib.contextmanager
def quiet_pytree_deprecation() -> Iterator[None]:
    """Silence torch's ``FutureWarning: isinstance(treespec, LeafSpec) is deprecated`` inside the block.

    torch (2.10+) emits it from its own pytree code when an exported module's pytree specs are
    built or deep-copied (``torch.export``, ``ExportedProgram.module()``, ``copy.deepcopy`` of the
    graph in autoprec's passes); the user can do nothing about it. Only that warning is filtered,
    only inside the block (``warnings.catch_warnings``), so every other warning still shows and the
    caller's filters are restored on exit.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)
        yield


@contextlib.contextmanager
def _quiet_partial_graph() -> Iterator[None]:
    """Keep torch.export's failure dump out of the user's terminal.

    When export fails, torch prints the partial FX graph (``e.partial_fx_graph``) to stderr and
    the ``symbolic_shapes`` logger warns "Unable to find user code"; :func:`capture`'s own error
    names the source line instead. stderr is buffered inside the block and written out afterwards
    without the partial graph, so everything else (the model's warnings) still shows.
    """
    buf = io.StringIO()
    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes_log.level
    shapes_log.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(buf):
            yield
    except Exception as e:
        partial = getattr(e, "partial_fx_graph", None)
        sys.stderr.write(buf.getvalue().replace(f"{partial}\n", "") if partial is not None
                         else buf.getvalue())
        raise
    else:
        sys.stderr.write(buf.getvalue())
    finally:
        shapes_log.setLevel(level)


def _is_user(filename: str) -> bool:
    return not any(p in filename for p in ("/torch/", "/autoprec/", "/transformers/utils/", "/contextlib.py"))


def _where(exc: BaseException, model: nn.Module | None = None) -> str:
    """The innermost user-code frame of a traceback, as ``file:line (function): code``.

    When that frame is a method of a submodule of ``model``, the module's dotted path and class
    are named too (``in module 'layers.0.mlp' (MyMLP)``).
    """
    import linecache

    tb, user = exc.__traceback__, None
    while tb is not None:
        if _is_user(tb.tb_frame.f_code.co_filename):
            user = tb
        tb = tb.tb_next
    if user is None:
        return "unknown location"
    frame, lineno = user.tb_frame, user.tb_lineno
    fname = frame.f_code.co_filename
    line = linecache.getline(fname, lineno).strip()
    where = f"{fname}:{lineno} ({frame.f_code.co_name}): {line}"
    owner = frame.f_locals.get("self")
    if isinstance(owner, nn.Module):
        path = next((n for n, m in (model.named_modules() if model is not None else []) if m is owner), None)
        label = "the root module" if path == "" else f"module {path!r}" if path else "module"
        where += f" [in {label} ({type(owner).__name__})]"
    return where


def capture(model: nn.Module, example_batch: Any, dynamic: bool = False,
            at_least: Mapping[str, int] | None = None) -> fx.GraphModule:
    """Capture ``model``'s forward on ``example_batch`` as an ATen ``GraphModule``.

    Args:
        model: The model, fp32 weights. It is not modified.
        example_batch: A dict (called as ``model(**batch)``), tuple/list (``model(*batch)``) or
            tensor, exactly as ``get_batch`` returns it. Shapes are specialised: the captured
            module must later be called with batches of the same structure and shapes.
        dynamic: Capture the batch and sequence dimensions as symbolic sizes within the ranges of
            :func:`autoprec.dims.plan_dims` (``torch.export`` ``Dim``s; recorded in
            ``gm.meta[autoprec.shapes.DIMS_META]``), so one graph serves every batch shape in range.
            A model that torch cannot export so (its code specialises a size) raises CaptureError.
        at_least: With ``dynamic``, sizes the ranges must reach beyond the example's, by role
            (``plan_dims``'s ``at_least``: the largest batch and length of several batches).

    Returns:
        A ``GraphModule`` with the model's call signature and output structure whose parameters
        are the model's own ``Parameter`` objects. ``node.meta["val"]`` holds a fake tensor
        (shape, dtype) per node and ``NodeMeta.key`` a stable node key. Outputs
        follow :func:`autoprec.modelspec.prepare_output`: ``ModelOutput`` dataclasses, tuples,
        dicts and ``None`` fields keep their type and fields, other values without tensors are
        returned unchanged. When ``forward`` has a ``use_cache`` parameter the batch does not set,
        the graph is the forward with ``use_cache=False`` (training needs no KV cache; logged once
        per process per model class on the ``autoprec`` logger); ``gm.meta[CALL_KWARGS_META]`` records it.

    Raises:
        CaptureError: ``torch.export`` failed; the message names the cause (a data-dependent
            branch, an op that cannot be traced, an output type that cannot be flattened, or
            torch's own message), the module class and the source line of the model code, and
            what to do; for a list batch, also how its items were bound to ``forward``'s
            parameters (:func:`autoprec.modelspec.positional_binding`).

    torch's own ``FutureWarning`` about ``isinstance(treespec, LeafSpec)`` is filtered during the
    export (:func:`quiet_pytree_deprecation`); warnings raised by the model's code still show.
    """
    args, kwargs = split_batch(example_batch)
    plan = plan_dims(model, args, kwargs, at_least) if dynamic else None
    shapes = plan.dynamic_shapes(model, args, kwargs) if plan is not None else None
    fixed = training_kwargs(model, args, kwargs)
    _announce(model, fixed)
    was_training = model.training
    try:
        with quiet_pytree_deprecation(), _quiet_partial_graph(), _training_forward(model, fixed):
            ep = export_refined(lambda ds: torch.export.export(model, args, kwargs, strict=False,
                                                               dynamic_shapes=ds), shapes)
    except CaptureError:
        raise
    except Exception as e:  # torch raises many types here (UserError, GuardOnDataDependent...)
        msg = _binding_error(model, args, kwargs) or _explain(e, model)
        if isinstance(example_batch, list) and (bound := positional_binding(model, example_batch)):
            msg += f"\n  Note: {bound}."  # a list is bound like a tuple; say so (issue 20)
        raise CaptureError(msg) from e
    finally:
        model.train(was_training)
    with quiet_pytree_deprecation():
        gm = ep.module()
    if shapes is not None:
        gm.meta[DIMS_META] = export_ranges(gm, ep, plan)
    gm.meta[CALL_KWARGS_META] = dict(fixed)
    _strip_asserts(gm)
    _check_shared_parameters(model, gm)
    assign_keys(gm)
    mark_regions(gm)
    return gm


def _announce(model: nn.Module, fixed: dict[str, Any]) -> None:
    """Log (INFO, ``autoprec`` logger) the training kwargs the capture fixes, once per process per
    model class (by name and source file) and kwargs."""
    if not fixed:
        return
    cls = type(model)
    args = ", ".join(f"{k}={v!r}" for k, v in fixed.items())
    key = (cls.__qualname__, str(getattr(sys.modules.get(cls.__module__), "__file__", cls.__module__)), args)
    if key not in _announced:
        _announced.add(key)
        _log.info("capturing %s for training with %s (forward() accepts it and the batch does not set it; "
                  "training needs no KV cache); the module apply() returns runs with it on every call",
                  type(model).__name__, args)


@contextlib.contextmanager
def _training_forward(model: nn.Module, fixed: dict[str, Any]) -> Iterator[None]:
    """Inside the block ``model.forward`` adds ``fixed`` to every call and passes its output
    through :func:`~autoprec.modelspec.prepare_output`; the signature export reads is unchanged."""
    own = model.__dict__.get("forward")  # an instance attribute the user set, if any
    orig = model.forward
    name = type(model).__name__

    @functools.wraps(orig)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return prepare_output(orig(*args, **fixed, **kwargs), name)

    model.forward = forward
    try:
        yield
    finally:
        if own is not None:
            model.forward = own
        else:
            del model.forward


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
    if _raised_by_user_code(e):
        return (f"forward() itself raised {type(e).__name__} (not a tracing limit)",
                "fix that line of the model code, or the example batch it is given; the same call "
                "fails without autoprec.")
    return ("torch.export cannot trace this code (torch's message follows; the original exception is "
            "chained as __cause__)",
            "change or move that line out of forward(); torch.export's documentation lists what "
            "non-strict export traces (https://pytorch.org/docs/stable/export.html).")


def _raised_by_user_code(e: BaseException) -> bool:
    """Whether the innermost frame of ``e``'s traceback is the model's code (a plain Python error)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and _is_user(tb.tb_frame.f_code.co_filename)


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


def _explain(e: BaseException, model: nn.Module) -> str:
    """The :class:`CaptureError` message for a failed export: cause, where, torch's line, what to do."""
    cause, todo = _cause(e)
    where = _where(e, model)
    if todo is _CONTROL_FLOW and not _is_branch(where):
        cause, todo = (_DATA_DEPENDENT_SIZE,
                       "keep sizes static (e.g. a mask instead of slicing by a tensor's "
                       "value), or bound the value with torch._check(...) (torch.export's docs on "
                       "unbacked sizes), or move it out of forward().")
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return (f"torch.export could not capture {type(model).__name__}: {cause}, at {where}.\n"
            f"  {type(e).__name__}: {first}\n  What to do: {todo}")


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


def _strip_asserts(gm: fx.GraphModule) -> None:
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _ASSERT_OPS and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


def _check_shared_parameters(model: nn.Module, gm: fx.GraphModule) -> None:
    """Ensure ``gm`` reads the model's own Parameters (so training updates the user's model)."""
    ours = {id(p) for p in model.parameters()}
    for name, p in gm.named_parameters():
        if id(p) not in ours:
            raise CaptureError(
                f"captured graph holds a copy of parameter {name!r} instead of the model's own; "
                "this torch version's export does not share parameters"
            )
