"""The memory rule (docs/architecture.md#measurements, "Memory"): which bytes are counted where, and why.

Three quantities, one home:

===========================  ===============================================================================
:class:`SavedBytes`          bytes of the distinct tensors saved for backward in one forward
                             (``saved_tensors_hooks``; storage shared with a parameter not counted again)
:func:`training_state_bytes` parameters + their gradients + the optimizer's state after one step
                             (:func:`optimizer_state_bytes`; 0-dim step counters left out)
:class:`CudaPeak`            a harness's peak on CUDA: the allocator's peak over its passes less what was
                             allocated before, plus its model's parameters and buffers (:func:`module_bytes`)
:class:`PeakBytes`           peak bytes allocated over a ``with`` span: CUDA's allocator peak, on CPU
                             the most C heap bytes in use (:func:`autoprec.device.heap_bytes`) seen
                             after any ATen op of the span or by a 0.2 ms sampler, over their value at entry
===========================  ===============================================================================

On CUDA every measurement is ``torch.cuda.max_memory_allocated`` less what was allocated before
(the harness over its drift passes and timed steps, plus its own model's bytes: :class:`CudaPeak`;
``bench --nproc`` over a row's build and warm-up). On CPU, which keeps no
allocator statistics, the single-process :class:`~autoprec.measure.harness.Harness` (``tune``,
``bench``) counts ``SavedBytes`` of batch 0's drift pass + ``training_state_bytes``, and
``bench --nproc`` (:mod:`autoprec.commands.bench_dist`, eager DDP/FSDP2 steps) measures the
``PeakBytes`` span. They are not one rule because the harness measures compiled graphs and the
span cannot: Dynamo does not run compiled code while a (non-infra) ``TorchDispatchMode`` is on the
stack (torch/_dynamo/convert_frame.py: "non-infra torch dispatch mode present, this is not
supported today in torch.compile"). Measured (``benchmarks/memory_rules.py``, torch 2.13 CPU): a
``compile_graph`` compiled before the span ran eagerly inside it (its output's ``grad_fn`` an
eager op's, the mode seeing eager's 87 ATen ops), so the span measured the eager graph; and one
first called inside the span never compiled afterwards either (eager outside it too), which would
leave every later step of a compiled candidate eager. On eager code the two rules agree within
about 1 MiB (a 2-block MLP: 47.07 and 45.07 MiB of heap in two runs against 46.04 MiB of saved
tensors and gradients), and the counted rule is exact and deterministic (the same graph gives the
same bytes, so two policies compare to the byte: ``tune --max-memory``), where the heap peak includes
the allocator's temporaries and varies from run to run.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from autoprec._torch_compat import TorchDispatchMode
from autoprec.device import heap_bytes

__all__ = ["SAMPLE_S", "HeapPeak", "PeakBytes", "SavedBytes", "optimizer_state_bytes", "training_state_bytes"]

#: Seconds between two readings of the heap by :class:`HeapPeak`'s thread.
SAMPLE_S = 2e-4


class SavedBytes:
    """Counts bytes of distinct tensors saved for backward (``saved_tensors_hooks``).

    Use ``pack`` as the pack hook: ``torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t)``.
    A saved tensor that shares storage with a parameter (e.g. a weight a matmul keeps for its
    input gradient) allocates nothing: it is counted once, with the parameters, not here.

    Args:
        params: The parameters whose storage is not counted.

    Attributes:
        total: Bytes counted so far (``numel * element_size`` of each distinct storage's first tensor).
    """

    def __init__(self, params: list[torch.Tensor] = ()) -> None:
        self.seen: set[int] = {p.untyped_storage().data_ptr() for p in params}
        self.total = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """Count ``t`` unless its storage was seen; returns ``t`` itself (saved as it is)."""
        try:
            key = t.untyped_storage().data_ptr()
        except Exception:  # tensors without storage (fake/meta)
            key = id(t)
        if key not in self.seen:
            self.seen.add(key)
            self.total += t.numel() * t.element_size()
        return t


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state`` (``numel * element_size``), 0-dim tensors (step
    counters such as Adam's ``step``) left out; 0 before the optimizer's first step."""
    return sum(t.numel() * t.element_size() for st in optimizer.state.values() for t in st.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


def training_state_bytes(params: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the training state no policy changes: parameters, their gradients and the state
    of ``optimizer`` (fp32 master weights, docs/architecture.md#measurements).

    An optimizer's state exists only after its first step, so ``optimizer`` (a fresh one, e.g. the
    model file's ``make_optimizer(params)``) takes one step on zero gradients (``step(closure)``
    with a closure returning a zero loss, so closure-driven optimizers work too) and
    :func:`optimizer_state_bytes` counts its state. The weights are put back bit for bit and the
    gradients dropped afterwards; the optimizer's state is left as the step made it (discard it).
    For fp32 parameters of P bytes: SGD without momentum 2P, SGD with momentum 3P, Adam and AdamW 4P.

    Args:
        params: The trainable parameters ``optimizer`` updates (their bytes: ``numel * element_size``).
        optimizer: A fresh optimizer over ``params``.

    Returns:
        The byte count (int).

    Raises:
        Whatever the optimizer's step raises.
    """
    weights = [p.detach().clone() for p in params]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step(lambda: torch.zeros(()))
        state = optimizer_state_bytes(optimizer)
    finally:
        with torch.no_grad():
            for p, w in zip(params, weights, strict=True):
                p.copy_(w)
                p.grad = None
    return 2 * sum(p.numel() * p.element_size() for p in params) + state


def module_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers (``numel * element_size``, each storage once)."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
    return sum(seen.values())


class CudaPeak:
    """A harness's peak on CUDA: ``torch.cuda.max_memory_allocated`` since :meth:`start` less the
    ``memory_allocated`` at :meth:`start`, plus ``resident``, the bytes of the harness's own model
    (:func:`module_bytes`, allocated before): its parameters and buffers, the gradients, optimizer
    state, activations and temporaries of its steps. What else the process holds at start is left
    out: another harness's model and references (``tune --global-batch`` keeps one harness per
    micro-batch resident while it times them side by side), this harness's FP32 reference gradients
    and its copy of the initial weights, none of which a user's training holds. A measurement's own
    fp32 gradient copies taken during it are counted (one per drift batch at most): an overstatement
    the same for every candidate on the harness.

    Args:
        device: A CUDA device.
        resident: Bytes counted as allocated before :meth:`start` (the model's own).
    """

    def __init__(self, device: torch.device, resident: int) -> None:
        self.device, self.resident, self.base = device, int(resident), 0

    def start(self) -> None:
        """Reset the allocator's peak and remember what is allocated now."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.base = int(torch.cuda.memory_allocated(self.device))

    def read(self) -> int:
        """Peak bytes since :meth:`start` (class docstring), never below ``resident``."""
        torch.cuda.synchronize(self.device)
        return self.resident + max(int(torch.cuda.max_memory_allocated(self.device)) - self.base, 0)


class PeakBytes:
    """Peak bytes allocated over a ``with`` span on this process (module docstring): CUDA's
    allocator peak, or on CPU the most heap bytes in use (:class:`HeapPeak`), over their value
    when the span began. On CPU for eager code only: under the span's dispatch mode a compiled
    graph runs eagerly, and one first called there is never compiled (module docstring).

    Args:
        device: Where the span's tensors live (``cuda``: that device's allocator; else the C heap).

    Attributes:
        peak: Bytes, set when a span ends (0 before; never negative).
    """

    def __init__(self, device: torch.device) -> None:
        self.device, self.peak = device, 0

    def rule(self) -> str:
        """One line naming what :meth:`span` measures on this device (``bench --nproc``'s ``peak_rule``)."""
        if self.device.type == "cuda":
            return "torch.cuda.max_memory_allocated over build + warm-up, minus memory_allocated before"
        return ("C heap bytes in use (glibc mallinfo2, after every ATen op and every 0.2 ms) over build "
                "+ warm-up, minus before")

    @contextlib.contextmanager
    def span(self) -> Iterator[None]:
        """Measure the ``with`` body; ``self.peak`` holds the bytes after it.

        Raises:
            AutoprecError: on CPU without glibc's ``mallinfo2`` (:func:`autoprec.device.heap_bytes`).
        """
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            yield
            torch.cuda.synchronize(self.device)
            self.peak = int(torch.cuda.max_memory_allocated(self.device)) - base
            return
        with HeapPeak() as mode:
            yield
        self.peak = max(mode.peak - mode.base, 0)


class HeapPeak(TorchDispatchMode):
    """A dispatch mode reading :func:`autoprec.device.heap_bytes` after every ATen op (backward's
    included: on the CPU autograd runs them on this thread), and a thread reading it every
    :data:`SAMPLE_S` meanwhile (gloo's threads allocate while this one waits on a collective).

    Attributes:
        base: Heap bytes in use at entry.
        peak: The most heap bytes in use seen so far (≥ ``base``).
    """

    def __enter__(self) -> HeapPeak:
        self.base = self.peak = heap_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.peak = max(self.peak, heap_bytes())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105 - torch's protocol
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, heap_bytes())
        return out
