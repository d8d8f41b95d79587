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

import contextlib
import io
import logging
import sys
import warnings
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx, nn

from autoprec.errors import CaptureError
from autoprec.modelspec import split_batch

__all__ = ["InputShapes", "assign_keys", "capture", "mark_regions", "module_path", "node_key", "op_name",
           "quiet_pytree_deprecation"]

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


class InputShapes:
    """The input shapes a captured graph was specialised for, and a cheap check of a call against them.

    ``torch.export`` specialises every dimension of every input tensor: the captured module's guards
    fail with a bare ``AssertionError: Guard failed: ids.size()[0] == 8`` on any other shape. Checking
    the call first turns that into an error that names the input, both shapes and what to do.

    Inputs are matched to the graph's placeholders exactly as the exported ``forward`` does (positional
    arguments, then keyword arguments by name, nested lists/dicts flattened by the captured pytree spec).
    Shapes come from each placeholder's ``meta["val"]``; dimensions that are not plain ints (symbolic)
    match any size. Anything the check cannot map (wrong arity, unknown keyword, another structure) is
    left to the graph's own call, which raises its usual error.

    Args:
        gm: A graph from :func:`capture` (or one lowered from it by ``autoprec.passes``).
        what: How the message names the callee, e.g. ``"MixedPrecisionModule"``.

    Attributes:
        names: Display name per tensor input in placeholder order (``"ids"``, ``"extra[1]['z']"``).
        shapes: Captured shape per input (a tuple of ints, ``None`` for a symbolic dimension), or None
            for an input that is not a tensor or has no recorded shape.
    """

    def __init__(self, gm: fx.GraphModule, what: str = "the captured graph") -> None:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        info = getattr(gm.graph._codegen, "pytree_info", None)
        spec = getattr(info, "in_spec", None)
        self.what = what
        self.shapes: list[tuple[int | None, ...] | None] = [_shape_of(n) for n in placeholders]
        # argument names of forward(); the first `n_positional` are (args), the rest the kwargs of the spec
        self._args: list[str] = [str(a) for a in info.orig_args] if info is not None else \
            [str(n.target) for n in placeholders]
        self._spec = None
        self._n_positional = len(self._args)
        self.names = list(self._args)
        self.enabled = any(s is not None for s in self.shapes)
        if spec is not None and _is_args_kwargs_spec(spec):
            self._n_positional = spec.child(0).num_children
            self.names = _leaf_names(spec, self._args)
            # one leaf per argument in argument order: index the call directly, no pytree walk
            flat = all(spec.child(i).child(j).is_leaf() for i in (0, 1) for j in range(spec.child(i).num_children))
            self._spec = None if flat else spec
        elif spec is not None:
            self.enabled = False  # a layout this check does not know: let the graph check its inputs
        if len(self.names) != len(self.shapes) or (self._spec is None and len(self._args) != len(self.shapes)):
            self.enabled = False  # placeholders do not map onto the arguments: leave it to the graph
        self._index = {name: i for i, name in enumerate(self._args)}

    def check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raise if a tensor input's shape differs from the captured one.

        Args:
            args, kwargs: The call's arguments, as passed to the captured module.

        Raises:
            ValueError: an input tensor has another shape than at capture; the message lists the
                captured and the given shapes, names the input(s) that differ and says what to do.
        """
        if not self.enabled:
            return
        # fast path when every argument is one tensor leaf: index the call, no pytree walk
        leaves = self._leaves_flat(args, kwargs) if self._spec is None else self._leaves_nested(args, kwargs)
        if leaves is None:
            return
        for leaf, shape in zip(leaves, self.shapes):
            if isinstance(leaf, torch.Tensor) and leaf.shape != shape and not _fits(leaf.shape, shape):
                self._raise(leaves)

    def _leaves_flat(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        leaves: list[Any] = [None] * len(self.shapes)
        for i, a in enumerate(args[:len(leaves)]):
            leaves[i] = a
        for k, v in kwargs.items():
            i = self._index.get(k, -1)
            if 0 <= i < len(leaves):
                leaves[i] = v
        return leaves

    def _leaves_nested(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any] | None:
        """Flatten the call as the exported forward does; None where it would not bind."""
        from torch.fx._pytree import tree_flatten_spec

        if len(args) > len(self._args) or any(k not in self._index for k in kwargs):
            return None
        values = dict(zip(self._args, args))
        values.update(kwargs)
        if len(values) != len(self._args):
            return None
        k = self._n_positional
        tree = ([values[a] for a in self._args[:k]], {c: values[a] for c, a in
                                                      zip(self._spec.child(1).context, self._args[k:])})
        try:
            leaves = tree_flatten_spec(tree, self._spec)
        except Exception:  # noqa: BLE001 - another structure: the graph's own call reports it
            return None
        return leaves if len(leaves) == len(self.shapes) else None

    def _raise(self, leaves: list[Any]) -> None:
        captured, given, differ = [], [], []
        for name, shape, leaf in zip(self.names, self.shapes, leaves):
            if shape is None:
                continue
            want = _fmt(shape)
            captured.append(f"{name}: {want}")
            if isinstance(leaf, torch.Tensor):
                got = _fmt(tuple(leaf.shape))
                given.append(f"{name}: {got}")
                if leaf.shape != shape and not _fits(leaf.shape, shape):
                    differ.append(f"input {name!r} has shape {got}, captured {want}")
            else:
                given.append(f"{name}: {'None' if leaf is None else type(leaf).__name__}")
        raise ValueError(
            f"{self.what} was captured for input shapes {{{', '.join(captured)}}}, got shapes "
            f"{{{', '.join(given)}}}: {'; '.join(differ)}.\n  What to do: the capture is per shape "
            "(torch.export specialises every dimension, batch size included). Call autoprec.apply(model, "
            "policy, batch) (or autoprec.capture(model, batch)) with a batch of the new shape and use that "
            "module for such batches (modules applied to the same model share its Parameters), or give "
            "every batch the captured shape (e.g. DataLoader(drop_last=True), or pad the last batch)."
        )


def _shape_of(node: fx.Node) -> tuple[int | None, ...] | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    return tuple(d if isinstance(d, int) else None for d in val.shape)


def _fits(shape: torch.Size, want: tuple[int | None, ...] | None) -> bool:
    """Whether ``shape`` matches ``want`` where ``None`` dims match anything (the slow compare)."""
    if want is None:
        return True
    return len(shape) == len(want) and all(w is None or s == w for s, w in zip(shape, want))


def _fmt(shape: tuple[int | None, ...]) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _is_args_kwargs_spec(spec: Any) -> bool:
    return (spec.type is tuple and spec.num_children == 2 and spec.child(0).type is tuple
            and spec.child(1).type is dict)


def _leaf_names(spec: Any, arg_names: list[str]) -> list[str]:
    """Display names of the leaves of an ``(args, kwargs)`` spec: ``ids``, ``extra[1]['z']``."""
    from torch.utils import _pytree as pytree

    n = spec.num_leaves
    tree = pytree.tree_unflatten(list(range(n)), spec)
    names = [""] * n
    for path, i in pytree.tree_flatten_with_path(tree)[0]:
        top, rest = path[1], path[2:]
        if path[0].idx == 0:
            base = arg_names[top.idx] if top.idx < len(arg_names) else f"args[{top.idx}]"
        else:
            base = str(top.key)
        names[i] = base + pytree.keystr(rest)
    return names


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
