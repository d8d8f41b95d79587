"""Every batch a model file gives, checked as it is given (docs/model-contract.md#get_batch).

A training graph is captured for the structure of the first batch (a dict's keys, a tuple's items,
which of them are tensors and of which dtype). A later ``get_batch(k)`` that returns another
structure (a list of ints where a tensor was, a dict without ``labels``, ``float`` ids) used to
reach the applied module and fail there, in a traceback whose advice ("apply the policy with an
example batch that holds 3 positional arguments more") has nothing to do with the cause; an empty
one failed in the capture. :class:`CheckedGetBatch` wraps ``get_batch`` (and
``get_heldout_batch``) of every :class:`~autoprec.modelspec.loader.ModelSpec`, so each batch is
checked where it is returned and the error names the file and the call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from autoprec.errors import ModelSpecError
from autoprec.modelspec.batch import describe_value

__all__ = ["BATCH_TYPES", "CheckedGetBatch"]

#: What a batch may be (docs/model-contract.md#get_batch).
BATCH_TYPES = "a Tensor, tuple, list or dict"


def _kind(obj: Any) -> str:
    """What must not change between batches at one place of a batch: a tensor's dtype and number of
    dimensions, a
    container's type and size (a dict's keys, compared separately), another value's type."""
    if isinstance(obj, torch.Tensor):
        return f"{obj.dim()}-D Tensor of {obj.dtype}"  # sizes may vary, the number of dimensions not
    if isinstance(obj, Mapping):
        return "dict"
    if isinstance(obj, (tuple, list)):
        return f"{type(obj).__name__} of {len(obj)}"
    return type(obj).__name__


def _children(obj: Any) -> list[tuple[str, Any]]:
    """``obj``'s items with their keys as ``keystr`` writes them (``['labels']``, ``[0]``): a
    mapping's (``dict``, Hugging Face's ``BatchEncoding``) or a tuple's or list's; none otherwise."""
    if isinstance(obj, Mapping):
        return [(f"[{k!r}]", v) for k, v in obj.items()]
    if isinstance(obj, (tuple, list)):
        return [(f"[{i}]", v) for i, v in enumerate(obj)]
    return []


@dataclass(frozen=True)
class _Structure:
    """A batch's structure without its values (no tensor kept alive): its :func:`_kind`, its
    description for messages, a mapping's keys and the items' structures."""

    kind: str
    text: str
    keys: frozenset[Any] | None
    items: tuple[tuple[str, _Structure], ...]

    @classmethod
    def of(cls, obj: Any) -> _Structure:
        return cls(_kind(obj), describe_value(obj), frozenset(obj) if isinstance(obj, Mapping) else None,
                   tuple((k, cls.of(v)) for k, v in _children(obj)))

    def difference(self, now: Any, path: str = "") -> tuple[str, str, str] | None:
        """The first place where ``now`` differs from this structure: ``(path, this one's
        description, now's)``, or None (values and sizes aside)."""
        if self.kind != _kind(now) or (self.keys is not None and self.keys != frozenset(now)):
            return path, self.text, describe_value(now)
        mine = dict(self.items)
        return next((d for key, value in _children(now)
                     if (d := mine[key].difference(value, path + key)) is not None), None)


def _empty(obj: Any, path: str = "") -> tuple[str, tuple[int, ...]] | None:
    """The first tensor of ``obj`` with a dimension of size 0: ``(path, shape)``, or None."""
    if isinstance(obj, torch.Tensor):
        return (path, tuple(obj.shape)) if 0 in obj.shape else None
    return next((e for key, v in _children(obj) if (e := _empty(v, path + key)) is not None), None)


class CheckedGetBatch:
    """A model file's ``get_batch`` (or ``get_heldout_batch``) whose every batch is checked: one of
    :data:`BATCH_TYPES`, no tensor with a dimension of size 0, and the structure of the first batch
    it returned (:meth:`_Structure.difference`; shapes may vary, as a dynamic capture allows). About 10
    microseconds a call. ``inspect.signature`` of it is the wrapped function's.

    Args:
        path: The model file, as messages name it.
        fn: The entry point, ``(step, device, **kw) -> batch``.
        name: Its name in messages (``"get_batch"``).
        like: Another checked entry point whose first batch this one's batches are held to as well
            (``get_heldout_batch`` to ``get_batch``'s: both run through the same model), or None.

    Raises (on a call):
        ModelSpecError: names the file, the call (``get_batch(3)``), what it returned and what was
            expected: another type, an empty batch (with the fix: ``drop_last=True``), or another
            structure than the first call's (naming the first place that differs).
    """

    def __init__(self, path: str, fn: Callable[..., Any], name: str = "get_batch",
                 like: CheckedGetBatch | None = None) -> None:
        functools.update_wrapper(self, fn)
        self.path, self.fn, self.name, self.like = path, fn, name, like
        self._first: tuple[str, _Structure] | None = None  # the call every later one is held to

    def __call__(self, step: int, device: Any, *args: Any, **kwargs: Any) -> Any:
        batch = self.fn(step, device, *args, **kwargs)
        call = f"{self.name}({step})"
        if not isinstance(batch, (torch.Tensor, tuple, list, Mapping)):
            raise ModelSpecError(f"{self.path}: {call} returned {describe_value(batch)}; "
                                 f"expected {BATCH_TYPES}")
        empty = _empty(batch)
        if empty is not None:
            raise ModelSpecError(f"{self.path}: {call} returned an empty batch (batch{empty[0]} has shape "
                                 f"{empty[1]}); a training step needs at least one example: make {self.name} "
                                 "skip it, e.g. drop a loader's empty or short last batch "
                                 "(DataLoader(drop_last=True))")
        if self._first is None and self.like is not None and self.like._first is None:
            self.like(0, device)  # the structure to hold this batch to: get_batch(0)'s
        if self._first is None:
            self._first = self.like._first if self.like is not None else (call, _Structure.of(batch))
        if (diff := self._first[1].difference(batch)) is not None:
            where, was, now = diff
            got = (f"{now}, where {self._first[0]} returned {was}" if not where
                   else f"batch{where} = {now}, where {self._first[0]}'s was {was}")
            raise ModelSpecError(
                f"{self.path}: {call} returned {got}; "
                "every batch must have the first one's structure (the same keys or items, tensors of the "
                "same dtypes and numbers of dimensions in the same places; sizes may vary), which the "
                "training graph is captured for")
        return batch
