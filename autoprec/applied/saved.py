"""Saved activations in low precision: a policy's ``saved`` field at run time (docs/architecture.md#runtime).

After the passes a node's ``NodeMeta.saved`` may be one of :data:`autoprec.dtypes.SAVED_DTYPES`
(None: saved as stored). The forward is unchanged, bit for bit; only the copy autograd keeps for
backward is rounded (``bf16``/``fp16``) or scaled and quantised (``fp8_e5m2``, one fp32 scale per
tensor), and backward reads it back in the stored dtype.

The mechanism is PyTorch's ``torch.autograd.graph.saved_tensors_hooks``, measured to work both ways
(``benchmarks/saved_activations.py``, ``benchmarks/results/saved_activations_*/``):

- **Compiled** (Inductor): the hooks are ``fx.GraphModule`` objects, which AOTAutograd inlines
  into the partitioned graphs (torch/_functorch/_aot_autograd/graph_compile.py
  ``maybe_inline_graph_saved_tensors_hooks``): the pack becomes the epilogue of the forward graph, the
  unpack the prologue of the backward graph, both fused by Inductor. The pack is traced once per
  tensor the partitioner saves, with that tensor's forward-graph node in reach
  (``_get_saved_tensor_hook_context()["_node"]``); Dynamo copies a node's ``meta["custom"]`` from the
  GraphModule it retraces (torch/_dynamo/output_graph.py ``_maybe_preserve_original_meta``) and
  AOTAutograd copies it onto the ATen nodes it decomposes into, so :func:`apply_saved` puts the
  ``saved`` dtype there. Granularity: per node of our graph; a saved tensor inside a node's
  decomposition (e.g. an intermediate of ``gelu``) counts as that node's output. Only intermediates
  are packed (``saved_tensors_hooks_filtering_mode="donated"``, the default): parameters and graph
  inputs are saved as they are.
- **Eager** (the GraphModule run without compile): the same hook objects run as Python per saved
  tensor; :func:`apply_saved` inserts a node after each marked node that records its output's
  storage, and the pack rounds a saved tensor exactly when it views a recorded storage.

Dynamo guards compiled code on the identity of inlinable hooks on top of the stack, so every call
of a compiled graph with ``saved`` marks must run inside :func:`saved_activation_context` (as
:class:`autoprec.applied.apply.MixedPrecisionModule` does); a graph without marks gets a null
context and is unaffected. An outer Python ``saved_tensors_hooks`` pair (e.g. the harness's saved
byte counter, :class:`autoprec.measure.memory.SavedBytes`) still sees every saved tensor, packed:
eager packs chain into it, and for a compiled call (where AOTAutograd disables hooks while its
forward runs) the context hands it what the compiled forward saved after the call
(:func:`report_saved`).

Why not the others (measured, same benchmark): casts inserted in the graph change what the forward
computes and the partitioner saves the fp32 upcast (``ban_recompute_materialized_backward``);
Inductor's ``activation_quantization_aten_pass`` selects by dtype and size only (whole graph), and in
torch 2.13 its backward divides by the scale only when ``use_scaling`` is set explicitly.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import threading
from typing import Any

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from autoprec._torch_compat import pytree, saved_tensor_hook_node, top_saved_tensors_hooks
from autoprec._version import __version__
from autoprec.dtypes import SAVED_DTYPES, to_torch
from autoprec.errors import PassError
from autoprec.kernels.fp8 import amax_scale
from autoprec.nodemeta import read_meta

__all__ = ["CUSTOM_KEY", "SavedCall", "apply_saved", "has_saved", "pack", "unpack", "report_saved",
           "saved_activation_context", "saved_eager"]

#: Key under ``node.meta["custom"]`` that carries a node's saved dtype into Dynamo/AOTAutograd graphs.
CUSTOM_KEY = "autoprec_saved"

_state = threading.local()  # .marked: {StorageWeakRef: (ref, name)} in eager forwards; .outer: outer hooks


def _saved_name(node: fx.Node) -> str | None:
    meta = read_meta(node)
    name = meta.saved
    if name is not None and name not in SAVED_DTYPES:
        raise PassError(f"node {node.name} ({node.target if meta.key is None else meta.key}): "
                        f"NodeMeta.saved = {name!r}; valid: {list(SAVED_DTYPES)}")
    return name


def has_saved(gm: fx.GraphModule) -> bool:
    """Whether any node of ``gm`` has a ``NodeMeta.saved`` dtype (see the module docstring)."""
    return any(_saved_name(n) is not None for n in gm.graph.nodes)


def _record(t: Any, name: str) -> Any:
    """Eager marker: remember ``t``'s storage as saved in ``name``; returns ``t`` unchanged (and does
    nothing when traced by Dynamo, should an eager-prepared graph be compiled). A leaf (a parameter
    or graph input) or a view of one (``t(weight)``, a follow node) is not marked: only
    intermediates are saved low, as in compiled graphs."""
    if torch.compiler.is_compiling():
        return t
    marked = getattr(_state, "marked", None)
    if marked is not None and isinstance(t, torch.Tensor) and not (
            t.is_leaf or (t._base is not None and t._base.is_leaf)):
        ref = StorageWeakRef(t.untyped_storage())
        marked[ref] = (ref, name)
    return t


def apply_saved(gm: fx.GraphModule, compiled: bool) -> fx.GraphModule:
    """Prepare ``gm`` for :func:`saved_activation_context`.

    Args:
        gm: A lowered graph whose nodes may carry a ``NodeMeta.saved``.
        compiled: True for a graph that will be ``torch.compile``d: each marked node gets
            ``meta["custom"][CUSTOM_KEY]`` (in place), which Dynamo and AOTAutograd carry to the
            ATen nodes the inlined pack hook sees. False for eager: a ``_record`` node is inserted
            after each marked node (in place, then recompiled).

    Returns:
        ``gm`` itself.

    Raises:
        PassError: a ``saved`` value is not in :data:`autoprec.dtypes.SAVED_DTYPES` (names the node).
    """
    for node in list(gm.graph.nodes):
        name = _saved_name(node) if node.op == "call_function" else None
        if name is None:
            continue
        if compiled:
            node.meta.setdefault("custom", {})[CUSTOM_KEY] = name
            continue
        with gm.graph.inserting_after(node):
            rec = gm.graph.call_function(_record, (node, name))
        node.replace_all_uses_with(rec, delete_user_cb=lambda u, rec=rec: u is not rec)
    if not compiled:
        gm.recompile()
    return gm


def pack(t: torch.Tensor, name: str | None) -> Any:
    """``t`` as saved in ``name``: the tensor rounded to bf16/fp16, or ``(q, scale)`` for fp8_e5m2.

    fp16 saturates finite values beyond ±65504 to ±65504 (fp16 has no scale: an activation of 66368,
    case C01, would otherwise be saved as inf and the gradients come back NaN); prefer bf16 or
    fp8_e5m2 (scaled) where activations are large.

    fp8: tensorwise scale ``s = max_e5m2 / max(amax, 1e-12)`` (:func:`autoprec.kernels.fp8.amax_scale`) and
    ``q = clamp(t·s, ±max_e5m2).to(float8_e5m2)`` (torchao.float8's ``amax_to_scale``/``to_fp8_saturated``
    recipe), so an all-zero tensor packs to zeros with a finite scale. ``amax`` is over the finite elements
    and ±inf are kept as ±inf (e5m2 has infinities): attention scores masked with ``-inf`` would
    otherwise give ``amax = inf``, ``s = 0`` and ``inf·0 = NaN`` (measured on Qwen2, compiled: the
    gradients came back non-finite). Elements of magnitude below ``amax·2^-31`` (e5m2's smallest
    subnormal over its max) flush to zero, so a tensor mixing ``finfo.min`` mask values with
    ordinary ones keeps little of the latter: mark such nodes ``bf16``, not fp8. A dtype not narrower than
    ``t``'s (``fp32``, or ``None``) leaves ``t`` as it is.

    Args:
        t: A floating tensor of any shape saved for backward.
        name: A :data:`autoprec.dtypes.SAVED_DTYPES` name, or None.

    Returns:
        ``t``, a low-precision tensor of ``t``'s shape, or ``(q, scale)`` with ``scale`` a 0-d fp32 tensor.
    """
    if name is None or not t.is_floating_point():
        return t
    low = to_torch(name)
    if low.itemsize >= t.element_size():
        return t
    if name == "fp16":  # saturate finite values past ±65504 (inf would poison the backward, C01)
        fmax16 = torch.finfo(low).max
        return torch.where(torch.isfinite(t), t.clamp(-fmax16, fmax16), t).to(low)
    if name != "fp8_e5m2":
        return t.to(low)
    fmax = torch.finfo(low).max
    x = t.detach().float()
    finite = torch.isfinite(x)
    scale = amax_scale(torch.where(finite, x, 0.0), low)  # the fp8 matmul's rule, over finite values
    q = torch.where(finite, (x * scale).clamp(-fmax, fmax), x)  # ±inf stay (e5m2 has them), NaN too
    return q.to(low), scale


def unpack(packed: Any, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`pack`: the saved value back in ``dtype`` (the dtype ``t`` had)."""
    if isinstance(packed, tuple):
        q, scale = packed
        return (q.to(torch.float32) / scale).to(dtype)
    return packed if packed.dtype == dtype else packed.to(dtype)


def _traced_node() -> fx.Node | None:
    """The forward-graph node AOTAutograd is inlining the hooks for (None outside compilation)."""
    return saved_tensor_hook_node()


def _pack_hook(t: torch.Tensor) -> Any:
    """The pack hook's body (see :func:`_hook`)."""
    node = _traced_node()
    if node is not None:  # compiled: traced once per saved node of the forward graph
        return pack(t, node.meta.get("custom", {}).get(CUSTOM_KEY))
    marked = getattr(_state, "marked", None)
    entry = marked.get(StorageWeakRef(t.untyped_storage())) if marked else None
    name = entry[1] if entry is not None and not entry[0].expired() else None  # not a freed one's address
    packed = pack(t, name)
    outer = getattr(_state, "outer", None)
    if outer is None:
        return t.dtype, packed
    chained = tuple(map(outer[0], packed)) if isinstance(packed, tuple) else outer[0](packed)
    return t.dtype, chained, outer[1]


def _unpack_hook(packed: Any) -> torch.Tensor:
    """The unpack hook's body (see :func:`_hook`)."""
    node = _traced_node()
    if node is not None:
        return unpack(packed, node.meta["val"].dtype)
    if len(packed) == 3:  # chained into an outer pair
        dtype, inner, outer_unpack = packed
        inner = tuple(map(outer_unpack, inner)) if isinstance(inner, tuple) else outer_unpack(inner)
        return unpack(inner, dtype)
    return unpack(packed[1], packed[0])


def _hook(body: Any, cache_hash: str) -> fx.GraphModule:
    """An ``fx.GraphModule`` (so AOTAutograd inlines it) whose graph is one call of ``body``.

    AOTAutograd's cache keys a compile on this graph, not on what ``body`` traces to
    (torch/_functorch/_aot_autograd/autograd_cache.py ``check_cacheable``), and bypasses a graph
    that calls a Python function unless the call is marked as PyTorch's ``torch.fx.wrap``'d calls
    are, ``meta["is_wrapped"]`` with a ``meta["user_cache_hash"]``, which then joins the key (the
    mechanism of PyTorch's own tests of saved-tensor hooks, test/dynamo/test_aot_autograd_cache.py).
    ``cache_hash`` (:func:`marks_hash`) is the hash of what the pack reads: the graph's marks and
    this module's pack code, so a compile with other marks never reuses a stale artifact while
    ``train`` after ``tune`` on the same policy reuses the tuned compile.
    """
    g = fx.Graph()
    call = g.call_function(body, (g.placeholder("t"),))
    call.meta.update(is_wrapped=True, user_cache_hash=cache_hash)
    g.output(call)
    return fx.GraphModule(torch.nn.Module(), g)


def _pack_code() -> str:
    """The source of what the hooks run (autoprec's version where the source is not installed), so a
    change to it changes every :func:`marks_hash`."""
    try:
        return "".join(inspect.getsource(f) for f in (pack, unpack, amax_scale, _pack_hook, _unpack_hook))
    except (OSError, TypeError):
        return f"autoprec {__version__}"


_PACK_CODE = _pack_code()


def marks_hash(gm: fx.GraphModule) -> str:
    """SHA-256 (hex) of ``gm``'s saved-activation marks (each marked node's name and ``saved``
    dtype, in graph order) and of the pack code: the ``user_cache_hash`` of its hooks (:func:`_hook`)."""
    h = hashlib.sha256(_PACK_CODE.encode())
    for n in gm.graph.nodes:
        name = _saved_name(n) if n.op == "call_function" else None
        if name is not None:
            h.update(f"{n.name}={name};".encode())
    return h.hexdigest()


@functools.cache
def _hooks(cache_hash: str) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The one pair of hook objects for ``cache_hash`` (Dynamo guards compiled code on their identity,
    so every call of one graph pushes the same pair)."""
    return _hook(_pack_hook, cache_hash), _hook(_unpack_hook, cache_hash)


def report_saved(outputs: Any) -> None:
    """Hand what a compiled forward saved to the outer Python pack hook, if any (as observer).

    AOTAutograd disables hooks while a forward with inlined hooks runs, so an outer pair (e.g. a
    byte counter) would not see the compiled graph's saved tensors; this calls the outer pack on each
    tensor the compiled backward nodes of ``outputs`` hold (packed already), discarding its result.

    Args:
        outputs: The compiled call's outputs (any pytree of tensors).
    """
    outer = getattr(_state, "outer", None)
    if outer is None:
        return
    seen: set[int] = set()
    for t in pytree.tree_leaves(outputs):
        fn = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
        if fn is None or id(fn) in seen or not type(fn).__name__.startswith("CompiledFunction"):
            continue
        seen.add(id(fn))
        for s in fn.saved_tensors:
            outer[0](s)


class _SavedHooks(contextlib.AbstractContextManager):
    """Pushes a graph's hook pair (:func:`_hooks`) and the per-forward state; reusable and re-entrant
    (a stack per thread)."""

    def __init__(self, hooks: tuple[fx.GraphModule, fx.GraphModule]) -> None:
        self._hooks = hooks

    def __enter__(self) -> None:
        top = top_saved_tensors_hooks()
        outer = top if top and not isinstance(top[0], fx.GraphModule) else None
        stack = _state.__dict__.setdefault("stack", [])
        hooks = torch.autograd.graph.saved_tensors_hooks(*self._hooks)
        stack.append((getattr(_state, "marked", None), getattr(_state, "outer", None), hooks))
        _state.marked, _state.outer = {}, outer
        hooks.__enter__()

    def __exit__(self, *exc: Any) -> None:
        _state.marked, _state.outer, hooks = _state.stack.pop()
        hooks.__exit__(*exc)


def saved_activation_context(gm: fx.GraphModule) -> contextlib.AbstractContextManager[None]:
    """The context every forward of ``gm`` (after :func:`apply_saved`) runs in.

    Args:
        gm: The graph (compiled or not) that will run inside the context.

    Returns:
        A null context when no node of ``gm`` has a ``saved`` dtype; else one that pushes the
        saved-tensor hooks. Reusable and re-entrant; backward may run outside it. Inside it, call
        :func:`report_saved` on a compiled call's outputs for an outer hook pair to see them.
    """
    return _SavedHooks(_hooks(marks_hash(gm))) if has_saved(gm) else contextlib.nullcontext()


class SavedCall:
    """``fn`` called eagerly inside :func:`saved_activation_context` (:func:`saved_eager`; a compiled
    graph's calls are :class:`autoprec.applied.compile.CompiledGraph`'s).

    Attributes:
        fn: The wrapped callable (a GraphModule prepared by ``apply_saved(gm, compiled=False)``).
    """

    def __init__(self, fn: Any, context: contextlib.AbstractContextManager[None]) -> None:
        self.fn, self._context = fn, context

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._context:
            return self.fn(*args, **kwargs)


def saved_eager(gm: fx.GraphModule) -> Any:
    """``gm`` ready to run eagerly with its nodes' ``saved`` dtypes honoured.

    Args:
        gm: A lowered graph (modified in place by :func:`apply_saved` when it has marks).

    Returns:
        ``gm`` itself when no node has a ``saved`` dtype, else a :class:`SavedCall` of it.
    """
    if not has_saved(gm):
        return gm
    return SavedCall(apply_saved(gm, compiled=False), saved_activation_context(gm))
