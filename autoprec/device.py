"""Device facts: which device to run on, waiting for it, what it is, how fast its matmuls are, how
many graphs ``torch.compile`` has compiled, how many bytes the C heap holds.

The one home of these rules for the whole package (docs/architecture.md, "Layers"): the search,
applying a policy, training, the commands and the CLI all ask here. Nothing here knows about policies
or models.
"""

from __future__ import annotations

import ctypes
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import torch

from autoprec._torch_compat import dynamo_unique_graphs
from autoprec.dtypes import NAMES, to_torch
from autoprec.errors import AutoprecError

__all__ = ["autocast_dtype", "compile_count", "heap_bytes", "describe_machine", "device_name",
           "resolve_device", "sync", "time_call", "time_matmul"]


def resolve_device(device: str = "auto") -> torch.device:
    """``"auto"`` -> ``cuda`` when available else ``cpu``; otherwise ``torch.device(device)``.

    Raises:
        ValueError: ``device`` is ``cuda`` but no CUDA device is available, or is unknown.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"unknown device {device!r}; valid: auto, cpu, cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but torch.cuda.is_available() is False")
    return torch.device(device)


def sync(device: torch.device) -> None:
    """Wait for queued device work (CUDA) so wall-clock timings cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def describe_machine(device: torch.device) -> dict[str, Any]:
    """Where the numbers come from: device name, CPU model and bf16/fp16-relevant flags, load.

    Returns:
        ``{"device", "cpu", "cpu_count", "cpu_flags", "loadavg_1m", "gpu"}``; ``cpu_flags`` maps
        ``avx512_bf16``, ``amx_bf16``, ``avx512_fp16``, ``amx_fp16``, ``avx512f`` and ``avx2`` to
        whether ``/proc/cpuinfo`` lists them.
    """
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16", "avx512f", "avx2")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "device": gpu or f"{cpu} ({os.cpu_count()} cores)",
        "cpu": cpu, "cpu_count": os.cpu_count(),
        "cpu_flags": {k: k in flags for k in wanted},
        "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "gpu": gpu,
    }


def time_matmul(dtype: torch.dtype, device: torch.device, n: int, reps: int,
                stop_after_s: float) -> list[float]:
    """Wall-clock seconds of ``n×n @ n×n`` matmuls in ``dtype`` on ``device``.

    One warm-up, then up to ``reps`` timed runs (device-synchronised), stopping early once
    ``stop_after_s`` seconds have passed, so a dtype the device emulates slowly costs little.

    Returns:
        The timed durations (the warm-up's alone if the budget ran out before any).

    Raises:
        RuntimeError: the device has no kernel for ``dtype``.
    """
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return time_call(lambda: a @ b, device, reps, stop_after_s)


def time_call(fn: Callable[[], object], device: torch.device, reps: int, stop_after_s: float) -> list[float]:
    """Wall-clock seconds of ``fn()`` on ``device``: the one timing loop of the device probes.

    One warm-up, then up to ``reps`` timed calls (device-synchronised), stopping early once
    ``stop_after_s`` seconds have passed since the warm-up began.

    Returns:
        The timed durations in seconds (the warm-up's alone if the budget ran out before any).

    Raises:
        Whatever ``fn`` raises (e.g. RuntimeError: the device has no kernel for a dtype).
    """
    times = []
    start = time.perf_counter()
    for _ in range(reps + 1):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > stop_after_s:
            break
    return times[1:] or times


def compile_count() -> int:
    """Graphs ``torch.compile`` (Dynamo) has compiled in this process so far
    (Dynamo's ``unique_graphs`` counter, :func:`autoprec._torch_compat.dynamo_unique_graphs`): a rise
    across a call means the call compiled. Process-wide, so a compile in another thread at the same
    time counts too."""
    return dynamo_unique_graphs()


def device_name(device: torch.device) -> str:
    """Human-readable device description: the GPU's name, or the CPU model and core count."""
    return describe_machine(device)["device"]


def autocast_dtype(device: torch.device, usable: list[str] | None = None) -> torch.dtype:
    """The low dtype of the ``torch.autocast`` baseline on ``device``: torch's own default
    (``torch.get_autocast_dtype``; PyTorch AMP docs: bfloat16 on CPU, float16 on CUDA), unless
    ``usable`` (the low dtype names torch.autocast may run, fastest first: those whose native
    kernel ``tune``'s probe kept) leaves it out and names
    another, which is then used instead.

    The one rule for every torch.autocast baseline autoprec measures: ``bench`` and
    ``train --compare`` run no probe and pass no ``usable``, so they get torch's default; ``tune``
    gets the same unless its probe measured that dtype as not faster than fp32.
    """
    default = torch.get_autocast_dtype(device.type)
    if usable and NAMES.get(default) not in usable:
        return to_torch(usable[0])
    return default


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (malloc.h): every field a ``size_t``, in bytes or counts."""

    _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


_MALLINFO2: list[Any] = []  # the C function, looked up on first use


def heap_bytes() -> int:
    """Bytes the C heap has handed out now, on every thread: glibc's ``mallinfo2()`` ``uordblks``
    (in use in all arenas) + ``hblkhd`` (in chunks of their own, ``mmap``-ed: large tensors).
    Torch's CPU tensors (``c10::alloc_cpu``, ``posix_memalign``) and gloo's buffers come from it;
    Python's small objects do not (pymalloc maps its own arenas).

    Raises:
        AutoprecError: no glibc ``mallinfo2`` (not Linux/glibc ≥ 2.33): names the need.
    """
    if not _MALLINFO2:
        try:
            fn = ctypes.CDLL(None).mallinfo2
        except AttributeError:
            raise AutoprecError("CPU heap peaks are read with glibc's mallinfo2 (glibc >= 2.33, Linux); "
                                "this C library has none") from None
        fn.restype = _MallInfo2
        _MALLINFO2.append(fn)
    info = _MALLINFO2[0]()
    return int(info.uordblks + info.hblkhd)
