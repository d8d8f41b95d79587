"""Parsing the tune budgets: ``--max-drift``, ``--max-memory`` and ``--dtypes``, and the byte
budget ``--max-memory`` means once the baselines are measured (docs/architecture.md#search)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from autoprec.dtypes import FP8_COMPUTE, LOW_DTYPES
from autoprec.errors import SearchError
from autoprec.measure import Measurement

__all__ = ["DEVICE_MARGIN", "check_memory_floor", "default_device_budget", "device_memory_bytes",
           "format_bytes", "memory_budget", "parse_dtypes", "parse_max_drift",
           "over_memory", "parse_max_memory", "why_no_finalist"]

#: Under ``--global-batch`` on CUDA without ``--max-memory``, the budget is the device's memory less
#: this fraction: room for the CUDA context, the caching allocator's fragmentation and the peak's
#: step-to-step variation, which ``torch.cuda.max_memory_allocated`` does not count (PyTorch docs,
#: "CUDA semantics: memory management"). A guess, not measured here; pass ``--max-memory`` to set it.
DEVICE_MARGIN = 0.10

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_max_drift(max_drift: str | float) -> float | None:
    """``--max-drift``: ``"auto"`` -> None (torch.autocast's ``grad_rel_l2``, measured later), or
    a finite number > 0.

    Raises:
        SearchError: anything else.
    """
    if max_drift == "auto":
        return None
    try:
        v = float(max_drift)
    except (TypeError, ValueError):
        raise SearchError(f"--max-drift: expected 'auto' or a positive number, got {max_drift!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise SearchError(f"--max-drift: expected 'auto' or a positive number, got {max_drift!r}")
    return v


def parse_dtypes(dtypes: str | list[str]) -> list[str] | None:
    """``--dtypes``: ``"auto"`` -> None (the probe decides), else the low dtype names given
    (a list, or a comma-separated string); ``fp8_e4m3`` searches fp8 matmuls.

    Raises:
        SearchError: an empty list or a name not in :data:`autoprec.dtypes.LOW_DTYPES` or
            ``fp8_e4m3``.
    """
    if dtypes == "auto":
        return None
    names = [d.strip() for d in (dtypes.split(",") if isinstance(dtypes, str) else dtypes) if d.strip()]
    valid = (*LOW_DTYPES, FP8_COMPUTE)
    bad = [d for d in names if d not in valid]
    if bad or not names:
        raise SearchError(f"--dtypes: {', '.join(bad) or 'empty'} not valid; expected 'auto' or some of "
                          f"{', '.join(valid)}")
    return names


def parse_max_memory(max_memory: str | float | None) -> tuple[str, float] | None:
    """Parse ``--max-memory``: ``None``/``"none"`` -> None; ``"auto"`` -> ``("autocast", 1.0)``;
    ``"0.8x"`` -> ``("fp32", 0.8)``; ``"90%"`` -> ``("device", 0.9)`` (a fraction of the device's
    memory, :func:`device_memory_bytes`); ``"300MiB"``, ``"2GiB"``, ``"5e8"`` or a number ->
    ``("bytes", n)``.

    Raises:
        SearchError: a value of one of these forms that is zero or negative (``"must be positive
            (> 0)"``, naming it), a share above 100%, a fraction of a byte (``"1.5"``: says to write
            ``1.5x`` or ``1.5GiB``), or anything else (the message lists the accepted forms).
    """
    if max_memory is None or max_memory == "none":
        return None
    if max_memory == "auto":
        return ("autocast", 1.0)
    text = str(max_memory).strip().lower().replace(" ", "")
    m = re.fullmatch(r"(-?[0-9]*\.?[0-9]+)%|(-?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)(x|[kmg]i?b|b)?", text)
    if m is not None and float(m.group(1) or m.group(2)) <= 0:
        raise SearchError(f"--max-memory: must be positive (> 0), got {max_memory!r}")
    if m is not None and m.group(1) is not None:
        if float(m.group(1)) > 100:
            raise SearchError(f"--max-memory: a share of the device's memory is above 0% and at most 100%; "
                              f"got {max_memory!r}")
        return ("device", float(m.group(1)) / 100)
    if m is not None:
        value, unit = float(m.group(2)), m.group(3) or ""
        scaled = value if unit == "x" else value * _UNITS[unit]
        if unit in ("", "b") and not value.is_integer():  # "1.5": meant 1.5x or 1.5GiB, not 2 bytes
            meant = (f"for a multiple of FP32's peak write e.g. '{value:g}x', for a share of the device's "
                     f"memory '90%', for gibibytes '{value:g}GiB'" if value < 1024 else
                     f"write whole bytes ('{round(value)}')")
            raise SearchError(f"--max-memory: {max_memory!r} is {value:g} bytes (a number without a unit is "
                              f"bytes, and bytes are whole): {meant}")
        if math.isfinite(scaled) and scaled < 2.0**62:
            return ("fp32", value) if unit == "x" else ("bytes", scaled)
    raise SearchError("--max-memory: expected 'auto', 'none', a multiple of FP32's peak like '0.8x', a "
                      "share of the device's memory like '90%', or bytes like '300MiB', '2GiB' or '5e8'; "
                      f"got {max_memory!r}")


def device_memory_bytes(device: Any) -> int:
    """The device's memory, bytes: CUDA's ``total_memory`` (``torch.cuda.get_device_properties``),
    else the machine's physical memory (``os.sysconf``: pages x page size)."""
    import os

    import torch

    if getattr(device, "type", str(device)) == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def default_device_budget(device: Any) -> tuple[str, float] | None:
    """``--global-batch``'s memory budget when ``--max-memory`` is not given: on CUDA the device's
    memory less :data:`DEVICE_MARGIN` (``("device", 0.9)``); elsewhere None (the CPU's budget
    stays explicit: the machine's RAM is shared with everything else it runs)."""
    return ("device", 1.0 - DEVICE_MARGIN) if getattr(device, "type", str(device)) == "cuda" else None


def format_bytes(n: float) -> str:
    """``n`` bytes for messages: MiB when large, else the exact count."""
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n:.0f} bytes"


def check_memory_floor(arg: tuple[str, float] | None, model: Any, make_optimizer: Callable[[list], Any],
                       option: str = "--max-memory") -> None:
    """Refuse, right after the model is built and before any capture or measurement, a byte budget
    no policy can meet: one not above the fp32 parameters, their gradients and the optimizer's state
    (:func:`autoprec.measure.memory.training_state_bytes` with a fresh ``make_optimizer(params)``:
    16 bytes per fp32 parameter for Adam and AdamW), which every policy keeps (master weights).

    Args:
        arg: :func:`parse_max_memory`'s result; only ``("bytes", n)`` is checked (a multiple of a
            baseline's peak needs that baseline measured: :func:`memory_budget` checks it then).
        model: The built model (its trainable parameters are counted; weights are left unchanged).
        make_optimizer: The model file's ``make_optimizer``.
        option: The option named in the message.

    Raises:
        SearchError: the budget is at or below that floor; the message names the budget, the
            parameter count and the minimum bytes.
    """
    if arg is None or arg[0] != "bytes":
        return
    from autoprec.measure.memory import training_state_bytes

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params)
    floor = training_state_bytes(params, optimizer)
    if arg[1] <= floor:
        count = sum(p.numel() for p in params)
        exact = "" if format_bytes(floor) == f"{floor} bytes" else f" ({floor:,} bytes)"
        raise SearchError(f"{option}: the budget ({format_bytes(arg[1])}) is not above the fp32 parameters, "
                          f"gradients and {type(optimizer).__name__} state of this model alone: {count:,} "
                          f"parameters need at least {format_bytes(floor)}{exact} whatever the "
                          "policy (master weights, docs/architecture.md#runtime); raise the budget")


def memory_budget(arg: tuple[str, float] | None, fp32: Measurement, autocast: Measurement,
                  state_bytes: int, optimizer: str = "optimizer", device: Any = "cpu") -> float | None:
    """Bytes allowed by the parsed ``--max-memory`` given this run's baselines.

    Args:
        arg: :func:`parse_max_memory`'s result.
        fp32, autocast: The FP32 and torch.autocast baselines (their ``peak_bytes``).
        device: The device whose memory a ``("device", f)`` budget is a share of.
        state_bytes: Bytes of the fp32 parameters, their gradients and the optimizer's state
            (``Harness.state_bytes``), which every policy keeps (master weights,
            docs/architecture.md#runtime).
        optimizer: The optimizer's class name, for the message (e.g. ``"AdamW"``, ``"SGD"``).

    Raises:
        SearchError: the reference peak was not measured, or the budget is not above
            ``state_bytes``, which no policy can go below.
    """
    if arg is None:
        return None
    kind, value = arg
    if kind == "bytes":
        budget = value
    elif kind == "device":
        budget = value * device_memory_bytes(device)
    else:
        ref = autocast if kind == "autocast" else fp32
        if ref.error is not None or ref.peak_bytes <= 0:
            name = "torch.autocast" if kind == "autocast" else "FP32"
            raise SearchError(f"--max-memory: {name}'s peak memory could not be measured ({ref.error}); "
                              "pass a number of bytes instead")
        budget = value * ref.peak_bytes
    if budget <= state_bytes:
        raise SearchError(f"--max-memory: the budget ({format_bytes(budget)}) is not above the fp32 "
                          f"parameters, gradients and {optimizer} state alone ({format_bytes(state_bytes)}), "
                          "which every policy keeps (master weights, docs/architecture.md#runtime)")
    return budget


def over_memory(random: bool) -> str:
    """What a compiled finalist tried before its peak was judged over the memory budget, the tail of
    the line that says so: full recomputation, except on a graph that draws random numbers, which is
    never recomputed (:data:`autoprec.applied.compile.RECOMPUTE_REDRAWS` says why)."""
    if random:
        return (" with saved activations; recomputation is not used on a graph that draws random numbers "
                "(torch would recompute dropout with other masks: pytorch/pytorch#190758)")
    return " even with full recomputation"


def why_no_finalist(measured: list[Measurement], budget: Any, memory_budget: float | None,
                    compile: bool, random: bool = False) -> str:
    """Why no finalist is left for the head-to-head (the :class:`SearchError` message): the memory
    budget, with the smallest peak of those within the drift budget; the drift budget, when every
    finalist ran and none was within it (a ``--max-drift`` below what even all-fp32 measures, e.g.
    compiled, whose fp32 kernels sum in another order than eager's: ~3e-7 on qwen2_tiny), with the
    smallest ``grad_rel_l2``; or every one failing.

    Args:
        measured: The finalists' measurements (compiled unless ``compile`` is False).
        budget: The :class:`autoprec.search.drift_budget.DriftBudget`.
        memory_budget: Bytes, or None without ``--max-memory``.
        compile: Whether the finalists were compiled.
        random: Whether the graph draws random numbers (:func:`over_memory`)."""
    ran = [m for m in measured if m.error is None]
    peaks = [m.peak_bytes for m in ran if budget.feasible(m)]
    if memory_budget is not None and peaks:
        return (f"no feasible finalist fits the memory budget ({format_bytes(memory_budget)}; "
                f"the smallest peak was {format_bytes(min(peaks))}"
                + (f"{over_memory(random)})" if compile else
                   "); without --no-compile, recomputation in backward can lower the peak"))
    if ran and not peaks:
        least = min(m.grad_rel_l2 for m in ran)
        return (f"no finalist is within the drift budget when re-measured{' compiled' if compile else ''} "
                f"({budget.describe()}), all-fp32 included: the smallest grad_rel_l2 was {least:.3g}; "
                "a budget below it rejects every policy (--max-drift auto: torch.autocast's own)")
    return "every finalist failed when re-measured, all-fp32 included (see the log)"
