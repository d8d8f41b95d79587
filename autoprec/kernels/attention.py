"""``autoprec::sdpa_math``: scaled dot-product attention as two explicit GEMMs and an fp32 softmax.

``torch.nn.functional.scaled_dot_product_attention`` dispatches to a fused kernel (flash attention
on CPU and GPU). In low precision the fused CPU kernel can be slower than the same attention written
as matmuls, because native bf16 GEMMs (AVX512-BF16, AMX) are several times faster than fp32 ones
while the fused kernel's inner loops are not (measured: ``benchmarks/results/attention_math_*``).
Whether it pays is measured per device by the search, never assumed: the policy field
``attention`` (``"fused"`` or ``"math"``, docs/architecture.md#policy-file) selects it, and the
pass :mod:`autoprec.passes.attention` retargets the graph's SDPA nodes to this op.

The numerics follow PyTorch's reference implementation in the ``scaled_dot_product_attention``
docs, with the precision split of the fused kernels and of ``torch.autocast`` over eager
attention: both GEMMs run in the inputs' dtype (fp32 accumulation inside the kernel), the scores
are scaled, masked and soft-maxed in fp32 (float64 stays float64), and the probabilities are rounded to
``value``'s dtype for the second GEMM. A row whose every position is masked gives zeros, as PyTorch's math
backend (``_safe_softmax``) does, not NaN.

The op is registered ``CompositeImplicitAutograd``: eager runs, ``torch.export``, AOTAutograd and
Inductor see its ATen ops (matmul, softmax, ...), which Inductor fuses and differentiates as usual.
"""

from __future__ import annotations

import torch

from autoprec._torch_compat import safe_softmax

__all__ = ["sdpa_math", "SCHEMA"]

#: The op's schema: the arguments of ``aten.scaled_dot_product_attention`` (same order, same
#: defaults), so a pass can swap one target for the other without touching the arguments.
SCHEMA = ("sdpa_math(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, float dropout_p=0.0, "
          "bool is_causal=False, *, float? scale=None, bool enable_gqa=False) -> Tensor")


def sdpa_math(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Attention ``softmax(query @ key^T * scale + mask) @ value`` as two GEMMs, softmax in fp32.

    Args:
        query: ``[..., H_q, L, E]``, any float dtype (the first GEMM runs in it).
        key: ``[..., H_kv, S, E]``, same dtype as ``query``.
        value: ``[..., H_kv, S, E_v]``; the second GEMM runs in its dtype.
        attn_mask: None, a bool mask (True = attend) or a float mask added to the scores,
            broadcastable to ``[..., H_q, L, S]``.
        dropout_p: Dropout probability on the attention weights (applied as
            ``torch.nn.functional.dropout`` in training, as the math backend does).
        is_causal: Top-left causal mask (position ``i`` attends ``j <= i``), as SDPA's.
        scale: Score scale; None is ``1 / sqrt(E)``.
        enable_gqa: Grouped-query attention: ``key``/``value`` heads repeated ``H_q // H_kv``
            times along dim -3.

    Returns:
        ``[..., H_q, L, E_v]`` in ``value``'s dtype.

    Raises:
        RuntimeError: ``is_causal`` together with ``attn_mask`` (as SDPA refuses), or shapes that
            do not broadcast (from the matmul).

    Source: PyTorch docs, ``torch.nn.functional.scaled_dot_product_attention`` (reference
    implementation and argument semantics).
    """
    if is_causal and attn_mask is not None:
        raise RuntimeError("sdpa_math: is_causal and attn_mask cannot both be set (as "
                           "scaled_dot_product_attention)")
    if enable_gqa and key.size(-3) != query.size(-3):
        groups = query.size(-3) // key.size(-3)
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
    factor = scale if scale is not None else query.size(-1) ** -0.5
    scores = torch.matmul(query, key.transpose(-2, -1))
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * factor
    if is_causal:
        length, source = query.size(-2), key.size(-2)
        keep = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(keep.logical_not(), float("-inf"))
    elif attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(attn_mask.logical_not(), float("-inf"))
        else:
            scores = scores + attn_mask.to(scores.dtype)
    weights = safe_softmax(scores, -1)
    if dropout_p > 0.0:
        weights = torch.nn.functional.dropout(weights, p=dropout_p, training=True)
    return torch.matmul(weights.to(value.dtype), value)


_lib = torch.library.Library("autoprec", "FRAGMENT")
_lib.define(SCHEMA)
_lib.impl("sdpa_math", sdpa_math, "CompositeImplicitAutograd")
