"""The one door to torch's private APIs (docs/architecture.md#private-torch-apis).

The entries of Dynamo, Inductor's caches and the ``invoke_subgraph`` operator live in
:mod:`autoprec._torch_compat.dynamo` and are imported here: callers import every entry from this
package.

Every name autoprec uses from under ``torch._*``, or a ``_``-prefixed name of a public torch module
(``torch.utils._pytree``, ``torch.fx.graph._PyTreeCodeGen``, ``Graph._codegen``, ...), is reached
through one entry here, so a torch upgrade that moves or drops one breaks this file and its tests
(``tests/base/test_torch_compat.py``, one test per entry), not unknown places. Each entry says what it is
for, the torch versions it was checked on, and what happens where the API is missing: a fallback
with the same meaning, or an error naming the API and the torch version.

"Checked" means run by ``tests/base/test_torch_compat.py``; the versions named besides 2.13.0 come from
reading torch's source and were not run here. Heavy modules (Dynamo, AOTAutograd, fake tensors) are
imported inside the entries, when first used, as the callers did before. This module imports only
torch (layer 1 of docs/architecture.md#layers).

The public-by-convention config modules (``torch._dynamo.config``, ``torch._inductor.config``,
``torch._functorch.config``) are used directly; docs/architecture.md#private-torch-apis says why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

#: ``torch.utils._pytree``: the pytree functions torch.export and fx build their specs with
#: (``tree_leaves``, ``tree_flatten``, ``tree_unflatten``, ``tree_flatten_with_path``, ``keystr``,
#: ``register_pytree_node``, ``TreeSpec``). autoprec's specs must be the ones the exported graph
#: holds, so this is the module itself, not a copy. torch 2.13.0 has no public ``torch.utils.pytree``.
#: Checked on 2.13.0; the functions named exist in torch >= 2.2 (``keystr`` and the ``_with_path``
#: flatten came in 2.2). No fallback: capture is built on it, so its absence fails at import.
import torch.utils._pytree as pytree
from torch import fx, nn

#: ``torch.utils._python_dispatch.TorchDispatchMode``: the base class of a mode that sees every ATen
#: op (``__torch_dispatch__``); subclass it and enter it as a context manager. Used by
#: :mod:`autoprec.commands.bench_dist` to read the C heap after every op. Checked on 2.13.0; in torch's source
#: since 1.13. No fallback: its absence fails at import.
from torch.utils._python_dispatch import TorchDispatchMode

from autoprec._torch_compat.dynamo import (
    compile_cache_counts,
    dynamo_compile_seconds,
    dynamo_unique_graphs,
    is_dynamo_optimized,
    reuse_invoke_subgraph_schemas,
)

__all__ = [
    "TorchDispatchMode", "amp_unscale_", "autograd_function_calls", "checkpoint_calls", "child_module",
    "compile_cache_counts", "detect_fake_mode",
    "dynamo_compile_seconds", "dynamo_unique_graphs", "export_assert_ops", "fake_tensor_errors",
    "is_dynamo_optimized", "new_fake_mode", "optimization_hint", "overload_schema", "pytree",
    "pytree_info", "reuse_invoke_subgraph_schemas", "safe_softmax", "saved_tensor_hook_node",
    "set_pytree_codegen", "sparse_values", "top_saved_tensors_hooks", "tree_flatten_spec",
]

try:
    #: ``torch.fx.experimental.symbolic_shapes.optimization_hint``: a symbolic size's example value
    #: (its hint) without adding a guard, meant for cost estimates. Public from torch 2.13 (checked
    #: on 2.13.0); older torch: the fallback reads the size's recorded hint (``SymInt.node.hint``,
    #: a ``_``-free but internal attribute), the same value.
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:  # pragma: no cover - torch < 2.13
    def optimization_hint(a: torch.SymInt, fallback: int | None = None) -> int:  # noqa: D103
        hint = a.node.hint
        return fallback if hint is None else int(hint)


def _missing(api: str, what: str) -> RuntimeError:
    """The error an entry raises when this torch lacks ``api``."""
    return RuntimeError(f"{api} is missing in torch {torch.__version__} ({what}); autoprec was checked on "
                        "torch 2.13.0 (autoprec/_torch_compat/ lists each private torch API it uses)")


def tree_flatten_spec(tree: Any, spec: pytree.TreeSpec) -> list[Any]:
    """The leaves of ``tree`` in the order of ``spec`` (``torch.fx._pytree.tree_flatten_spec``): how an
    exported graph's generated ``forward`` flattens its call; dict children are matched by key.

    Used by :class:`autoprec.capture.InputShapes` to find which tensor feeds which placeholder. Checked
    on 2.13.0; in torch's source since 1.11. Missing: a :class:`RuntimeError` naming it.

    Raises:
        Whatever torch raises when ``tree`` does not have ``spec``'s structure.
    """
    try:
        from torch.fx._pytree import tree_flatten_spec as flatten
    except ImportError as e:
        raise _missing("torch.fx._pytree.tree_flatten_spec", "flattening a call as export does") from e
    return flatten(tree, spec)


def pytree_info(graph: fx.Graph) -> Any:
    """The pytree signature of ``graph``'s generated ``forward`` (``graph._codegen.pytree_info``, a
    ``torch.fx.graph._PyTreeInfo``: ``orig_args``, ``in_spec``, ``out_spec``), or None for a graph
    with plain codegen (a hand-built or symbolically traced one).

    Used to read an exported graph's argument names and input/output specs. Checked on 2.13.0; in
    torch's source since 1.13. Missing (no ``_codegen``): None, as for a plain graph.
    """
    return getattr(getattr(graph, "_codegen", None), "pytree_info", None)


def set_pytree_codegen(graph: fx.Graph, info: Any) -> None:
    """Give ``graph`` pytree codegen with signature ``info`` (``graph._codegen =
    torch.fx.graph._PyTreeCodeGen(info)``): its ``forward`` then takes ``info.orig_args``, flattens
    them with ``info.in_spec``, and unflattens its outputs with ``info.out_spec`` (None: flat).

    Used to build a copy of a captured graph that returns flat outputs
    (:func:`autoprec.applied.outputs.flat_output_graph`). Checked on 2.13.0; in torch's source since
    1.13. Missing: a :class:`RuntimeError` naming it.
    """
    codegen = getattr(fx.graph, "_PyTreeCodeGen", None)
    if codegen is None or not hasattr(graph, "_codegen"):
        raise _missing("torch.fx.graph._PyTreeCodeGen", "a graph's pytree signature")
    graph._codegen = codegen(info)


def detect_fake_mode(values: Any = None) -> Any:
    """The ``FakeTensorMode`` of ``values`` (any pytree) or the active one, else None
    (``torch._guards.detect_fake_mode``).

    Used to propagate an exported graph with symbolic sizes in the export's own mode, whose
    ``ShapeEnv`` holds the symbols. Checked on 2.13.0; in torch's source since 2.1. Missing: a
    :class:`RuntimeError` naming it.
    """
    try:
        from torch._guards import detect_fake_mode as detect
    except ImportError as e:
        raise _missing("torch._guards.detect_fake_mode", "finding an exported graph's fake mode") from e
    return detect(values)


def new_fake_mode(allow_non_fake_inputs: bool = True) -> Any:
    """A fresh ``torch._subclasses.fake_tensor.FakeTensorMode`` (shapes and dtypes only, no compute).

    ``allow_non_fake_inputs``: real tensors (e.g. a graph's Parameters) may enter its ops.
    Checked on 2.13.0; in torch's source since 2.0. Missing: a :class:`RuntimeError` naming it.
    """
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError as e:
        raise _missing("torch._subclasses.fake_tensor.FakeTensorMode", "fake-tensor propagation") from e
    return FakeTensorMode(allow_non_fake_inputs=allow_non_fake_inputs)


def lazy_graph_module(root: nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """``fx.GraphModule(root, graph)`` whose Python code is generated on first use, not at each
    ``recompile()`` (``torch.fx._lazy_graph_module._LazyGraphModule``, what Inductor uses for the
    same reason): a chain of passes then generates code once, for the graph that runs. Code is
    generated on the first call, ``.code``, pickling, or :func:`materialize`.

    Checked on 2.13.0; in torch's source since 2.3. Missing: a plain ``fx.GraphModule`` (eager
    code generation, the same graph).
    """
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:
        return fx.GraphModule(root, graph)
    return _LazyGraphModule(root, graph)


def materialize(gm: fx.GraphModule) -> fx.GraphModule:
    """Generate ``gm``'s pending Python code now (a no-op for a plain ``GraphModule``) and return
    it: what a pass chain hands on is an ordinary module to Dynamo, scripting and pickling alike.

    Checked on 2.13.0 (``_LazyGraphModule.force_recompile``); missing: a no-op.
    """
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:
        return gm
    _LazyGraphModule.force_recompile(gm)
    return gm


class _NeverRaised(Exception):
    """Stands for an exception class this torch lacks: nothing is an instance of it."""


def fake_tensor_errors() -> tuple[type[BaseException], type[BaseException]]:
    """``(DynamicOutputShapeException, UnsupportedOperatorException)`` of
    ``torch._subclasses.fake_tensor``: what tracing raises for an op whose output shape depends on
    tensor values, and for an op without a fake kernel (both have ``.func``, the op).

    Used by capture's diagnosis to name the cause of a failed export. Checked on 2.13.0; in torch's
    source since 2.0. Missing: a class nothing raises, so diagnosis falls back on the message text.
    """
    try:
        from torch._subclasses import fake_tensor
    except ImportError:
        return _NeverRaised, _NeverRaised
    return (getattr(fake_tensor, "DynamicOutputShapeException", _NeverRaised),
            getattr(fake_tensor, "UnsupportedOperatorException", _NeverRaised))


def overload_schema(target: Any) -> Any:
    """The ``torch.FunctionSchema`` of ``target`` when it is an op overload
    (``torch._ops.OpOverload``, e.g. ``torch.ops.aten.dropout.default``: ``target._schema``, with
    ``.name`` and ``.arguments``), else None (a Python function, a higher-order op, an overload packet).

    Used to read an fx node's op arguments by name. Checked on 2.13.0; in torch's source since 1.12.
    Missing ``torch._ops.OpOverload``: a :class:`RuntimeError` naming it.
    """
    ops = getattr(torch, "_ops", None)
    overload = getattr(ops, "OpOverload", None)
    if overload is None:
        raise _missing("torch._ops.OpOverload", "reading an op's schema")
    return target._schema if isinstance(target, overload) else None


def export_assert_ops() -> frozenset[Any]:
    """The runtime-check ops torch.export inserts after ``.to()`` calls (``aten._assert_tensor_metadata``):
    they assert the dtype seen at trace time, so capture removes them before a pass changes a dtype.

    Checked on 2.13.0 only. Missing: the ops this torch lacks are left out (an export that cannot
    insert an op needs none removed).
    """
    names = ("_assert_tensor_metadata",)
    return frozenset(getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n))


def safe_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Softmax of ``x`` over ``dim`` whose fully masked rows (all ``-inf``) are 0, not NaN
    (``aten._safe_softmax``: what torch's math SDPA uses since it was added in torch 2.5).

    Used by the math attention kernel, so its weights match torch's SDPA on masked rows.
    Checked on 2.13.0 only. Missing: ``softmax`` with those rows set to 0 (the same values).
    """
    op = getattr(torch.ops.aten, "_safe_softmax", None)
    return op(x, dim) if op is not None else _masked_rows_zero_softmax(x, dim)


def _masked_rows_zero_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """:func:`safe_softmax`'s fallback in public ops (torch's ``_safe_softmax`` decomposition)."""
    out = torch.softmax(x, dim)
    return torch.where(torch.isneginf(x).all(dim, keepdim=True), torch.zeros_like(out), out)


def amp_unscale_(grads: Sequence[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """GradScaler's fused unscale (``torch._amp_foreach_non_finite_check_and_unscale_``): sets
    ``found_inf`` (a float32 scalar tensor) to 1.0 if any of ``grads`` (one device and dtype) holds an
    inf/NaN, and multiplies each in place by ``inv_scale`` (float32 scalar), computed in float32.

    Checked on 2.13.0; in torch's source since 1.6. Missing: the same in plain ops (one per tensor).
    """
    fused = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)
    if fused is not None:
        fused(list(grads), found_inf, inv_scale)
        return
    for g in grads:
        if not bool(torch.isfinite(g).all()):
            found_inf.fill_(1.0)
        g.copy_(g.float() * inv_scale)


def sparse_values(t: torch.Tensor) -> torch.Tensor:
    """The values of a coalesced sparse COO tensor ``t`` as a view (``t._values()``), so an in-place
    op on it changes ``t`` (what GradScaler unscales for a sparse gradient).

    Checked on 2.13.0; in torch's source since 1.0. Missing: ``t.values()`` (also a view of a
    coalesced tensor).
    """
    values = getattr(t, "_values", None)
    return values() if values is not None else t.values()


def top_saved_tensors_hooks() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """The innermost ``torch.autograd.graph.saved_tensors_hooks`` pair now active, or None
    (``torch._C._autograd._top_saved_tensors_default_hooks(ignore_is_tracing=True)``).

    Used so the saved-activation hooks chain into an outer pair (e.g. a byte counter). Checked on
    2.13.0 only. Missing: None (no outer pair is seen; autoprec's own hooks still apply).
    """
    top = getattr(getattr(torch._C, "_autograd", None), "_top_saved_tensors_default_hooks", None)
    return None if top is None else top(True)


_warned_no_hook_context = False


def saved_tensor_hook_node() -> fx.Node | None:
    """The forward-graph node whose saved value AOTAutograd is inlining the saved-tensor hooks for
    (``torch._functorch._aot_autograd.graph_compile._get_saved_tensor_hook_context()["_node"]``);
    None outside that compilation step (eager calls of the hooks).

    Used by the saved-activation hooks to read a node's saved dtype in a compiled graph. Checked on
    2.13.0 only (torch's source says "this API may change without backward compatibility").
    Missing: None, with one warning that compiled graphs keep their saved activations as stored.
    """
    global _warned_no_hook_context
    try:
        from torch._functorch._aot_autograd.graph_compile import _get_saved_tensor_hook_context
    except ImportError:
        if not _warned_no_hook_context:
            import warnings

            _warned_no_hook_context = True
            warnings.warn(f"torch {torch.__version__} has no saved-tensor hook context (checked on 2.13.0): "
                          "compiled graphs keep their saved activations as stored",
                          RuntimeWarning, stacklevel=2)
        return None
    ctx = _get_saved_tensor_hook_context()
    return None if ctx is None else ctx.get("_node")


def child_module(model: nn.Module, name: str) -> nn.Module | None:
    """``model``'s direct submodule registered as ``name`` (``model._modules.get(name)``), else None.

    Unlike ``dict(model.named_children())`` it finds a module registered under two names by each
    name. Checked on 2.13.0; in torch's source since 1.0. Missing ``_modules``: ``get_submodule``.
    """
    modules = getattr(model, "_modules", None)
    if modules is not None:
        return modules.get(name)
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


@contextlib.contextmanager
def checkpoint_calls() -> Iterator[list[Any]]:
    """Within the block, every call of ``torch.utils.checkpoint.checkpoint`` (either
    implementation: ``use_reentrant=True``, ``CheckpointFunction.apply``; ``False``,
    ``_checkpoint_without_reentrant_generator``) appends the function it checkpoints to the list
    the block is given, then runs as it would.

    Used by :func:`autoprec.capture.trace.capture_planned` to see gradient checkpointing in a model's
    forward, which ``torch.export`` inlines without a trace (HF's ``gradient_checkpointing_enable``
    calls the same function through a ``functools.partial`` bound at import, so the public name
    cannot be wrapped; ``checkpoint`` looks both private names up when called). Checked on 2.13.0;
    in torch's source since 1.11 (the non-reentrant generator since 2.1). Missing either name: that
    implementation's calls are not seen.
    """
    import torch.utils.checkpoint as cp

    seen: list[Any] = []
    gen = getattr(cp, "_checkpoint_without_reentrant_generator", None)
    fn = getattr(cp, "CheckpointFunction", None)

    def generator(function: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(function)
        return gen(function, *args, **kwargs)

    class Reentrant:  # the one attribute checkpoint() reads of CheckpointFunction
        @staticmethod
        def apply(function: Any, *args: Any) -> Any:
            seen.append(function)
            return fn.apply(function, *args)

    if gen is not None:
        cp._checkpoint_without_reentrant_generator = generator
    if fn is not None:
        cp.CheckpointFunction = Reentrant
    try:
        yield seen
    finally:
        if gen is not None:
            cp._checkpoint_without_reentrant_generator = gen
        if fn is not None:
            cp.CheckpointFunction = fn


@contextlib.contextmanager
def autograd_function_calls() -> Iterator[list[type]]:
    """Within the block, every call of a ``torch.autograd.Function`` (``SomeFunction.apply(...)``,
    also through a name bound before the block, ``grad_reverse = GradReverse.apply``) appends
    ``SomeFunction`` to the list the block is given, then runs as it would.

    Used by :func:`autoprec.capture.trace.capture_planned`: ``torch.export`` traces a custom
    Function's ``forward`` into the graph and drops its ``backward`` without a word
    (:mod:`autoprec.capture.custom_backward`). ``Function.apply`` reaches the C implementation
    through ``super().apply``, looked up at each call on ``torch.autograd.function._SingleLevelFunction``
    (private; the class between ``Function`` and ``torch._C._FunctionBase`` since torch 2.0), where
    the block puts a recording ``apply``. Calls under functorch transforms (``custom_function_call``)
    are not seen. Checked on 2.13.0; without that class, nothing is seen.
    """
    import torch.autograd.function as af

    seen: list[type] = []
    level = getattr(af, "_SingleLevelFunction", None)
    if level is None:  # pragma: no cover - torch < 2.0
        yield seen
        return
    own = level.__dict__.get("apply")  # None: inherited from torch._C._FunctionBase
    base = own if own is not None else torch._C._FunctionBase.__dict__["apply"]

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        seen.append(cls)
        return base.__get__(None, cls)(*args, **kwargs)

    level.apply = classmethod(apply)
    try:
        yield seen
    finally:
        if own is not None:
            level.apply = own
        else:
            del level.apply
