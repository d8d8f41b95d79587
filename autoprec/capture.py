"""Capture a model's forward as an ATen-level ``torch.fx.GraphModule`` (docs/architecture.md#data-flow, #node-keys-and-op-classes).

``torch.export.export(..., strict=False)`` traces the model's forward (the training IR: ops
such as ``aten.linear``, ``aten.scaled_dot_product_attention`` stay whole) and
``ExportedProgram.module()`` turns it back into a callable ``GraphModule`` whose
``get_attr`` nodes read the *same* ``Parameter`` objects as the model, so gradients land on
the user's parameters and the optimizer, checkpoints and ``state_dict`` keys are unchanged.

Each ``call_function`` node gets a stable key ``<module path>/<op>#<k>`` in
``node.meta["autoprec"]["key"]`` (k counts that op inside that module in graph order), which
policies use to name nodes; keys do not depend on FX's generated node names.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx, nn

from autoprec.errors import CaptureError
from autoprec.modelspec import split_batch
from autoprec.nodekeys import assign_keys, mark_regions

__all__ = ["capture", "quiet_pytree_deprecation"]

# Export inserts these runtime checks after `.to()` calls; they assert the fp32 dtype seen at
# trace time and would fail once a pass lowers the producer, so capture removes them.
_ASSERT_OPS = {
    torch.ops.aten._assert_tensor_metadata.default,
}


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
        sys.stderr.write(buf.getvalue().replace(f"{partial}\n", "") if partial is not None else buf.getvalue())
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


def capture(model: nn.Module, example_batch: Any) -> fx.GraphModule:
    """Capture ``model``'s forward on ``example_batch`` as an ATen ``GraphModule``.

    Args:
        model: The model, fp32 weights. It is not modified.
        example_batch: A dict (called as ``model(**batch)``), tuple/list (``model(*batch)``) or
            tensor, exactly as ``get_batch`` returns it. Shapes are specialised: the captured
            module must later be called with batches of the same structure and shapes.

    Returns:
        A ``GraphModule`` with the model's call signature and output structure whose parameters
        are the model's own ``Parameter`` objects. ``node.meta["val"]`` holds a fake tensor
        (shape, dtype) per node and ``node.meta["autoprec"]["key"]`` a stable node key.

    Raises:
        CaptureError: ``torch.export`` failed; the message names the module class, the source
            line of the model code that could not be traced, and what to do.

    torch's own ``FutureWarning`` about ``isinstance(treespec, LeafSpec)`` is filtered during the
    export (:func:`quiet_pytree_deprecation`); warnings raised by the model's code still show.
    """
    args, kwargs = split_batch(example_batch)
    was_training = model.training
    try:
        with quiet_pytree_deprecation(), _quiet_partial_graph():
            ep = torch.export.export(model, args, kwargs, strict=False)
    except Exception as e:  # torch raises many types here (UserError, GuardOnDataDependent...)
        raise CaptureError(
            f"torch.export could not capture {type(model).__name__}: {type(e).__name__} at "
            f"{_where(e, model)}.\n  {str(e).splitlines()[0] if str(e) else ''}\n"
            "  What to do: data-dependent Python control flow (an `if` on tensor values) cannot "
            "be captured; rewrite it with torch.where / torch.cond, or move it out of forward()."
        ) from e
    finally:
        model.train(was_training)
    with quiet_pytree_deprecation():
        gm = ep.module()
    _strip_asserts(gm)
    _check_shared_parameters(model, gm)
    assign_keys(gm)
    mark_regions(gm)
    return gm


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
