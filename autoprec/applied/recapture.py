"""A batch outside a dynamic capture's ranges, met in the middle of a training loop
(docs/architecture.md#runtime).

``autoprec.apply(model, policy, example_batch)`` captures the example's shapes static, and at the
first call of another shape once more with dynamic dimensions (:meth:`Recapture.from_static`, below);
``apply(..., strict_shapes=True)`` captures with dynamic dimensions at once. A dynamic capture's
ranges are those :mod:`autoprec.capture.dims` derives: batch sizes up to the example's size (or
the larger call's), sequence lengths up to ``config.max_position_embeddings``, else (T5, models
without that field) up to the example's (twice it, where the call was longer). A later batch that
is longer or larger does not fit. Unless ``strict_shapes=True``, the module then serves it instead
of raising (:class:`Recapture`):

- a size **above** its range: the model is captured again, with dynamic dimensions, for ranges
  that reach at least twice the old upper bound and the new size in the roles above their range
  (so a loop whose lengths creep up re-captures a few times, not at every batch), never past
  ``config.max_position_embeddings``: a longer sequence raises ``ValueError`` (the model's
  position table has no rows for it; a compiled graph aborted the process on the out-of-range
  index); the module switches to the new graph (a compiled one compiles again on this call). One
  INFO line on the ``autoprec`` logger says so;
- a size **below** its range (``torch.export`` narrowed the lower bound, e.g. a target length of
  2 when the code needs 3), or a model that cannot be exported with the wider ranges: that shape
  gets a graph of its own from the per-shape cache
  (:class:`autoprec.applied.shape_cache.ShapeCache`, at most ``MAX_SHAPES``, each logged), and
  the batches in the ranges keep running the dynamic graph.

A graph captured for one shape (``apply``'s first capture; or because the batches it was
captured from did not vary: ``autoprec train`` and ``tune`` capture for the model file's first
batches, :func:`autoprec.capture.capture_for`), met with another shape, is captured again with
dynamic dimensions once, its ranges reaching both shapes (:meth:`Recapture.from_static`); a model
that cannot be exported so gets the per-shape cache from then on. (It went to the per-shape cache at
once, and a loader whose lengths varied after its first batches stopped ``autoprec train`` at its
17th shape.)

Inputs that were captured as one dimension but disagree in a call (``input_ids`` of length 30 with
an ``attention_mask`` of 28) are a mistake in the batch, not a range: that error is raised as it is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import fx

from autoprec.applied.shape_cache import InputCheck, PositionLimit, ShapeCache, is_dynamic
from autoprec.capture import (
    PLAN_META,
    InputShapes,
    capture_dynamic,
    maxima,
    plan_dims,
    tensor_shapes,
    unserved,
)
from autoprec.errors import CaptureError
from autoprec.modelspec import split_batch

__all__ = ["Applied", "Recapture", "Routed"]

_log = logging.getLogger("autoprec")


class Applied(Protocol):
    """What recapture needs of :class:`autoprec.applied.apply.MixedPrecisionModule` (which imports
    this module, so it is named by this protocol): its graph, whether it compiles, how messages name
    it, what it runs and checks, and how to switch them."""

    graph_module: fx.GraphModule
    compiled: bool

    @property
    def what(self) -> str:
        """How messages name the module."""

    @property
    def runner(self) -> Callable[..., Any]:
        """What a training call runs."""

    @property
    def input_check(self) -> InputCheck:
        """What checks a call's input shapes."""

    def serve(self, runner: Callable[..., Any], input_check: InputCheck) -> None:
        """Serve later calls with ``runner``, checked by ``input_check``."""

    def adopt(self, other: Any) -> None:
        """Take ``other``'s graph, runner and input check (the same policy on a new capture)."""


class Routed:
    """A dynamic graph for the calls in its ranges, a per-shape cache for the others.

    Args:
        fn: The dynamic graph's callable (compiled or not).
        inputs: Its input check (:class:`autoprec.capture.InputShapes`); a call it refuses goes to
            ``cache``.
        cache: The per-shape graphs (:class:`ShapeCache`, not strict).
    """

    def __init__(self, fn: Callable[..., Any], inputs: InputCheck, cache: ShapeCache) -> None:
        self.fn, self.inputs, self.cache = fn, inputs, cache

    def check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Accept every call (routing decides where it runs; the cache refuses past ``MAX_SHAPES``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the call on the dynamic graph when its shapes fit, else on the shape's own graph."""
        try:
            self.inputs.check(args, kwargs)
        except ValueError:
            return self.cache(*args, **kwargs)
        return self.fn(*args, **kwargs)

    def stats(self) -> dict[str, Any]:
        """``{"mode": "dynamic+per_shape", "captures", "capture_seconds", "shapes"}`` (the dynamic
        graph counted in ``captures``; ``shapes``: those with a graph of their own)."""
        st = self.cache.stats()
        return {"mode": "dynamic+per_shape", "captures": 1 + st["captures"],
                "capture_seconds": st["capture_seconds"], "shapes": st["shapes"]}


class Recapture:
    """What a non-strict :class:`~autoprec.applied.apply.MixedPrecisionModule` does with a call its
    input check refuses (module docstring): re-capture with wider ranges, or route the shape to the
    per-shape cache, or re-raise.

    Args:
        model: The fp32 model.
        example_batch: The example batch given to ``apply`` (the capture's example when the
            refused call has a size below 2 in a dynamic dimension, which export cannot take).
        rebuild: ``rebuild(graph_module) -> MixedPrecisionModule`` applying the policy to a new
            capture (same policy, placement, compile).
        build_static: ``build_static(batch) -> callable``, one shape's graph (the per-shape cache's).

    Attributes:
        recaptures: How many times the model was captured again with wider ranges.
    """

    def __init__(self, model: Any, example_batch: Any, rebuild: Callable[[Any], Any],
                 build_static: Callable[[Any], Callable[..., Any]]) -> None:
        self.model, self.example = model, example_batch
        self.rebuild, self.build_static = rebuild, build_static
        self.limit = PositionLimit(model)
        self.recaptures = 0

    @torch.compiler.disable  # a user's torch.compile(mp) runs it as it is, not traced (PassError)
    def __call__(self, mp: Applied, args: tuple[Any, ...], kwargs: dict[str, Any], error: ValueError) -> None:
        """Make ``mp`` serve a call of these shapes, or raise ``error`` (the input check's).
        ``torch.compile`` of the applied module (by the user, or ``TrainingArguments(torch_compile=
        True)``) does not trace into it (``torch.compiler.disable``): Dynamo tracing the capture and
        the passes failed at the first batch of a new shape ("[assign_dtypes] RuntimeError:
        expected int arg").

        Raises:
            ValueError: an empty batch (an input with a dimension of size 0: a re-capture on it
                failed with a message about the example batch); a sequence longer than
                ``config.max_position_embeddings``; or ``error``, when
                the call is not outside a range (inputs that share a dimension disagree, another
                structure) or takes both positional and keyword tensors, with advice for this mode
                (:func:`autoprec.capture.shapes.unserved`: not "without strict_shapes=True").
        """
        had = dict(tensor_shapes(*split_batch(self.example)))  # an input empty in the example too is its way
        if empty := [n for n, shape in tensor_shapes(args, kwargs) if 0 in shape and 0 not in had.get(n, ())]:
            raise ValueError(f"{mp.what}: input shapes {_text(args, kwargs)}: an empty batch ({empty[0]} has "
                             "a dimension of size 0), which no capture serves and no step can train on; skip "
                             "it in the loop (or drop it in the loader)") from None
        try:
            self._serve(mp, args, kwargs, error)
        except ValueError as e:
            if e is error:
                raise unserved(error) from None
            raise

    def _serve(self, mp: Applied, args: tuple[Any, ...], kwargs: dict[str, Any], error: ValueError) -> None:
        """:meth:`__call__`'s body: raises ``error`` itself where no capture can serve the call."""
        check = mp.input_check
        if (args and kwargs) or isinstance(mp.runner, (Routed, ShapeCache)):
            raise error
        if not is_dynamic(mp.graph_module):
            return self.from_static(mp, args, kwargs, error)
        if not isinstance(check, InputShapes) or not check.ranges:
            raise error
        ranges = check.ranges
        # the call's sizes by the captured symbols: a length-1 sequence is below a range too
        extents = check.role_extents(args, kwargs)
        sizes = {r: hi for r, (_lo, hi) in extents.items()}
        bounds = {role: (lo, hi) for role, lo, hi in ranges.values()}
        above = [r for r, (_lo, hi) in bounds.items() if hi is not None and sizes.get(r, 0) > hi]
        below = [r for r, (lo, _hi) in bounds.items()
                 if lo is not None and r in extents and extents[r][0] < lo]
        if not above and not below:
            if not check.static_differs(args, kwargs):
                raise error
            self._route(mp, args, kwargs)  # a size no capture of this plan makes dynamic (an image's)
            _log.info("%s: input shapes %s differ from the captured ones in a dimension captured static; "
                      "such shapes get a graph each (per-shape cache)", mp.what, _text(args, kwargs))
            return
        shapes = _text(args, kwargs)
        self.limit.refuse(mp.what, shapes, {r: sizes[r] for r in above}, error)
        batch = dict(kwargs) if kwargs else tuple(args)
        if not below:  # only the roles above their range widen (past no position table: plan_dims)
            at_least = {r: max(sizes.get(r, 0), 2 * hi) if r in above else hi
                        for r, (_lo, hi) in bounds.items() if hi is not None}
            example = batch if min(sizes.values(), default=0) >= 2 else self.example
            start = time.perf_counter()
            if self._try_dynamic(mp, example, at_least, args, kwargs)[0]:
                _log.info("%s: input shapes %s are outside the captured ranges (%s); captured again with "
                          "ranges %s (recapture %d, %.1f s%s; apply(..., strict_shapes=True) raises instead)",
                          mp.what, shapes, _ranges(ranges), _captured(mp.input_check), self.recaptures,
                          time.perf_counter() - start, ", compiles on this call" if mp.compiled else "")
                return
        self._route(mp, args, kwargs)
        _log.info("%s: input shapes %s are outside the captured ranges (%s) and a wider dynamic capture "
                  "cannot serve them; such shapes get a graph each (per-shape cache; apply(..., "
                  "strict_shapes=True) raises instead)", mp.what, shapes, _ranges(ranges))

    def _route(self, mp: Applied, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Make ``mp``'s dynamic graph serve the calls in its ranges and a per-shape cache the
        others (:class:`Routed`)."""
        cache = ShapeCache(self.build_static, plan_dims(self.model, args, kwargs), mp.what, strict=False,
                           limit=self.limit)
        routed = Routed(mp.runner, mp.input_check, cache)
        mp.serve(routed, routed)


    def _try_dynamic(self, mp: Applied, example: Any, at_least: dict[str, int], args: tuple[Any, ...],
                     kwargs: dict[str, Any], keep_refused: bool = False) -> tuple[bool, Any]:
        """Capture ``example`` again with dynamic dimensions whose ranges reach ``at_least`` and
        switch ``mp`` to it when the new graph accepts this call; ``(switched, the capture or None)``
        (not switched: the export failed, was not dynamic, or narrowed a range below this call;
        with ``keep_refused``, ``mp`` takes a dynamic graph that refuses this call all the same,
        counted as a recapture, and ``switched`` stays False: the caller routes this call)."""
        try:
            gm = capture_dynamic(self.model, example, at_least)
        except CaptureError:
            return False, None
        if not is_dynamic(gm):
            return False, gm
        new = self.rebuild(gm)
        try:
            new.input_check.check(args, kwargs)
        except ValueError:
            if keep_refused:
                mp.adopt(new)
                self.recaptures += 1
            return False, gm
        mp.adopt(new)
        self.recaptures += 1
        return True, gm

    def from_static(self, mp: Applied, args: tuple[Any, ...], kwargs: dict[str, Any],
                    error: ValueError) -> None:
        """Make ``mp``, whose graph serves one shape, serve this call's too: one capture with
        dynamic dimensions whose ranges reach the example batch's sizes, and in a role where this
        call is larger, its size and at least twice the example's (as :meth:`__call__` widens);
        where that capture narrowed a range below this call (``torch.export`` found the code needs
        a longer sequence), the dynamic graph serves the calls in its ranges and this shape gets a
        graph of its own (:class:`Routed`); where it failed or is not dynamic, a per-shape cache
        seeded with ``mp``'s graph serves this shape and every later one (logged each way).

        Raises:
            ValueError: a sequence longer than ``config.max_position_embeddings``."""
        start, shapes = time.perf_counter(), _text(args, kwargs)
        batch = dict(kwargs) if kwargs else tuple(args)
        own = maxima([plan_dims(self.model, *split_batch(self.example))])
        call = maxima([plan_dims(self.model, args, kwargs)])
        self.limit.refuse(mp.what, shapes, call, error)
        # as a dynamic graph widens: a role above the example's size reaches at least twice it
        sizes = {r: max(n, 2 * own[r]) if n > own.get(r, n) else own.get(r, n) for r, n in call.items()}
        sizes |= {r: n for r, n in own.items() if r not in call}
        example = self.example if min(own.values(), default=0) >= 2 else batch
        adopted, gm = self._try_dynamic(mp, example, sizes, args, kwargs, keep_refused=True)
        if adopted or is_dynamic(mp.graph_module):
            _log.info("%s: input shapes %s differ from the one shape captured; captured again with "
                      "dynamic dimensions, ranges %s (recapture %d, %.1f s%s)", mp.what, shapes,
                      _captured(mp.input_check), self.recaptures, time.perf_counter() - start,
                      ", compiles on this call" if mp.compiled else "")
            if not adopted:  # below a range export narrowed: this shape gets a graph of its own
                self._route(mp, args, kwargs)
                _log.info("%s: input shapes %s are below those ranges; such shapes get a graph each "
                          "(per-shape cache)", mp.what, shapes)
            return
        cache = ShapeCache.seeded(self.model, self.example, mp.runner, self.build_static, mp.what,
                                  strict=False, plan=gm.meta.get(PLAN_META) if gm is not None else None)
        mp.serve(cache, cache)
        _log.info("%s: input shapes %s differ from the one shape captured and the model cannot be captured "
                  "with dynamic dimensions for both; such shapes get a graph each (per-shape cache)",
                  mp.what, shapes)


def _captured(check: InputCheck) -> str:
    """The ranges of a dynamic capture's input check (:class:`autoprec.capture.InputShapes`), as
    :func:`_ranges` writes them; empty for a check without ranges."""
    return _ranges(check.ranges) if isinstance(check, InputShapes) else ""


def _ranges(ranges: dict[str, tuple[str, int | None, int | None]]) -> str:
    """``"batch 1..4, seq 2..27"``."""
    return ", ".join(dict.fromkeys(f"{role} {lo}..{'' if hi is None else hi}"
                                   for role, lo, hi in ranges.values()))


def _text(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{n}: {s}" for n, s in tensor_shapes(args, kwargs)) + "}"
