"""Pass 3: verify a lowered graph.

Checks ``graph.lint()``; re-derives every node's output dtype by running the graph on fake
tensors (``torch.fx.passes.fake_tensor_prop.FakeTensorProp``: shapes and dtypes only, no
compute) and compares it with the assigned dtype; checks that graph outputs keep the dtype they
had when captured and that no integer/bool tensor was cast. ``node.meta["val"]`` is refreshed.
"""

from __future__ import annotations

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from autoprec.dtypes import NAMES
from autoprec.passes.base import PassResult, pass_error
from autoprec.passes.casts import is_inserted_cast

PASS = "verify"


def _fake_inputs(gm: fx.GraphModule, mode: FakeTensorMode) -> list:
    out = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            out.append(mode.from_tensor(torch.empty(v.shape, dtype=v.dtype)))
        else:
            out.append(v)
    return out


def verify(gm: fx.GraphModule, original_output_dtypes: list[torch.dtype | None] | None = None) -> PassResult:
    """Check that ``gm``'s dtypes are consistent along every edge; refresh ``meta["val"]``.

    Args:
        gm: Output of :func:`autoprec.passes.casts.insert_casts`; modified in place (meta only).
        original_output_dtypes: Dtypes of the graph outputs at capture (flattened), if known.

    Returns:
        ``PassResult(gm, modified=False)``.

    Raises:
        PassError: lint failed; a node's actual dtype differs from its assigned one; an
            integer/bool tensor was cast; an output changed dtype. The message names the node.
    """
    try:
        gm.graph.lint()
    except Exception as e:
        raise pass_error(PASS, None, f"graph.lint() failed: {e}") from e
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        FakeTensorProp(gm, mode).propagate(*_fake_inputs(gm, mode))
    except Exception as e:
        raise pass_error(PASS, None, f"shape/dtype propagation failed: {type(e).__name__}: {e}") from e
    for node in gm.graph.nodes:
        meta = node.meta.get("autoprec", {})
        if is_inserted_cast(node):
            src = node.args[0]
            if not getattr(src.meta.get("val"), "dtype", torch.float32).is_floating_point:
                raise pass_error(PASS, node, "an integer/bool tensor was cast")
        want = meta.get("dtype")
        val = node.meta.get("val")
        if node.op == "call_function" and want not in (None, "auto") and isinstance(val, torch.Tensor):
            got = NAMES.get(val.dtype, str(val.dtype))
            if got != want:
                raise pass_error(PASS, node, f"assigned {want} but computes {got}")
    if original_output_dtypes is not None:
        out = next(n for n in gm.graph.nodes if n.op == "output")
        flat = fx.node.map_aggregate(out.args[0], lambda a: a)
        flat = flat if isinstance(flat, (list, tuple)) else [flat]
        for i, (a, want) in enumerate(zip(flat, original_output_dtypes)):
            got = getattr(a.meta.get("val"), "dtype", None) if isinstance(a, fx.Node) else None
            if want is not None and got is not None and got != want:
                raise pass_error(PASS, a, f"graph output {i} changed dtype {want} -> {got}")
    return PassResult(gm, False)
