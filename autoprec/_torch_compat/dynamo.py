"""The entries of :mod:`autoprec._torch_compat` that reach Dynamo, Inductor's caches and the
``invoke_subgraph`` higher-order operator (docs/architecture.md#private-torch-apis); callers import
them from :mod:`autoprec._torch_compat`. Imports only torch, the heavy modules inside the entries.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

__all__ = ["compile_cache_counts", "dynamo_compile_seconds", "dynamo_unique_graphs", "is_dynamo_optimized",
           "reuse_invoke_subgraph_schemas"]


def is_dynamo_optimized(fn: Any) -> bool:
    """Whether ``fn`` itself is what ``torch.compile`` returned: an ``OptimizedModule``
    (``torch._dynamo.eval_frame``) for a module, or a function carrying Dynamo's
    ``_torchdynamo_orig_callable`` for a function. Wrappers around one are not unwrapped here.

    Imports Dynamo. Checked on 2.13.0; both in torch's source since 2.0. Missing ``OptimizedModule``:
    only the attribute is checked.
    """
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:
        OptimizedModule = ()  # isinstance(x, ()) is False
    return isinstance(fn, OptimizedModule) or hasattr(fn, "_torchdynamo_orig_callable")


def dynamo_unique_graphs() -> int:
    """Graphs ``torch.compile`` (Dynamo) has compiled in this process so far
    (``torch._dynamo.utils.counters["stats"]["unique_graphs"]``; process-wide).

    Imports Dynamo. Checked on 2.13.0; in torch's source since 2.0. Missing: 0 (no compile is seen).
    """
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"]["unique_graphs"])


def dynamo_compile_seconds() -> float:
    """Seconds this process has spent compiling with Dynamo/Inductor so far: forward frames and the
    backward graphs AOTAutograd compiles at the first ``backward()``
    (``torch._dynamo.utils.calculate_time_spent()["total_wall_time"]``, ``entire_frame_compile`` +
    ``entire_backward_compile``); ``torch._dynamo.reset()`` sets it back to 0.

    Does not import Dynamo: 0.0 before anything did (nothing was compiled). Checked on 2.13.0 only.
    Missing (or failing): 0.0.
    """
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0.0
    try:
        return float(utils.calculate_time_spent().get("total_wall_time", 0.0))
    except Exception:  # noqa: BLE001 - a private API; accounting must never fail a tune
        return 0.0


#: :func:`compile_cache_counts`'s keys -> (Dynamo counter group, counter) (torch/_dynamo/utils.py
#: ``counters``; torch/_inductor/codecache.py and torch/_functorch/_aot_autograd/autograd_cache.py
#: increment them).
_CACHE_COUNTERS = {
    "aot_autograd_hit": ("aot_autograd", "autograd_cache_hit"),
    "aot_autograd_miss": ("aot_autograd", "autograd_cache_miss"),
    "aot_autograd_bypass": ("aot_autograd", "autograd_cache_bypass"),
    "fx_graph_hit": ("inductor", "fxgraph_cache_hit"),
    "fx_graph_miss": ("inductor", "fxgraph_cache_miss"),
    "fx_graph_bypass": ("inductor", "fxgraph_cache_bypass"),
}


def compile_cache_counts() -> dict[str, int]:
    """Lookups of Inductor's on-disk caches in this process so far: the AOTAutograd cache (a whole
    forward+backward compile reused) and the FX graph cache (one Inductor graph's code reused),
    each as ``*_hit``, ``*_miss`` and ``*_bypass`` (a graph the cache cannot hold), from Dynamo's
    ``torch._dynamo.utils.counters``.

    Does not import Dynamo: all 0 before anything did. Checked on 2.13.0 only. Missing: all 0.
    """
    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None)
    if counters is None:
        return dict.fromkeys(_CACHE_COUNTERS, 0)
    return {key: int(counters[group][name]) for key, (group, name) in _CACHE_COUNTERS.items()}


def reuse_invoke_subgraph_schemas() -> bool:
    """Make ``invoke_subgraph``'s schema (whether a region's body mutates its inputs) computed once
    per region and compile instead of at every call; idempotent, process-wide.

    Under autograd, torch's ``HigherOrderOperator.py_autograd_impl`` asks
    ``invoke_subgraph.gen_schema(subgraph, identifier, *operands)`` at every call whether the body
    mutates an input, and ``gen_schema`` traces the body (``materialize_as_graph``) each time: two
    traces per block of a regionally compiled graph. The result depends on the body and the
    operands' types only, so inside a compile (a ``torch._guards.TracingContext``) it is kept in
    that compile's ``InvokeSubgraphCache`` under ``(id(subgraph), identifier, operand types)``: the
    key and store torch itself uses for the same schema when it functionalizes the call
    (``torch/_higher_order_ops/invoke_subgraph.py``; pytorch/pytorch#184646), so it lives and dies
    with the compile. Outside a compile nothing changes; the mutation check still runs at every
    call, on the cached schema.

    Checked on 2.13.0 (the cache store exists there). Missing (the operator, ``gen_schema``, the
    tracing context or the cache's schema store): returns False and changes nothing, so every call
    traces the body as before (slower, the same result).

    Returns:
        Whether the cache is installed.
    """
    try:  # torch._higher_order_ops re-exports the operator under the module's name
        module = importlib.import_module("torch._higher_order_ops.invoke_subgraph")
        guards = importlib.import_module("torch._guards")
    except ImportError:
        return False
    hop = getattr(module, "invoke_subgraph", None)
    tracing = getattr(guards, "TracingContext", None)
    if hop is None or tracing is None or not hasattr(hop, "gen_schema"):
        return False
    if getattr(hop.gen_schema, "_autoprec_cached", False):
        return True
    traced = hop.gen_schema

    def gen_schema(subgraph: Any, identifier: Any, *operands: Any) -> Any:
        sets = getattr(tracing.try_get(), "hop_dispatch_set_cache", None)
        cache = sets.get_cache(hop) if sets is not None else None
        if cache is None or not hasattr(cache, "get_functionalize_schema_entry"):
            return traced(subgraph, identifier, *operands)
        key = (id(subgraph), identifier, tuple(type(o) for o in operands))
        schema = cache.get_functionalize_schema_entry(key)
        if schema is None:
            schema = traced(subgraph, identifier, *operands)
            cache.add_functionalize_schema_entry(key, schema)
        return schema

    gen_schema._autoprec_cached = True  # type: ignore[attr-defined]
    hop.gen_schema = gen_schema
    return True
