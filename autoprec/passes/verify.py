"""Pass 4 (the last): verify a lowered graph.

Re-derives every node's output dtype by running the graph on data-free tensors (shapes and dtypes
only, no compute), refreshing ``node.meta["val"]``: on the ``meta`` device (:class:`MetaProp`)
when every shape is static, which costs about a fifth of
``torch.fx.passes.fake_tensor_prop.FakeTensorProp``'s time (fake tensors add their bookkeeping to
the same meta kernels); on fake tensors where meta propagation fails (an op without a meta
kernel) and always for symbolic shapes. A graph captured with dynamic dimensions
(``capture(..., dynamic=True)``) is propagated in its own ``FakeTensorMode`` (the export's, found
by ``autoprec._torch_compat.detect_fake_mode`` on the placeholders' fake values), so symbolic sizes
stay symbolic (``s0``, ``s1``) and nothing specialises them. The post-condition compares each
dtype with the assigned one and checks that graph outputs keep the dtype they had when captured,
that no integer/bool tensor was cast, and that a node computing in another dtype than it stores is
read only through its store cast.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx
from torch.fx.node import map_aggregate
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from autoprec._torch_compat import detect_fake_mode, new_fake_mode, overload_schema
from autoprec.dtypes import NAMES
from autoprec.nodemeta import read_meta
from autoprec.passes.attention import SDPA
from autoprec.passes.base import PassBase, PassResult, pass_error
from autoprec.passes.casts import is_inserted_cast

__all__ = ["MetaProp", "Verify", "output_dtypes"]

PASS = "verify"


def _fake_inputs(gm: fx.GraphModule) -> tuple[Any, list]:
    """The fake mode to propagate ``gm`` in and its inputs (fake tensors of that mode, or other values).

    With symbolic placeholder shapes: the export's own mode and fake values (its ``ShapeEnv`` holds
    the symbols and their ranges). Otherwise a fresh mode and fake copies of the recorded shapes.
    Either mode accepts real tensors (the graph's parameters). The fake copies keep the recorded
    device (a graph captured on CUDA has CUDA inputs beside its CUDA parameters).

    Raises:
        RuntimeError: the shapes are symbolic but the placeholders carry no fake mode.
    """
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    if _symbolic(gm):
        mode = detect_fake_mode(vals)
        if mode is None:
            raise RuntimeError("placeholders have symbolic shapes but carry no FakeTensorMode")
        mode.allow_non_fake_inputs = True  # export's mode already does; parameters are real tensors
        return mode, vals
    mode = new_fake_mode(allow_non_fake_inputs=True)
    with mode:  # factories in the mode make fake tensors: nothing allocated on the device
        return mode, [torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=v.device)
                      if isinstance(v, torch.Tensor) else v for v in vals]


def _symbolic(gm: fx.GraphModule) -> bool:
    """Whether a placeholder's recorded shape has a symbolic size (a dynamic capture)."""
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    return any(isinstance(v, torch.Tensor) and not all(isinstance(d, int) for d in v.shape) for v in vals)


def _meta(v: Any) -> Any:
    """``v`` as a data-free ``meta`` tensor of the same shape, stride and dtype (other values as-is)."""
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device="meta")
    if isinstance(v, torch.device):
        return torch.device("meta")
    return v


class MetaProp(fx.Interpreter):
    """Shape/dtype propagation of a static-shape graph on the ``meta`` device.

    Placeholders read their recorded ``meta["val"]`` (left as they are), ``get_attr`` tensors
    and every ``torch.device`` argument become ``meta`` ones, and each other node's result (the
    output node's too) is stored as its ``meta["val"]``: tensors on ``meta`` with the shapes and
    dtypes :class:`~torch.fx.passes.fake_tensor_prop.FakeTensorProp` gives (tests/passes/test_verify_meta.py
    compares the two node by node). ``scaled_dot_product_attention`` picks its kernel by device and
    on ``meta`` runs the math one, whose output is contiguous; its node keeps the layout recorded
    at capture (the device kernel's), so a reader that relies on it (a ``view``) propagates.

    An ATen op called again with arguments of the same metadata (shapes, strides, storage offsets
    and sizes, dtypes; equal other values) gives the result of its first call (:attr:`hits`
    counts them): a meta kernel's output depends on nothing else, and the layers of a transformer
    repeat every call (a 24-layer Qwen2's lowered graph: 1851 of its 2232 calls reused, 0.18 s ->
    0.04 s). Off for a graph with an op that mutates its arguments (``schema.is_mutable``: a
    metadata-changing ``transpose_`` on a shared result would change the others).

    Raises:
        Exception: whatever an op raises on ``meta`` (no meta kernel, a data-dependent size).
    """

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        schemas = [overload_schema(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        mutating = any(s is not None and s.is_mutable for s in schemas)
        self._memo: dict[tuple, Any] | None = None if mutating else {}
        self.hits = 0

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "placeholder":
            return _meta(n.meta.get("val"))
        result = super().run_node(n)
        recorded = n.meta.get("val")
        if n.target is SDPA and isinstance(recorded, torch.Tensor) and isinstance(result, torch.Tensor) \
                and recorded.shape == result.shape:
            # on meta this composite op runs its math decomposition: keep the device kernel's layout
            result = torch.empty_strided(result.shape, recorded.stride(), dtype=result.dtype, device="meta")
        val = map_aggregate(result, lambda x: x if isinstance(x, (torch.Tensor, int, float, bool)) else None)
        if val is not None:
            n.meta["val"] = val
        return result

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        return _meta(super().get_attr(target, args, kwargs))

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        args, kwargs = map_aggregate((args, kwargs), lambda x: _meta(x) if isinstance(x, torch.device) else x)
        memo = self._memo is not None and (target is operator.getitem or overload_schema(target) is not None)
        key = _signature(target, args, kwargs) if memo else None
        if key is not None and key in self._memo:
            self.hits += 1
            return self._memo[key]
        result = super().call_function(target, args, kwargs)
        if key is not None:
            self._memo[key] = result
        return result


def _signature(target: Any, args: Any, kwargs: Any) -> tuple | None:
    """A call's key for :class:`MetaProp`'s memo: the target, each tensor argument's metadata and
    every other argument's value, and the grad mode; None when an argument is neither (an object
    compared by identity could be mutated between two calls)."""
    try:
        return (target, _arg_key(args), _arg_key(kwargs), torch.is_grad_enabled())
    except _Unkeyed:
        return None


class _Unkeyed(Exception):
    """An argument :func:`_arg_key` cannot key by value."""


def _arg_key(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return ("t", tuple(a.shape), a.stride(), a.storage_offset(), a.untyped_storage().nbytes(), a.dtype,
                a.device, a.requires_grad)
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, *(_arg_key(x) for x in a))
    if isinstance(a, dict):
        return ("d", *((k, _arg_key(v)) for k, v in a.items()))
    if a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                   torch.memory_format)):
        return (type(a).__name__, a)
    raise _Unkeyed


def _outputs(gm: fx.GraphModule) -> list:
    """The graph outputs (the output node's top-level list/tuple, or its single value)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]


def _dtype(a: object) -> torch.dtype | None:
    return getattr(a.meta.get("val"), "dtype", None) if isinstance(a, fx.Node) else None


def output_dtypes(gm: fx.GraphModule) -> list[torch.dtype | None]:
    """Dtypes of ``gm``'s graph outputs, from ``meta["val"]``; ``None`` for non-tensor outputs."""
    return [_dtype(a) for a in _outputs(gm)]


class Verify(PassBase):
    """Pass 4 (last): re-derive every dtype; its post-condition is that they match the assigned ones.

    ``call`` refreshes ``node.meta["val"]`` by fake-tensor propagation (in place: meta only);
    ``ensures`` compares. ``graph.lint()`` is the runner's (:class:`~autoprec.passes.manager.PassManager`).

    Args:
        original_output_dtypes: Dtypes of the graph outputs at capture (flattened,
            :func:`output_dtypes` of the captured graph), or ``None`` to skip that check.
    """

    name = PASS

    def __init__(self, original_output_dtypes: list[torch.dtype | None] | None = None) -> None:
        self.original_output_dtypes = original_output_dtypes

    def call(self, gm: fx.GraphModule) -> PassResult:
        """Refresh ``meta["val"]`` of every node of ``gm`` (in place): by :class:`MetaProp` when the
        shapes are static, else (or where it fails) from fake tensors.

        Returns:
            ``PassResult(gm, modified=False)``.

        Raises:
            PassError: shape/dtype propagation failed.
        """
        # torch's wrap_with_set_grad_enabled (a no_grad region) does not restore the grad mode when
        # its body raises, as it does on the meta device: restore it here, whatever happens inside.
        with torch.set_grad_enabled(torch.is_grad_enabled()):
            if not _symbolic(gm):
                try:
                    MetaProp(gm).run(*[None for n in gm.graph.nodes if n.op == "placeholder"])
                    return PassResult(gm, False)
                except Exception:  # no meta kernel, data-dependent sizes: fake tensors handle these
                    pass
            kept = [(b, b.clone()) for b in gm.buffers()]
            try:
                mode, inputs = _fake_inputs(gm)
                FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
            except Exception as e:
                raise pass_error(PASS, None,
                                 f"shape/dtype propagation failed: {type(e).__name__}: {e}") from e
            finally:  # the fake mode runs in-place ops on real 0-d buffers (BatchNorm's batch counter)
                for buffer, value in kept:
                    buffer.copy_(value)
        return PassResult(gm, False)

    def ensures(self, gm: fx.GraphModule) -> None:
        """Check ``gm``'s refreshed dtypes against the assigned ones along every node.

        Raises:
            PassError: a node's actual dtype differs from its assigned one; an integer/bool
                tensor was cast; an output changed dtype. The message names the node.
        """
        for node in gm.graph.nodes:
            meta = read_meta(node)
            if is_inserted_cast(node):
                src = node.args[0]
                if not getattr(src.meta.get("val"), "dtype", torch.float32).is_floating_point:
                    raise pass_error(PASS, node, "an integer/bool tensor was cast")
            want = meta.dtype
            val = node.meta.get("val")
            if node.op == "call_function" and want not in (None, "auto") and isinstance(val, torch.Tensor):
                got = NAMES.get(val.dtype, str(val.dtype))
                if got != want:
                    raise pass_error(PASS, node, f"assigned {want} but computes {got}")
            storage = meta.storage
            if storage is not None and any(not is_inserted_cast(u) or NAMES.get(getattr(u.meta.get("val"),
                                                                                        "dtype", None))
                                           not in (storage, None) for u in node.users):
                raise pass_error(PASS, node, f"computes in {want} but a consumer does not read its "
                                             f"{storage} store")
        if self.original_output_dtypes is None:
            return
        for i, (a, want) in enumerate(zip(_outputs(gm), self.original_output_dtypes)):
            got = _dtype(a)
            if want is not None and got is not None and got != want:
                raise pass_error(PASS, a, f"graph output {i} changed dtype {want} -> {got}")
