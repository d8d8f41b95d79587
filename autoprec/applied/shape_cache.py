"""Batches whose shape changes (docs/architecture.md#runtime).

``autoprec.apply(model, policy, batch, dynamic=True)`` captures ``batch``'s shapes static and, at
the first call of another shape (``torch.compile``'s rule), tries one capture with symbolic batch
and sequence dimensions (:func:`autoprec.capture.capture_dynamic`, ranges:
:mod:`autoprec.capture.dims`; :meth:`autoprec.applied.recapture.Recapture.from_static`), compiled
once with ``torch.compile(dynamic=True)``; :class:`CompileLog` counts and logs the compiles Dynamo
makes of it (one, plus one the first time a size-1 batch comes: Dynamo
specialises sizes 0 and 1). Where the model cannot be captured so (``torch.export`` raises, e.g.
because its code specialises a size), :class:`ShapeCache` holds one captured, lowered (and
compiled) graph per input shape instead, built on first use with an INFO line on the
``autoprec`` logger, at most :data:`MAX_SHAPES` of them; a shape beyond that raises
``ShapeLimitError`` (a ``ValueError``), and a shape outside the example's ranges raises
``ValueError`` when the cache is ``strict`` (``apply(..., strict_shapes=True)``; otherwise it gets
its graph like any other, logged).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from torch import fx, nn

from autoprec._torch_compat import pytree
from autoprec.capture import (
    BATCH,
    DIMS_META,
    MAX_SHAPES,
    RANGE_ADVICE,
    DimPlan,
    max_positions,
    plan_dims,
    role_sizes,
    tensor_shapes,
)
from autoprec.device import compile_count
from autoprec.errors import ShapeLimitError
from autoprec.modelspec import split_batch

__all__ = ["MAX_SHAPES", "CompileLog", "InputCheck", "PositionLimit", "ShapeCache", "is_dynamic"]

_log = logging.getLogger("autoprec")


def is_dynamic(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` was captured with dynamic dimensions (it records their ranges)."""
    return bool(gm.meta.get(DIMS_META))


class InputCheck(Protocol):
    """What checks a call's input shapes before a graph runs it
    (:class:`autoprec.capture.InputShapes`, :class:`ShapeCache`,
    :class:`autoprec.applied.recapture.Routed`)."""

    def check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Return when the graph serves these inputs; raise ``ValueError`` naming the input and
        both shapes when it does not."""


class PositionLimit:
    """The longest sequence a module serves whatever its captures' ranges:
    ``config.max_position_embeddings`` (:func:`autoprec.capture.max_positions`; none without it).
    A learned position table (GPT-2) has no rows past it: eager raises ``IndexError``, and a compiled
    graph aborts the process on the out-of-range index; a rotary model (Qwen2, Llama) was configured
    for no longer. Checked before any graph is built or run for a new shape: by the per-shape cache
    (:class:`ShapeCache`) and by :mod:`autoprec.applied.recapture`.

    Args:
        model: The fp32 model (its ``config``; its ``forward`` names the inputs by role).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model, self.positions = model, max_positions(model)

    def check(self, what: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raise ``ValueError`` (:meth:`refuse`) when a sequence of this call is past the limit."""
        if self.positions:
            self.refuse(what, _shapes_text(args, kwargs), role_sizes(self.model, args, kwargs))

    def refuse(self, what: str, shapes: str, sizes: dict[str, int], error: Exception | None = None) -> None:
        """Raise ``ValueError`` naming the module (``what``), the call's ``shapes``, the role and its
        size when a sequence size in ``sizes`` (role -> size) is above the limit (``from error``)."""
        long = [r for r, n in sizes.items() if r != BATCH and self.positions and n > self.positions]
        if long:
            raise ValueError(
                f"{what}: input shapes {shapes}: {long[0]} length {sizes[long[0]]} is above the model's "
                f"config.max_position_embeddings ({self.positions}), the longest the capture serves: a "
                "learned position table has no rows past it (the model itself raises IndexError; a "
                "compiled graph would abort the process), and a rotary model was configured for no "
                "longer. Truncate the batch, or raise config.max_position_embeddings before "
                "autoprec.apply where the model's positions allow it (rotary embeddings)") from error


class CompileLog:
    """Calls a ``torch.compile``'d function; counts, times and logs each compile a call triggers.

    A compile is seen as a rise of Dynamo's ``counters["stats"]["unique_graphs"]`` during the call;
    its seconds are the whole call's (compile and first run; the backward compiles in the first
    ``backward()``, outside it). Log lines number compiles across the process (``compile 3``:
    the third a ``CompileLog`` saw, whichever graph) and per graph (``2nd of this graph``).

    Args:
        fn: The compiled callable.
        what: How log lines name it.
        mode: What :meth:`stats` calls it: ``"dynamic"`` (compiled with ``dynamic=True``) or
            ``"static"``.
    """

    #: Compiles logged by every ``CompileLog`` of this process (the log lines' running number).
    process_compiles = 0

    def __init__(self, fn: Callable[..., Any], what: str, mode: str = "dynamic") -> None:
        self.fn, self.what, self.mode = fn, what, mode
        self.compiles, self.compile_seconds = 0, 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call ``fn``; log an INFO line when the call compiled."""
        before, start = compile_count(), time.perf_counter()
        out = self.fn(*args, **kwargs)
        if compile_count() != before:
            seconds = time.perf_counter() - start
            self.compiles += 1
            self.compile_seconds += seconds
            CompileLog.process_compiles += 1
            _log.info("compiled %s for input shapes %s (compile %d, %s of this graph, %.1f s)", self.what,
                      _shapes_text(args, kwargs), CompileLog.process_compiles, ordinal(self.compiles),
                      seconds)
        return out

    def stats(self) -> dict[str, Any]:
        """``{"mode": "dynamic" or "static", "captures": 1, "compiles", "compile_seconds"}``."""
        return {"mode": self.mode, "captures": 1, "compiles": self.compiles,
                "compile_seconds": self.compile_seconds}


def ordinal(n: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``4th``, ``11th``, ``21st``, ..."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


class ShapeCache:
    """One graph per input shape, built on first use, at most ``max_shapes`` of them.

    It is also the module's input check (``check``): shapes outside the ranges of
    :func:`autoprec.capture.plan_dims` for the example batch are refused before anything is captured.

    Args:
        build: ``build(batch) -> callable`` capturing and lowering a graph for ``batch`` (a dict
            or tuple as the model is called with), e.g. ``lambda b: apply(model, policy, b).runner``.
        plan: The dimension plan of the example batch (its ranges bound the shapes accepted).
        what: How messages name the module, e.g. ``"MixedPrecisionModule of Qwen2ForCausalLM"``.
        max_shapes: The most graphs kept (:data:`MAX_SHAPES`).
        strict: Refuse shapes outside ``plan``'s ranges (``ValueError`` in :meth:`check`); when
            False they are accepted and get a graph of their own (logged once per shape).
        limit: Refuses a new shape whose sequence is past the model's positions, before its graph is
            built (:class:`PositionLimit`; :meth:`seeded` sets it from the model), whatever ``strict``.

    Attributes:
        captures: Graphs built so far (the example's included), and ``capture_seconds`` their time.
    """

    def __init__(self, build: Callable[[Any], Callable[..., Any]], plan: DimPlan, what: str,
                 max_shapes: int = MAX_SHAPES, strict: bool = True,
                 limit: PositionLimit | None = None) -> None:
        self.build, self.plan, self.what, self.max_shapes, self.strict = build, plan, what, max_shapes, strict
        self.limit = limit
        self._fns: dict[tuple[Any, ...], Callable[..., Any]] = {}
        self.captures, self.capture_seconds = 0, 0.0

    @classmethod
    def seeded(cls, model: nn.Module, example_batch: Any, fn: Callable[..., Any],
               build: Callable[[Any], Callable[..., Any]], what: str, strict: bool = True,
               plan: DimPlan | None = None) -> ShapeCache:
        """A cache whose first graph is ``fn`` (for ``example_batch``'s shapes) and whose ranges are
        ``plan``'s: the plan the capture was made under (``gm.meta[PLAN_META]`` of
        :func:`autoprec.capture.capture_dynamic`'s static fallback), else planned from ``example_batch``."""
        args, kwargs = split_batch(example_batch)
        cache = cls(build, plan or plan_dims(model, args, kwargs), what, strict=strict,
                    limit=PositionLimit(model))
        cache.add(args, kwargs, fn, 0.0)
        return cache

    def add(self, args: tuple[Any, ...], kwargs: dict[str, Any], fn: Callable[..., Any],
            seconds: float) -> None:
        """Register the graph ``fn`` built (in ``seconds``) for the shape of this call."""
        self._fns[_key(args, kwargs)] = fn
        self.captures += 1
        self.capture_seconds += seconds

    def check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raise ``ValueError`` if a batch or sequence dimension of the call leaves its range
        (``strict`` only; otherwise the shape is logged when its graph is built).

        The message names the input, its shape and the allowed range, and says what to do.
        """
        bad = self.plan.out_of_range(args, kwargs) if self.strict else None
        if bad:
            raise ValueError(f"{self.what} runs one graph per input shape, for {self.plan.describe()}; got "
                             f"{_shapes_text(args, kwargs)}: {'; '.join(bad)}.\n  What to do: {RANGE_ADVICE}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the graph for this call's shape, capturing and lowering it first if it is new."""
        key = _key(args, kwargs)
        fn = self._fns.get(key)
        if fn is None:
            if self.limit is not None:
                self.limit.check(self.what, args, kwargs)
            fn = self._new(key, args, kwargs)
        return fn(*args, **kwargs)

    def _new(self, key: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[..., Any]:
        shapes = _shapes_text(args, kwargs)
        if len(self._fns) >= self.max_shapes:
            raise ShapeLimitError(
                f"{self.what} already holds graphs for {len(self._fns)} input shapes, the most it keeps "
                f"(autoprec.applied.shape_cache.MAX_SHAPES); {shapes} would be one more.\n  What to do: pad "
                "batches to a few fixed lengths (e.g. to multiples of 64: pad_to_multiple_of=64) and use "
                "DataLoader(drop_last=True), or make the model exportable with dynamic shapes (the INFO "
                "log line of autoprec.apply names why it is not).")
        if args and kwargs:
            raise ValueError(f"{self.what}: a new input shape ({shapes}) needs its own capture, which takes "
                             "a batch called either positionally or by keyword, not both; call it as "
                             "model(**batch)")
        start = time.perf_counter()
        fn = self.build(dict(kwargs) if kwargs else tuple(args))
        self.add(args, kwargs, fn, time.perf_counter() - start)
        _log.info("new input shape %s for %s: captured and lowered a graph for it (%d of at most %d, "
                  "%.1f s; a compiled one compiles on its first call)", shapes, self.what, len(self._fns),
                  self.max_shapes, time.perf_counter() - start)
        return fn

    def stats(self) -> dict[str, Any]:
        """``{"mode": "per_shape", "captures", "capture_seconds", "shapes"}`` (shapes as text)."""
        return {"mode": "per_shape", "captures": self.captures, "capture_seconds": self.capture_seconds,
                "shapes": [str(k[-1]) for k in self._fns]}


def _key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The cache key of a call's structure and shapes (keyword order does not matter)."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(sorted(kwargs.items()))))
    return (str(spec), tuple(tuple(x.shape) if hasattr(x, "shape") else type(x).__name__ for x in leaves))


def _shapes_text(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """``{input_ids: (2, 100), labels: (2, 100)}`` (positional arguments as ``args[i]``)."""
    return "{" + ", ".join(f"{name}: {shape}" for name, shape in tensor_shapes(args, kwargs)) + "}"
