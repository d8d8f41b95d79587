"""``compile_graph``: a lowered graph compiled with Inductor, its repeated blocks once
(docs/architecture.md#regional-compilation)."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from torch import fx, nn

from autoprec._torch_compat import compile_cache_counts
from autoprec.applied.regions import outline_blocks
from autoprec.applied.saved import SavedCall, apply_saved, has_saved, saved_activation_context
from autoprec.applied.shape_cache import CompileLog

__all__ = ["compile_graph", "cache_report", "INDUCTOR_OPTIONS", "REGION_OPTIONS"]

_log = logging.getLogger("autoprec")

#: Inductor options used for every compile. ``emulate_precision_casts`` makes fused kernels
#: round at each explicit low-precision cast as eager does, instead of keeping fp32
#: intermediates (torch/_inductor/config.py), so the compiled graph honours the policy and the
#: drift the search measures is the drift training sees.
INDUCTOR_OPTIONS: dict[str, Any] = {"emulate_precision_casts": True}

#: Added to :data:`INDUCTOR_OPTIONS` for a graph with shared regions. torch 2.13's Inductor reuses
#: buffers wrongly across the calls of one ``invoke_subgraph`` region on CPU, both by buffer reuse
#: and by in-place buffers: a region with an activation-by-activation matmul (attention) got
#: gradients 50-80% off (relative L2), a LayerNorm-Linear-GELU-Linear block (tests/models/wide_mlp.py)
#: 12% off, while ``aot_eager`` and the flat graph are exact. With both off they are exact
#: (tests/applied/test_regions.py, tests/search/test_memory.py check the gradients).
REGION_OPTIONS: dict[str, Any] = {"allow_buffer_reuse": False, "inplace_buffers": False}


def compile_graph(gm: nn.Module, activation_memory_budget: float = 1.0, dynamic: bool | None = None,
                  regional: bool = True) -> Any:
    """``torch.compile`` a lowered graph (or a module) with Inductor and :data:`INDUCTOR_OPTIONS`.

    Compilation is lazy: the first call (typically 10–90 s on a 2-core CPU for a small
    transformer) pays for it. A graph captured with dynamic dimensions (symbolic placeholder
    sizes, ``capture(..., dynamic=True)``) compiles with ``dynamic=True``: Dynamo re-traces it
    with symbolic sizes, so Inductor's kernels take the sizes as arguments and one compile serves
    every shape, plus one for size-1 batches (Dynamo specialises sizes 0 and 1); its compiles are
    counted and logged (:class:`autoprec.applied.shape_cache.CompileLog`). Any other graph
    compiles with ``dynamic=False`` (one specialised compile).

    Args:
        gm: The graph (or module) to compile.
        activation_memory_budget: Below 1.0, every call runs under
            ``torch._functorch.config.patch(activation_memory_budget=...)``, so AOTAutograd's
            partitioner, which splits forward and backward when the graph is first compiled, keeps
            only that fraction of its default saved activations and recomputes the rest in backward
            (a 0-1 knapsack on estimated FLOPs; torch/_functorch/config.py).
        dynamic: ``torch.compile``'s ``dynamic``; None (default): True for a graph with symbolic
            placeholder sizes, else False. ``autoprec bench`` passes True for the
            ``torch.autocast`` + ``torch.compile`` baseline (a module, not a graph) when the model
            file's batches vary in shape, so it compiles once, not once per shape.
        regional: For a graph, compile its repeated blocks (transformer layers of one structure)
            once, as one ``torch.compiler.nested_compile_region`` each
            (:func:`autoprec.applied.regions.outline_blocks`; logged at INFO); False: one flat
            graph. A module (not a graph) is always compiled as it is, and so is a graph with
            saved-activation dtypes: the pack hook does not see a region's nodes' marks (a
            4-layer Qwen2 with fp8_e5m2-saved matmuls saved 770 kB regional against 528 kB flat),
            and a graph compiled under an activation memory budget below 1.0 (gradients there are
            exact with :data:`REGION_OPTIONS`, but whether the partitioner's budget saves the
            same bytes inside a region is not measured; the memory fit of ``tune --max-memory``
            relies on it).

    A graph whose nodes carry a ``NodeMeta.saved`` (a policy's ``saved`` field) is compiled
    with those activations saved low and every call runs inside
    :func:`autoprec.applied.saved.saved_activation_context` (a :class:`autoprec.applied.saved.SavedCall`).

    Inductor's CPU code generator warns ``bf16 and fp16 are mixed in the scheduler node`` for every
    kernel that fuses both (a policy with both dtypes: many times per tune); that one message is
    filtered (:func:`_quiet_mixed_dtype_warning`), other warnings still show.

    Returns:
        A callable with ``gm``'s signature.
    """
    _quiet_mixed_dtype_warning()
    if dynamic is None:
        dynamic = isinstance(gm, fx.GraphModule) and _symbolic_inputs(gm)
    # nodes' ``saved`` dtypes: autoprec.applied.saved
    saved = isinstance(gm, fx.GraphModule) and has_saved(gm)
    target = apply_saved(gm, compiled=True) if saved else gm
    options = dict(INDUCTOR_OPTIONS)
    if regional and isinstance(gm, fx.GraphModule) and saved:
        _log.info("compile: one flat graph (the policy's saved-activation dtypes do not reach the pack "
                  "hook inside a compiled region: measured 1.46x the saved bytes)")
    elif regional and isinstance(gm, fx.GraphModule) and activation_memory_budget < 1.0:
        _log.info("compile: one flat graph (AOTAutograd's activation memory budget is not measured "
                  "inside compiled regions: the memory fit relies on the flat graph's peaks)")
    elif regional and isinstance(gm, fx.GraphModule):
        try:
            target, plan = outline_blocks(target)
        except Exception as e:  # noqa: BLE001 - regions only save compile time: never fail a compile
            _log.warning("compile: one flat graph (outlining the repeated blocks failed: %s: %s)",
                         type(e).__name__, e)
        else:
            _log.info("compile: %s", plan.describe())
            if plan.blocks:
                options.update(REGION_OPTIONS)
    fn = torch.compile(target, backend="inductor", options=options, dynamic=dynamic)
    fn = fn if activation_memory_budget >= 1.0 else _WithMemoryBudget(fn, activation_memory_budget)
    fn = SavedCall(fn, saved_activation_context(gm), compiled=True) if saved else fn
    if not dynamic:
        return fn
    return CompileLog(fn, "the dynamic-shape graph" if isinstance(gm, fx.GraphModule) else type(gm).__name__)


#: The message of Inductor's warning (torch/_inductor/codegen/cpp.py) that compile_graph filters.
_MIXED_DTYPE_WARNING = r"bf16 and fp16 are mixed in the scheduler node"


def _quiet_mixed_dtype_warning() -> None:
    """Add an ``ignore`` filter for :data:`_MIXED_DTYPE_WARNING` unless one is in place. The
    warning comes when a compiled graph first runs, after compile_graph returns, so the filter is
    process-wide, not a ``catch_warnings`` block; it is checked on every call because a caller's
    ``catch_warnings`` (the CLI's) may have restored the filters since."""
    if not any(action == "ignore" and regex is not None and regex.pattern == _MIXED_DTYPE_WARNING
               for action, regex, *_ in warnings.filters):
        warnings.filterwarnings("ignore", message=_MIXED_DTYPE_WARNING, category=UserWarning)


def _symbolic_inputs(gm: fx.GraphModule) -> bool:
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    return any(isinstance(v, torch.Tensor) and not all(isinstance(d, int) for d in v.shape) for v in vals)


class _WithMemoryBudget:
    """Calls a compiled function with the partitioner's activation memory budget set."""

    def __init__(self, fn: Any, budget: float) -> None:
        self.fn, self.budget = fn, float(budget)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch._functorch.config.patch(activation_memory_budget=self.budget):
            return self.fn(*args, **kwargs)


def cache_report(before: dict[str, int]) -> str:
    """What Inductor's on-disk caches served since ``before`` (a
    :func:`autoprec._torch_compat.compile_cache_counts` snapshot), e.g. ``Inductor caches:
    AOTAutograd 1 hit, 0 misses; FX graph 2 hits, 0 misses``, or ``Inductor caches: not used``.

    A hit means a compile was reused, not redone: ``autoprec train`` after ``tune`` on the same
    model and policy hits the AOTAutograd cache (same lowered graph, same options), so its first
    step costs the Dynamo trace only. The caches live in ``TORCHINDUCTOR_CACHE_DIR`` (default a
    ``torchinductor_<user>`` folder in the system's temporary directory; PyTorch docs,
    "Compile Time Caching in torch.compile").
    """
    now = compile_cache_counts()
    delta = {k: now[k] - before.get(k, 0) for k in now}
    parts = []
    for name, key in (("AOTAutograd", "aot_autograd"), ("FX graph", "fx_graph")):
        hit, miss, bypass = (delta[f"{key}_{kind}"] for kind in ("hit", "miss", "bypass"))
        if hit or miss or bypass:
            parts.append(f"{name} {hit} hit{'s' if hit != 1 else ''}, {miss} miss{'es' if miss != 1 else ''}"
                         + (f", {bypass} bypassed" if bypass else ""))
    return "Inductor caches: " + ("; ".join(parts) if parts else "not used")
