"""``compile_graph``: a lowered graph compiled with Inductor, its repeated blocks once
(docs/architecture.md#regional-compilation)."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from autoprec._torch_compat import compile_cache_counts
from autoprec.applied.outputs import flat_output_graph, rebuild
from autoprec.applied.regions import RegionPlan, outline_blocks
from autoprec.applied.saved import apply_saved, has_saved, report_saved, saved_activation_context
from autoprec.applied.shape_cache import CompileLog
from autoprec.errors import PolicyError
from autoprec.nodemeta import read_meta
from autoprec.policy.compile_options import flat_reason
from autoprec.randomness import random_nodes

__all__ = ["CompiledGraph", "compile_graph", "cache_report", "check_recompute", "INDUCTOR_OPTIONS",
           "RANDOM_OPTIONS", "RECOMPUTE_REDRAWS", "REGION_OPTIONS"]

_log = logging.getLogger("autoprec")

#: Inductor options for every graph compile (a module, the torch.autocast + torch.compile
#: baseline, gets Inductor's defaults, as users compile it). ``emulate_precision_casts`` makes fused kernels
#: round at each explicit low-precision cast as eager does, instead of keeping fp32
#: intermediates (torch/_inductor/config.py), so the compiled graph honours the policy and the
#: drift the search measures is the drift training sees.
INDUCTOR_OPTIONS: dict[str, Any] = {"emulate_precision_casts": True}

#: Added to :data:`INDUCTOR_OPTIONS` for a graph with shared regions. torch 2.13's Inductor reuses
#: buffers wrongly across the calls of one ``invoke_subgraph`` region on CPU, both by buffer reuse
#: and by in-place buffers: a region with an activation-by-activation matmul (attention) got
#: gradients 50-80% off (relative L2), a LayerNorm-Linear-GELU-Linear block (tests/models/wide_mlp.py)
#: 12% off, while ``aot_eager`` and the flat graph are exact. With both off they are exact
#: (tests/applied/test_regions.py, tests/search/test_memory.py check the gradients). Neither alone
#: is (only ``allow_buffer_reuse`` off: WideMLP 12% off; only ``inplace_buffers`` off: the Qwen2's
#: gradients 1300x their norm off), nor ``torch._functorch.config.donated_buffer=False``, the
#: narrower fix of another region bug (pytorch/pytorch PR #193960): this is the narrowest known
#: setting. tests/applied/test_region_workaround.py fails once the installed torch no longer needs it.
REGION_OPTIONS: dict[str, Any] = {"allow_buffer_reuse": False, "inplace_buffers": False}

#: Added to :data:`INDUCTOR_OPTIONS` for a graph that draws random numbers (dropout:
#: :func:`autoprec.randomness.draws_random`). Its random ops run eager's kernels from the global generator
#: instead of Inductor's own (Philox) stream, which draws other masks than eager from the same seed
#: and, for a bf16 graph, other masks than for the FP32 one (``Harness``). ``tune`` measures every
#: compiled graph of such a model this way, so a policy compiled by ``train``, ``apply`` or ``bench``
#: runs what was measured (its masks and its speed) and is the same graph, which Inductor's caches
#: serve. Measured: a 4-layer GPT-2 (dropout 0.1, hidden 256, 4x128 tokens) compiled step 0.119 s
#: with eager's random ops against 0.130 s with Inductor's (AVX2 EPYC, 2 cores; median of 26 steps,
#: interleaved); ``train`` after ``tune`` first step 11.3 s (recompiled) before, see
#: docs/architecture.md#regional-compilation, Caches.
RANDOM_OPTIONS: dict[str, Any] = {"fallback_random": True}


#: Why a graph that draws random numbers is never compiled under an activation memory budget below
#: 1.0: the partitioner's knapsack may put a random op into the backward graph, which then draws
#: fresh randomness (at budget 0 every op is recomputed). Open in PyTorch as of torch 2.13.0, on CPU
#: and CUDA alike; ``tests/applied/test_recompute_random.py`` shows it on the installed torch (and
#: fails once torch saves the forward's random values, so this rule can go).
RECOMPUTE_REDRAWS = ("torch's activation memory budget recomputes random ops (dropout) in backward with "
                     "fresh randomness, so backward would use other masks than forward and the gradients "
                     "would be silently wrong (pytorch/pytorch#190758)")


def check_recompute(gm: nn.Module, activation_memory_budget: float, source: Any = None) -> None:
    """Refuse an activation memory budget below 1.0 on a graph that draws random numbers
    (:func:`autoprec.randomness.random_nodes`; :data:`RECOMPUTE_REDRAWS` says why).

    Args:
        gm: The graph to be compiled (a module, not a graph, is not checked).
        activation_memory_budget: The policy's budget, a fraction in [0, 1].
        source: The policy file, named first in the message (None: not named).

    Raises:
        PolicyError: names the policy file (``source``), its ``activation_memory_budget``, the first
            random node (its name, op and node key) and how many more there are.
    """
    if activation_memory_budget >= 1.0 or not isinstance(gm, fx.GraphModule):
        return
    nodes = random_nodes(gm)
    if not nodes:
        return
    first, key = nodes[0], read_meta(nodes[0]).key
    where = f"node {first.name} ({first.target}{f', {key}' if key else ''})" + (
        f" and {len(nodes) - 1} more" if len(nodes) > 1 else "")
    raise PolicyError(f"{f'{source}: ' if source is not None else ''}"
                      f"activation_memory_budget {activation_memory_budget:g}: the model's graph draws "
                      f"random numbers ({where}) and {RECOMPUTE_REDRAWS}; use the policy with "
                      "activation_memory_budget 1.0 (saved-activation dtypes keep the masks), or train with "
                      "dropout off (p=0)")


def compile_graph(gm: nn.Module, activation_memory_budget: float = 1.0, dynamic: bool | None = None,
                  regional: bool = True, emulate_precision_casts: bool = True) -> CompiledGraph:
    """``torch.compile`` a lowered graph with Inductor and :data:`INDUCTOR_OPTIONS`, or a module
    (the ``torch.autocast`` + ``torch.compile`` baseline) with Inductor's defaults, as a user's
    ``torch.compile(model)`` compiles it: the bar is what users get without autoprec.

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
            graph. A module (not a graph) is always compiled as it is, and so are two kinds of
            graphs (measured, docs/architecture.md#regional-compilation). One with saved-activation
            dtypes: the pack hook sees a region's activations only as outputs of its
            ``invoke_subgraph`` call, without their marks (1.46x the saved bytes); read through the
            region's partitioned forward graph, a 4-layer GPT-2 came out non-finite on some cold
            compiles (saved bf16: 1 of 5, fp8_e5m2: 2 of 5; flat: 0 of 3 each) and drifted 6x
            the flat graph's. One under an activation memory budget below 1.0: its gradients are
            exact with :data:`REGION_OPTIONS`, but the budget does not mean the same inside
            regions (a 4-layer Qwen2 of hidden 512 at 0.5: peak 182 MiB regional, full
            recomputation's 181, against 248 MiB flat), and the memory fit of ``tune
            --max-memory`` aims on measured peaks.
        emulate_precision_casts: For a graph, Inductor's option (on: casts round as eager's, the
            default; off: fp32 intermediates in fused kernels; ``Policy.compile_options``).

    A graph that draws random numbers (dropout) compiles with :data:`RANDOM_OPTIONS` too: eager's
    random ops, as ``tune`` measured it.

    A graph whose nodes carry a ``NodeMeta.saved`` (a policy's ``saved`` field) is compiled
    with those activations saved low and every call runs inside
    :func:`autoprec.applied.saved.saved_activation_context`.

    Inductor's CPU code generator warns ``bf16 and fp16 are mixed in the scheduler node`` for every
    kernel that fuses both (a policy with both dtypes: many times per tune); that one message is
    filtered (:func:`_quiet_mixed_dtype_warning`), other warnings still show.

    Returns:
        A :class:`CompiledGraph`: callable with ``gm``'s signature, and what was compiled how.

    Raises:
        PolicyError: ``activation_memory_budget`` below 1.0 on a graph that draws random numbers
            (:func:`check_recompute`).
    """
    check_recompute(gm, activation_memory_budget)
    _quiet_mixed_dtype_warning()
    graph = isinstance(gm, fx.GraphModule)
    # the flat outputs are compiled, the model's output structure rebuilt outside: one graph whether
    # the caller gave the lowered graph (tune, bench) or its flat copy (apply, train), so caches hit
    flat, out_spec = flat_output_graph(gm) if graph else (gm, None)
    if dynamic is None:
        dynamic = graph and _symbolic_inputs(flat)
    # nodes' ``saved`` dtypes: autoprec.applied.saved
    saved = graph and has_saved(flat)
    target = apply_saved(flat, compiled=True) if saved else flat
    target, plan, layout = _layout(target, regional and graph, saved, activation_memory_budget)
    options = _inductor_options(flat, plan, emulate_precision_casts) if graph else {}  # a module: defaults
    compiled = torch.compile(target, backend="inductor", options=options, dynamic=dynamic)
    return CompiledGraph(gm, target, compiled, plan, layout, bool(dynamic), activation_memory_budget,
                         saved_activation_context(flat) if saved else None,
                         ("the dynamic-shape graph" if dynamic else "the static graph") if graph
                         else type(gm).__name__, out_spec)


def _inductor_options(flat: fx.GraphModule, plan: RegionPlan | None, emulate: bool) -> dict[str, Any]:
    """A lowered graph's Inductor options: :data:`INDUCTOR_OPTIONS` (``emulate_precision_casts`` as
    ``emulate`` says), :data:`REGION_OPTIONS` when ``plan`` outlined blocks, :data:`RANDOM_OPTIONS`
    when it draws random numbers. (A module, torch.autocast + torch.compile, gets Inductor's
    defaults, as users compile it.)"""
    return {**INDUCTOR_OPTIONS, "emulate_precision_casts": bool(emulate),
            **(REGION_OPTIONS if plan is not None and plan.blocks else {}),
            **(RANDOM_OPTIONS if random_nodes(flat) else {})}


def _layout(gm: nn.Module, regional: bool, saved: bool,
            budget: float) -> tuple[nn.Module, RegionPlan | None, str]:
    """What ``torch.compile`` compiles: ``(target, plan, layout)``, ``target`` the graph with its
    repeated blocks outlined (:func:`autoprec.applied.regions.outline_blocks`) when ``regional``
    and neither saved-activation dtypes nor a memory budget below 1.0 keep it flat, else ``gm``;
    ``plan`` the outlining's plan (None when not outlined); ``layout`` the line logged at INFO
    (WARNING when outlining failed) after ``compile:``."""
    if not regional:
        return gm, None, "one flat graph (regional=False)" if isinstance(gm, fx.GraphModule) else "one module"
    why = flat_reason(saved, budget)
    if why is not None:
        layout = f"one flat graph ({why})"
    else:
        try:
            target, plan = outline_blocks(gm)
        except Exception as e:  # noqa: BLE001 - regions only save compile time: never fail a compile
            layout = f"one flat graph (outlining the repeated blocks failed: {type(e).__name__}: {e})"
            _log.warning("compile: %s", layout)
            return gm, None, layout
        _log.info("compile: %s", plan.describe())
        return target, plan, plan.describe()
    _log.info("compile: %s", layout)
    return gm, None, layout


class CompiledGraph:
    """What :func:`compile_graph` returns: a graph (or module) compiled with Inductor, callable
    with the graph's signature and returning its outputs.

    A call runs the compiled function under the partitioner's activation memory budget (when
    below 1.0: ``torch._functorch.config.patch(activation_memory_budget=...)``), inside
    :func:`autoprec.applied.saved.saved_activation_context` for a graph with saved-activation dtypes
    (and reports the saved tensors, :func:`autoprec.applied.saved.report_saved`), and through
    :attr:`compile_log`, which counts and logs each compile.

    Attributes:
        source: What :func:`compile_graph` was given: the lowered graph, or a module.
        target: What ``torch.compile`` compiled: ``source`` returning its flat outputs
            (:func:`autoprec.applied.outputs.flat_output_graph`; a call rebuilds the model's output
            structure), or a copy of it whose repeated blocks call shared regions (:attr:`regions`).
        compiled: The ``torch.compile`` result (an ``OptimizedModule``).
        regions: The outlining's plan (:class:`autoprec.applied.regions.RegionPlan`), None when the
            graph was compiled flat (:attr:`layout` says why).
        layout: One line: how it was compiled (the ``compile:`` log line), e.g. ``3 of 4 blocks of
            model.layers in 1 region``.
        dynamic: ``torch.compile``'s ``dynamic``.
        activation_memory_budget: The partitioner's budget, a fraction in (0, 1] (1.0: no budget).
        saved: Whether the graph has saved-activation dtypes (``NodeMeta.saved``).
        compile_log: Its :class:`autoprec.applied.shape_cache.CompileLog` (mode ``"dynamic"`` or
            ``"static"``).
    """

    def __init__(self, source: nn.Module, target: nn.Module, compiled: Callable[..., Any],
                 regions: RegionPlan | None, layout: str, dynamic: bool, activation_memory_budget: float,
                 saved_context: contextlib.AbstractContextManager[None] | None, what: str,
                 out_spec: Any = None) -> None:
        self.source, self.target, self.compiled, self._out_spec = source, target, compiled, out_spec
        self.regions, self.layout, self.dynamic = regions, layout, dynamic
        self.activation_memory_budget = float(activation_memory_budget)
        self.saved, self._saved_context = saved_context is not None, saved_context
        self.compile_log = CompileLog(self._run, what, "dynamic" if dynamic else "static")

    @property
    def _orig_mod(self) -> nn.Module:
        """``torch.compile``'s name for the module compiled (``OptimizedModule._orig_mod``):
        :attr:`target`, whose ``forward`` :func:`autoprec.modelspec.call_model` inspects for the
        keyword arguments a training capture fixes."""
        return self.target

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the compiled graph on ``args``/``kwargs`` (compiling it on the first call)."""
        return self.compile_log(*args, **kwargs)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        budget = (torch._functorch.config.patch(activation_memory_budget=self.activation_memory_budget)
                  if self.activation_memory_budget < 1.0 else contextlib.nullcontext())
        with self._saved_context or contextlib.nullcontext():
            with budget, _UnloadableCacheEntries():
                out = self.compiled(*args, **kwargs)
            if self.saved:
                report_saved(out)
        return rebuild(out, self._out_spec)


class _UnloadableCacheEntries(logging.Filter):
    """Within the block, Inductor's warning that its FX graph cache could not load an entry (the
    message and a 30-line traceback, on every warm run of a dynamic-shape graph with regions:
    unpickling retraces the region's code, and ``aten.full`` of a symbolic size fails there, torch
    2.13: a Qwen2 applied with ``compile=True`` and run again on a warm cache) becomes one INFO line
    of the ``autoprec`` logger. Inductor recompiles the entry, as it does for any miss."""

    _LOGGER = "torch._inductor.codecache"

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).endswith("unable to load compiled graph"):
            self.seen += 1
            return False
        return True

    def __enter__(self) -> None:
        self.seen = 0
        logging.getLogger(self._LOGGER).addFilter(self)

    def __exit__(self, *exc: object) -> None:
        logging.getLogger(self._LOGGER).removeFilter(self)
        if self.seen:
            _log.info("Inductor's FX graph cache could not load %d entr%s of this graph (a torch limitation "
                      "with dynamic shapes in shared regions); recompiled", self.seen,
                      "y" if self.seen == 1 else "ies")


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
