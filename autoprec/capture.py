"""Capture a model's forward as an ATen-level ``torch.fx.GraphModule`` (DESIGN §1, §3).

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

import warnings
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx, nn

from autoprec.errors import CaptureError

__all__ = ["assign_keys", "capture", "mark_regions", "module_path", "node_key", "op_name"]

# Export inserts these runtime checks after `.to()` calls; they assert the fp32 dtype seen at
# trace time and would fail once a pass lowers the producer, so capture removes them.
_ASSERT_OPS = {
    torch.ops.aten._assert_tensor_metadata.default,
}


def op_name(node: fx.Node) -> str:
    """The ATen op name of a ``call_function`` node without namespace or overload.

    ``aten.linear.default`` -> ``"linear"``; ``operator.getitem`` -> ``"getitem"``.
    """
    target = node.target
    name = getattr(target, "_opname", None) or getattr(target, "__name__", None) or str(target)
    return str(name)


def module_path(node: fx.Node) -> str:
    """Dotted path of the innermost ``nn.Module`` that produced ``node`` (``""`` for the root).

    Read from ``node.meta["nn_module_stack"]``, which torch.export records for every node.
    """
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, _type = list(stack.values())[-1]
    return str(path)


def node_key(module: str, op: str, k: int) -> str:
    """Format a stable node key: ``model.layers.3.mlp.down_proj/linear#0`` (DESIGN §3)."""
    return f"{module}/{op}#{k}" if module else f"{op}#{k}"


def assign_keys(gm: fx.GraphModule) -> dict[str, fx.Node]:
    """Give every ``call_function`` node of ``gm`` its stable key.

    Sets ``node.meta["autoprec"] = {"key": ..., "module": ..., "op": ...}`` (existing entries are
    kept) and returns ``{key: node}`` in graph order.
    """
    counters: dict[tuple[str, str], int] = defaultdict(int)
    keys: dict[str, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        mod, op = module_path(node), op_name(node)
        k = counters[(mod, op)]
        counters[(mod, op)] += 1
        key = node_key(mod, op, k)
        meta = node.meta.setdefault("autoprec", {})
        meta.update(key=key, module=mod, op=op)
        keys[key] = node
    return keys


def _split_batch(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    return (batch,), {}


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
    """
    args, kwargs = _split_batch(example_batch)
    was_training = model.training
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
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
    gm = ep.module()
    _strip_asserts(gm)
    _check_shared_parameters(model, gm)
    assign_keys(gm)
    mark_regions(gm)
    return gm


def mark_regions(gm: fx.GraphModule) -> list[fx.Node]:
    """Record the user's ``torch.autocast`` / ``torch.no_grad`` blocks (case C13).

    torch.export (non-strict, training IR) keeps each such block as a higher-order op,
    ``higher_order.wrap_with_autocast(device, dtype, enabled, cache_enabled, submod, *inputs)`` or
    ``higher_order.wrap_with_set_grad_enabled(enabled, submod, *inputs)``, whose body is a
    sub-``GraphModule``. autoprec keeps these nodes whole (fp32 inputs, fp32 body unless the
    user's own autocast says otherwise), never inlines and so never drops the context. Sets
    ``meta["autoprec"]["region"]`` (``{"kind": "autocast"|"grad", "enabled": bool, ...}``) and
    ``autocast_disabled`` on the node and on every node of its body.

    Returns:
        The region nodes, in graph order.
    """
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = op_name(node)
        if name == "wrap_with_autocast":
            device, dtype, enabled = node.args[0], node.args[1], bool(node.args[2])
            region = {"kind": "autocast", "device": str(device), "dtype": str(dtype), "enabled": enabled}
            body = node.args[4]
        elif name == "wrap_with_set_grad_enabled":
            region = {"kind": "grad", "enabled": bool(node.args[0])}
            body = node.args[1]
        else:
            continue
        meta = node.meta.setdefault("autoprec", {})
        meta.update(region=region, autocast_disabled=True)
        sub = getattr(gm, body.target, None) if isinstance(body, fx.Node) and body.op == "get_attr" else None
        if isinstance(sub, fx.GraphModule):
            for inner in sub.graph.nodes:
                inner.meta.setdefault("autoprec", {}).update(autocast_disabled=True, region=region)
        found.append(node)
    return found


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
