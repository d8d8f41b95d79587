"""Micro-batches and global batches built from a model file (``tune --global-batch``,
``Policy.batching``; docs/model-contract.md#micro-batches).

The global batch of optimizer step ``s`` holds ``N`` examples (the model file's batch unit: the
leading dimension of its ``get_batch``'s tensors):

- when ``get_batch`` takes a ``batch_size`` keyword, it is ``get_batch(s, device, batch_size=N)``;
- otherwise, with the file's batch ``b`` dividing ``N``, it is ``get_batch(s*k), ...,
  get_batch(s*k + k-1)`` (``k = N / b``) concatenated along dimension 0 (``N == b`` is
  ``get_batch(s)`` itself, unchanged).

Micro-batch ``j`` of step ``s`` is rows ``j*m .. j*m + m-1`` of that global batch, for every tensor
of the batch (dict, tuple or list, nested); values that are not tensors are passed to each
micro-batch unchanged. So the data of a step does not depend on the micro-batch, and a run at
micro-batch ``m`` with ``N / m`` accumulated micro-batches sees what a run at micro-batch ``N``
sees. Splitting is sound when every tensor's leading dimension is the batch (``N``): a tensor of
another leading size (a shared mask, a scalar) cannot be split, and :class:`MicroBatches` refuses
it naming the entry. The mean of the micro-batches' mean losses is the global batch's mean loss
when each micro-batch counts the same number of loss terms (no padding or ``-100`` labels that vary
between rows); otherwise it weights micro-batches equally, as HF Trainer and Lightning do with
gradient accumulation.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from autoprec.errors import ModelSpecError
from autoprec.modelspec.loader import ModelSpec
from autoprec.policy.batching import Batching

__all__ = ["Accumulated", "MicroBatches", "batch_rows", "count_tokens", "divisors", "one_micro_batch",
           "first_batches", "step_batches", "takes_batch_size"]


@dataclass(frozen=True)
class Accumulated:
    """The micro-batches of one optimizer step, in order: a :class:`~autoprec.training.train.TrainStep`
    given one runs a forward/backward per part (each loss divided by ``len(parts)``) and one
    optimizer step.

    Attributes:
        parts: The micro-batches (each a batch as ``get_batch`` returns one).
    """

    parts: tuple[Any, ...]


def count_tokens(tokens_per_batch: Callable[[Any], int], batch: Any) -> int:
    """Tokens of ``batch`` by the model file's ``tokens_per_batch``: summed over the parts of an
    :class:`Accumulated` step."""
    if isinstance(batch, Accumulated):
        return sum(tokens_per_batch(p) for p in batch.parts)
    return tokens_per_batch(batch)


def one_micro_batch(batch: Any) -> Any:
    """A batch the graph was captured for: ``batch`` itself, or the first micro-batch of an
    :class:`Accumulated` step (what a monitor re-runs to find a non-finite node)."""
    return batch.parts[0] if isinstance(batch, Accumulated) else batch


def step_batches(spec: ModelSpec, batching: Batching | None, device: torch.device,
                 policy_file: str | os.PathLike | None = None) -> MicroBatches | None:
    """The optimizer steps' batches a policy's ``batching`` asks of ``spec`` (None without one:
    ``get_batch(step)`` as the file gives it).

    Raises:
        ModelSpecError: the model file cannot give them (:class:`MicroBatches`), the message naming
            the policy file (``policy_file``) and its ``batching`` field's micro-batch and global batch."""
    if batching is None:
        return None
    try:
        return MicroBatches(spec, batching.global_batch, batching.micro_batch, device)
    except ModelSpecError as e:
        who = f"{os.fspath(policy_file)}: " if policy_file is not None else ""
        raise ModelSpecError(f"{who}the policy's batching trains at {batching.describe()}, which the model "
                             f"file cannot give: {e}") from None


def first_batches(spec: ModelSpec, source: MicroBatches | None, device: torch.device, n: int) -> list[Any]:
    """The first ``n`` batches a training call sees, in order: ``source``'s micro-batches
    (:func:`step_batches`), else ``get_batch(0..n-1)``. What ``train`` and ``train --compare``
    capture their policy's graph from (``autoprec.capture.capture_for``, with ``n = PROBE_BATCHES``),
    as ``tune`` does: the same dynamic-or-static choice, the graph ``tune`` measured."""
    return [source.micro(i, device) if source is not None else spec.get_batch(i, device) for i in range(n)]


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` >= 1, ascending (the micro-batches a global batch of ``n`` allows)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def takes_batch_size(get_batch: Callable[..., Any]) -> bool:
    """Whether ``get_batch`` names a ``batch_size`` parameter (docs/model-contract.md). A
    ``**kwargs`` alone does not count: a ``get_batch(step, device, **kw)`` that ignores ``kw``
    would return the file's batch where N examples were asked for, and its batches are concatenated
    instead."""
    try:
        params = inspect.signature(get_batch).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "batch_size" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params)


def _leaves(batch: Any) -> list[tuple[str, Any]]:
    """``(path, leaf)`` of a batch, the path as the user writes it (``batch['input_ids']``)."""
    flat, _ = tree_flatten_with_path(batch)
    return [(f"batch{keystr(path)}", leaf) for path, leaf in flat]


def batch_rows(batch: Any, path: str) -> int:
    """The leading dimension shared by every tensor of ``batch`` (its number of examples).

    Raises:
        ModelSpecError: no tensor, a 0-d tensor, or tensors whose leading sizes differ; the message
            names ``path``, the entry and what to add."""
    sizes = [(where, int(t.shape[0]) if t.dim() else None) for where, t in _leaves(batch)
             if isinstance(t, torch.Tensor)]
    if not sizes:
        raise ModelSpecError(f"{path}: get_batch returned no tensor; a batch without one cannot be split "
                             "into micro-batches")
    first = sizes[0]
    for where, rows in sizes:
        if rows is None or rows != first[1]:
            shape = "a 0-d tensor" if rows is None else f"leading dimension {rows}"
            raise ModelSpecError(
                f"{path}: get_batch's batch cannot be split into micro-batches: {where} has {shape}, "
                f"not the batch's {first[1]} ({first[0]}); every tensor of a batch must have the "
                "examples along dimension 0 (docs/model-contract.md#micro-batches)")
    return first[1]


def _split(batch: Any, m: int) -> list[Any]:
    flat, spec = tree_flatten(batch)
    rows = next(t.shape[0] for t in flat if isinstance(t, torch.Tensor))
    parts = []
    for j in range(rows // m):
        parts.append(tree_unflatten([t[j * m:(j + 1) * m] if isinstance(t, torch.Tensor) else t
                                     for t in flat], spec))
    return parts


def _concat(parts: list[tuple[str, Any]], path: str) -> Any:
    """The batches of ``parts`` (``(call, batch)``, e.g. ``("get_batch(2)", batch)``) concatenated
    along dimension 0.

    Raises:
        ModelSpecError: their structures differ, or a tensor's sizes beyond dimension 0 differ
            between two calls (a loader that pads each batch to its own longest sequence); names
            the calls, the entry and both shapes, and says to add ``batch_size=`` to ``get_batch``."""
    flats = [tree_flatten(b) for _, b in parts]
    spec = flats[0][1]
    if any(s != spec for _, s in flats[1:]):
        raise ModelSpecError(f"{path}: get_batch returns batches of different structure from step to step; "
                             "they cannot be concatenated into a global batch (add a batch_size= "
                             "argument to get_batch)")
    for (where, first), *rest in zip(_leaves(parts[0][1]), *(_leaves(b) for _, b in parts[1:]), strict=True):
        if not isinstance(first, torch.Tensor):
            continue
        for (call, _), (_, t) in zip(parts[1:], rest, strict=True):
            if t.shape[1:] != first.shape[1:]:
                raise ModelSpecError(
                    f"{path}: the global batch concatenates {', '.join(c for c, _ in parts)}, but {where} "
                    f"is {tuple(first.shape)} in {parts[0][0]} and {tuple(t.shape)} in {call}: "
                    "batches concatenate along dimension 0 only, so their other sizes must agree (a loader "
                    "that pads each batch to its own longest sequence gives each another length). What "
                    "to do: add a batch_size= argument, def get_batch(step, device, batch_size=...), "
                    "so each global batch is built, and padded, at once; or pad every batch to one "
                    "length (docs/model-contract.md#micro-batches)")
    leaves = [torch.cat(col) if isinstance(col[0], torch.Tensor) else col[0]
              for col in zip(*(f for f, _ in flats), strict=True)]
    return tree_unflatten(leaves, spec)


class MicroBatches:
    """The global batches of ``global_batch`` examples and their micro-batches of ``micro_batch``
    (the module docstring), built from a model file.

    Args:
        spec: The loaded model file.
        global_batch: N, examples per optimizer step (the file's batch unit), >= 1.
        micro_batch: m, examples per forward/backward; must divide N.
        device: Where ``get_batch`` puts the tensors (for the check; the batches themselves take
            the device each call names).

    Attributes:
        file_batch: b, the leading dimension of ``get_batch(0)``.
        sized: Whether ``get_batch`` takes ``batch_size`` (else global batches concatenate the file's).
        accumulation: N / m.

    Raises:
        ModelSpecError: ``m`` does not divide ``N``; the file's batch cannot be split (names the
            entry); without ``batch_size``, ``b`` does not divide ``N`` (says to add the argument).
        ValueError: N or m below 1.
    """

    def __init__(self, spec: ModelSpec, global_batch: int, micro_batch: int, device: torch.device) -> None:
        if global_batch < 1 or micro_batch < 1:
            raise ValueError(f"global batch and micro-batch must be >= 1, got {global_batch}, {micro_batch}")
        self.spec, self.global_batch, self.micro_batch = spec, int(global_batch), int(micro_batch)
        if self.global_batch % self.micro_batch:
            raise ModelSpecError(f"{spec.path}: micro-batch {micro_batch} does not divide the global batch "
                                 f"{global_batch}; the micro-batches that do: "
                                 f"{', '.join(map(str, divisors(self.global_batch)))}")
        self.accumulation = self.global_batch // self.micro_batch
        self.sized = takes_batch_size(spec.get_batch)
        self.file_batch = batch_rows(spec.get_batch(0, device), spec.path)
        if not self.sized and self.global_batch % self.file_batch:
            raise ModelSpecError(
                f"{spec.path}: global batch {global_batch} is not a multiple of the file's batch "
                f"{self.file_batch} (get_batch(0)'s leading dimension), and get_batch takes no "
                "batch_size; add one: def get_batch(step, device, batch_size=...) "
                "(docs/model-contract.md#micro-batches)")
        self._last: tuple[int, str, Any] | None = None  # (step, device, global batch): parts share it

    def global_at(self, step: int, device: torch.device) -> Any:
        """The global batch of optimizer step ``step`` (``global_batch`` rows).

        Raises:
            ModelSpecError: the batch cannot be split, the file's batches cannot be concatenated
                (other sizes beyond dimension 0: names the calls and shapes), or its rows are not
                ``global_batch``."""
        if self._last is not None and self._last[:2] == (step, str(device)):
            return self._last[2]
        if self.sized:
            batch = self.spec.get_batch(step, device, batch_size=self.global_batch)
            parts = [(f"get_batch({step}, device, batch_size={self.global_batch})", batch)]
        else:
            k = self.global_batch // self.file_batch
            calls = [step * k + r for r in range(k)]
            parts = [(f"get_batch({i})", self.spec.get_batch(i, device)) for i in calls]
            batch = parts[0][1] if k == 1 else _concat(parts, self.spec.path)
        rows = batch_rows(batch, self.spec.path)
        if rows != self.global_batch:
            raise ModelSpecError(self._short(step, parts))
        self._last = (step, str(device), batch)
        return batch

    def _short(self, step: int, parts: list[tuple[str, Any]]) -> str:
        """The message for optimizer step ``step``'s global batch of the wrong size: each call that
        made it, with its rows, and what to do (a DataLoader's last, shorter batch is the usual cause)."""
        got = ", ".join(f"{call} {batch_rows(b, self.spec.path)}" for call, b in parts)
        want = (f"batch_size={self.global_batch} examples" if self.sized
                else f"{self.file_batch} examples each (get_batch(0)'s)")
        return (f"{self.spec.path}: the global batch of optimizer step {step} ({self.global_batch} examples) "
                f"needs {want}; got {got}. What to do: give every batch the same size (a DataLoader's "
                "last batch is shorter unless drop_last=True), or cycle over full batches only")

    def check_steps(self, steps: int, device: torch.device) -> None:
        """Build the global batches of the first ``steps`` optimizer steps, so a short one is refused
        before any work (``tune --global-batch`` reads its first few; ``train`` the rest as it goes).

        Another error of ``get_batch`` ends the check silently: a file with fewer batches than
        ``steps`` may still give what a run reads, and a run that reads that far reports the error.

        Raises:
            ModelSpecError: a global batch of the wrong size (names the step, each ``get_batch``
                call and its rows), or of batches that cannot be concatenated (names the calls and
                the shapes that differ)."""
        for s in range(steps):
            try:
                self.global_at(s, device)
            except ModelSpecError:
                raise
            except Exception:  # noqa: BLE001 - the file's own error, for the run that reads that far
                return

    def step(self, step: int, device: torch.device) -> Any:
        """Optimizer step ``step``'s input for a :class:`~autoprec.training.train.TrainStep`: the
        global batch itself when there is one micro-batch, else :class:`Accumulated` micro-batches."""
        batch = self.global_at(step, device)
        return batch if self.accumulation == 1 else Accumulated(tuple(_split(batch, self.micro_batch)))

    @property
    def file_stream(self) -> bool:
        """Whether micro-batch ``i`` is ``get_batch(i)`` itself: the file's batches concatenated
        (no ``batch_size``) and split back at the file's batch, so a harness over the model file
        measures this stream."""
        return not self.sized and self.micro_batch == self.file_batch

    def micro(self, index: int, device: torch.device) -> Any:
        """Micro-batch ``index`` of the stream: part ``index % A`` of step ``index // A``."""
        batch = self.global_at(index // self.accumulation, device)
        return batch if self.accumulation == 1 else _split(batch, self.micro_batch)[index % self.accumulation]

    def micro_spec(self) -> ModelSpec:
        """The model file as seen one micro-batch at a time: ``get_batch(i)`` is :meth:`micro`
        ``(i)`` (measurements of one micro-step: ``Harness(micro_spec())``). It has no held-out
        batches (their stream's later batches stand in, as for a file without ``get_heldout_batch``)."""
        return dataclasses.replace(self.spec, get_batch=self.micro, heldout_batch=None)
