"""Capture a model's forward as an ATen-level ``torch.fx.GraphModule`` (docs/architecture.md#data-flow,
#node-keys-and-op-classes).

``torch.export.export(..., strict=False)`` traces the model's forward (the training IR: ops
such as ``aten.linear``, ``aten.scaled_dot_product_attention`` stay whole; the one call is
:func:`autoprec.capture.export.export_program`) and ``ExportedProgram.module()`` turns it back into
a callable ``GraphModule`` whose ``get_attr`` nodes read the *same* ``Parameter`` objects as the
model, so gradients land on the user's parameters and the optimizer, checkpoints and
``state_dict`` keys are unchanged.

Each ``call_function`` node gets a stable key ``<module path>/<op>#<k>`` in
``NodeMeta.key`` (:mod:`autoprec.nodemeta`; k counts that op inside that module in graph order), which
policies use to name nodes; keys do not depend on FX's generated node names.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import fx, nn

from autoprec._torch_compat import autograd_function_calls, checkpoint_calls, export_assert_ops
from autoprec.capture.causal import causal_attention
from autoprec.capture.custom_backward import check_custom_backward, custom_functions
from autoprec.capture.diagnose import checkpointing_refused, explain_failure
from autoprec.capture.dims import DimPlan, plan_dims
from autoprec.capture.export import (
    export_program,
    export_ranges,
    quiet_partial_graph,
    quiet_pytree_deprecation,
)
from autoprec.capture.shapes import DIMS_META
from autoprec.errors import CaptureError
from autoprec.modelspec import prepare_output, split_batch, training_kwargs
from autoprec.nodekeys import assign_keys, mark_regions

__all__ = ["CALL_KWARGS_META", "capture", "capture_planned"]

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


def capture(model: nn.Module, example_batch: Any, dynamic: bool = False,
            at_least: Mapping[str, int] | None = None) -> fx.GraphModule:
    """Capture ``model``'s forward on ``example_batch`` as an ATen ``GraphModule``.

    Args:
        model: The model, fp32 weights. It is not modified. It is traced as training runs it: a
            model wholly in eval mode (every module's ``training`` False, as ``from_pretrained``
            returns it) is traced in training mode (``model.train()``: dropout draws its masks;
            traced so, it would train without its configured dropout); a model with any module
            in training mode is traced in the modes its modules are in (a submodule left in eval
            mode on purpose, e.g. a frozen BatchNorm, stays so in the graph). Every module's
            flag is restored afterwards.
        example_batch: A dict (called as ``model(**batch)``), tuple/list (``model(*batch)``) or
            tensor, exactly as ``get_batch`` returns it. Shapes are specialised: the captured
            module must later be called with batches of the same structure and shapes.
        dynamic: Capture the batch and sequence dimensions as symbolic sizes within the ranges of
            :func:`autoprec.capture.dims.plan_dims` (``torch.export`` ``Dim``s; recorded in
            ``gm.meta[autoprec.capture.shapes.DIMS_META]``), so one graph serves every batch shape
            in range.
            A model that torch cannot export so (its code specialises a size) raises CaptureError.
        at_least: With ``dynamic``, sizes the ranges must reach beyond the example's, by role
            (``plan_dims``'s ``at_least``: the largest batch and length of several batches).

    Returns:
        A ``GraphModule`` with the model's call signature and output structure whose parameters
        are the model's own ``Parameter`` objects; SDPA calls whose mask is a causal mask computed
        from the input sizes pass ``is_causal=True`` instead (:mod:`autoprec.capture.causal`).
        ``node.meta["val"]`` holds a fake tensor
        (shape, dtype) per node and ``NodeMeta.key`` a stable node key. Outputs
        follow :func:`autoprec.modelspec.prepare_output`: ``ModelOutput`` dataclasses, tuples,
        dicts and ``None`` fields keep their type and fields, other values without tensors are
        returned unchanged. When ``forward`` has a ``use_cache`` parameter the batch does not set,
        the graph is the forward with ``use_cache=False`` (training needs no KV cache; logged once
        per process per model class on the ``autoprec`` logger); ``gm.meta[CALL_KWARGS_META]`` records it.

    Raises:
        CaptureError: a floating Parameter of ``model`` is not fp32 (the message names it and says
            how to convert); or ``torch.export`` failed; the message names the cause (a data-dependent
            branch, an op that cannot be traced, an output type that cannot be flattened, or
            torch's own message), the module class and the source line of the model code, and
            what to do; for a list batch, also how its items were bound to ``forward``'s
            parameters (:func:`autoprec.modelspec.positional_binding`).

    torch's own ``FutureWarning`` about ``isinstance(treespec, LeafSpec)`` is filtered during the
    export (:func:`autoprec.capture.export.quiet_pytree_deprecation`); warnings raised by the model's
    code still show.
    """
    plan = plan_dims(model, *split_batch(example_batch), at_least) if dynamic else None
    return capture_planned(model, example_batch, plan)


def capture_planned(model: nn.Module, example_batch: Any, plan: DimPlan | None) -> fx.GraphModule:
    """:func:`capture` with the dynamic dimensions already planned, the plan passed down as it is.

    Args:
        model: The model, fp32 weights. It is not modified.
        example_batch: As :func:`capture`'s; the batch ``plan`` was made for (its leaves, in order).
        plan: The dynamic dimensions (:func:`autoprec.capture.dims.plan_dims`, made once by the
            caller, e.g. :func:`autoprec.capture.batches.capture_for` from several batches); None
            or a plan without a dynamic dimension: a capture for the example's shapes.

    Returns:
        As :func:`capture`; with a dynamic ``plan``, ``gm.meta[DIMS_META]`` holds the ranges the
        export settled on (:func:`autoprec.capture.export.export_ranges`).

    Raises:
        CaptureError: as :func:`capture` (message: :func:`autoprec.capture.diagnose.explain_failure`).
    """
    _check_fp32_parameters(model)
    args, kwargs = split_batch(example_batch)
    fixed = training_kwargs(model, args, kwargs)
    _announce(model, fixed)
    modes = [(m, m.training) for m in model.modules()]
    try:
        if not any(training for _m, training in modes):  # wholly in eval mode: the training graph
            model.train()
        with (quiet_pytree_deprecation(), quiet_partial_graph(), _training_forward(model, fixed),
              checkpoint_calls() as checkpointed, autograd_function_calls() as functions):
            ep = export_program(model, args, kwargs, plan)
        if checkpointed:
            raise CaptureError(checkpointing_refused(model, checkpointed))
        with quiet_pytree_deprecation():
            gm = ep.module()
    except CaptureError:
        raise
    except Exception as e:  # torch raises many types here (UserError, GuardOnDataDependent...)
        raise CaptureError(explain_failure(e, model, example_batch, args, kwargs)) from e
    else:  # in the modes it was traced in: a lost custom backward is refused (C13's kind of silence)
        check_custom_backward(model, gm, example_batch, custom_functions(functions))
    finally:
        for m, training in modes:  # each module's own flag (model.train(flag) would set them all)
            m.training = training
    if plan is not None and plan.dynamic:
        gm.meta[DIMS_META] = export_ranges(gm, ep, plan)
    gm.meta[CALL_KWARGS_META] = dict(fixed)
    _strip_asserts(gm)
    causal_attention(gm)
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



def _strip_asserts(gm: fx.GraphModule) -> None:
    """Erase export's unused ``_assert_tensor_metadata`` checks (``_ASSERT_OPS``) from ``gm``, in place."""
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


def _check_fp32_parameters(model: nn.Module) -> None:
    """Raise CaptureError naming the first floating Parameter of ``model`` that is not fp32 (and
    how many more there are): its Parameters are the fp32 master weights the graph reads and the
    optimizer updates, and the policy alone decides what computes in bf16/fp16 (a ``model.half()``
    applied with an fp32 policy silently trained fp16 weights without a loss scaler, C07/C08)."""
    other = [(n, p.dtype) for n, p in model.named_parameters()
             if p.is_floating_point() and p.dtype != torch.float32]
    if other:
        name, dtype = other[0]
        more = f" (and {len(other) - 1} more not fp32)" if len(other) > 1 else ""
        raise CaptureError(
            f"{type(model).__name__}: parameter {name!r} is {dtype}{more}; autoprec captures an fp32 model: "
            "its Parameters are the fp32 master weights that training updates, and the policy decides what "
            "computes in bf16/fp16 (docs/architecture.md#runtime). Convert it first: model.float(), or "
            "from_pretrained(..., dtype=torch.float32) (transformers 5 loads a checkpoint in its saved dtype "
            "by default)")
