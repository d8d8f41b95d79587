"""torch.autocast's low-precision GEMMs computed as fp32 products, for measuring its numerics where
the device's native bf16/fp16 GEMMs are slow (docs/architecture.md#measurements).

On a CPU without native bf16 (AVX2 only) a bf16 ``aten.mm`` runs ~60-90x slower than fp32 (the
kernel probe measures it: :mod:`autoprec.search.probe`), so the K drift passes of torch.autocast's
baseline cost minutes on a deep model. Its *numerics* do not depend on that kernel: a native
bf16/fp16 GEMM multiplies low-precision operands, accumulates in fp32 and rounds the result once to
the low dtype (oneDNN and cuBLAS defaults; the probe's "fp32-compute" kernel computes the same).
:class:`Fp32ComputeGemms` runs each such GEMM as exactly that: the operands (exact in fp32) upcast,
an fp32 product, the result rounded once to the operands' dtype. Only the summation order differs
from a native kernel: torch.autocast's grad_rel_l2 on ``examples/qwen2_tiny.py`` measured 7.30e-3
under it against 7.31e-3 native (``benchmarks/results/avx2_autocast_2026-12-05``), and
``tests/kernels/test_fp32_gemms.py`` holds an MLP's within 2%. Speed is never measured under it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["GEMMS", "Fp32ComputeGemms"]

_aten = torch.ops.aten
#: The GEMM overloads autocast's matmuls reach below autograd (``linear`` and ``matmul`` are
#: composite: they decompose into these before a dispatch mode sees them), forward and backward.
GEMMS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default})


class Fp32ComputeGemms(TorchDispatchMode):
    """Dispatch mode: every GEMM in :data:`GEMMS` whose floating tensor arguments are all ``dtype``
    runs as an fp32 product of the same values with its result rounded once to ``dtype`` (bias,
    ``alpha``/``beta`` included, as a native kernel applies them before rounding); every other op,
    and a GEMM of other dtypes, runs as dispatched.

    Use it around eager forward/backward passes (``with Fp32ComputeGemms(torch.bfloat16): ...``);
    Dynamo does not compile under a dispatch mode, so a compiled function runs eagerly inside it.

    Args:
        dtype: The low dtype whose GEMMs are computed in fp32 (``torch.bfloat16`` or
            ``torch.float16``).

    Attributes:
        count: GEMMs computed in fp32 so far.

    Raises:
        ValueError: ``dtype`` is not a 16-bit floating dtype.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"Fp32ComputeGemms emulates bf16/fp16 GEMMs, not {dtype}")
        super().__init__()
        self.dtype = dtype
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in GEMMS:
            floats = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
            if floats and all(a.dtype == self.dtype for a in floats):
                self.count += 1
                up = tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                           for a in args)
                return func(*up, **kwargs).to(self.dtype)
        return func(*args, **kwargs)
