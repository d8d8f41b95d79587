"""Repeated blocks compiled once: regional compilation of a lowered graph
(docs/architecture.md#regional-compilation).

A transformer's layers are the same code with the same shapes; under one policy they lower to
the same nodes up to names. Compiled as one flat graph, Dynamo, AOTAutograd and Inductor trace,
partition and generate code for every layer again, so compile time grows with depth (a 24-layer
Qwen2 of hidden 256: 96 s for the first step against 32 s for 2 layers, 2 cores).

:func:`outline_blocks` cuts the lowered graph into one submodule per block (the nodes of module
``<container>.<i>``, e.g. ``model.layers.3``, with the casts inserted for them) with PyTorch's
own :func:`torch.fx.passes.utils.fuser_utils.fuse_by_partitions`, keys each block by its
structure (ops, arguments, shapes, dtypes and strides, the saved-activation tags), and makes the
blocks of one key call one shared :class:`BlockRegion`, whose body is marked with
:func:`torch.compiler.nested_compile_region`. ``torch.compile`` then traces it once into an
``invoke_subgraph`` higher-order op and stamps the compiled region out for every other block
("hierarchical compilation", PyTorch docs of ``torch.compiler.nested_compile_region``). Blocks
with different per-layer policies get one region per distinct structure. A block whose structure
no other block shares stays inline (nothing to reuse; it keeps its fusions with its neighbours).

One per-block cost is left in torch 2.13's ``invoke_subgraph``: under autograd, every call
re-traces the body to build its schema (``HigherOrderOperator.py_autograd_impl`` asks
``gen_schema`` whether the body mutates an input), two calls per block (a 24-layer Qwen2 of
hidden 256, fp32 policy: 3.5 s of a 27.0 s compile, 2 cores). Each region
therefore installs :func:`autoprec._torch_compat.reuse_invoke_subgraph_schemas`, which keeps that
schema in the compile's own ``InvokeSubgraphCache``, under the key torch already uses for the
functionalization schema of the same call (pytorch/pytorch#184646).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions, validate_partition

from autoprec._torch_compat import reuse_invoke_subgraph_schemas
from autoprec.nodekeys import block_of
from autoprec.nodemeta import read_meta

__all__ = ["BlockRegion", "RegionPlan", "outline_blocks"]

_log = logging.getLogger("autoprec")

#: ``fuse_by_partitions`` names its submodules with this prefix (they are removed again).
_FUSED = "autoprec_block_"


@dataclass
class RegionPlan:
    """What :func:`outline_blocks` did with one graph.

    Attributes:
        blocks: Blocks outlined into a shared region (0 when none was).
        regions: Distinct regions (each compiled once per input shape and dtype).
        containers: The block containers found (``["model.layers"]``).
        inline: Blocks left inline: their structure is unique, or their nodes do not form a
            contiguous piece of the graph (a cycle through outside nodes).
        region_of: Each outlined block's module path -> the name of the region it calls
            (``{"model.layers.1": "autoprec_region_0", ...}``).
    """

    blocks: int = 0
    regions: int = 0
    containers: tuple[str, ...] = ()
    inline: int = 0
    region_of: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """One line for the compile log, e.g. ``23 of 24 blocks of model.layers in 1 region``."""
        if not self.blocks:
            return "no repeated blocks (one flat graph)"
        where = ", ".join(self.containers)
        return (f"{self.blocks} of {self.blocks + self.inline} blocks of {where} in {self.regions} "
                f"region{'s' if self.regions != 1 else ''}")


class BlockRegion(nn.Module):
    """One compiled region shared by every block of one structure.

    Calling it calls ``body`` (a block's outlined ``fx.GraphModule``: inputs are the block's
    Parameters, their casts' sources and the activations it reads; outputs the values read after
    it) through :func:`torch.compiler.nested_compile_region`, so under ``torch.compile`` the body
    is traced and compiled once and reused by every call with the same input metadata; eagerly
    it is a plain call.

    Args:
        body: The outlined block.
    """

    def __init__(self, body: fx.GraphModule) -> None:
        super().__init__()
        self.body = body

        def region(*args: Any) -> Any:
            return body(*args)

        self._region = torch.compiler.nested_compile_region(region)
        reuse_invoke_subgraph_schemas()

    def forward(self, *args: Any) -> Any:
        """The body's outputs for ``args`` (tensors of the block's input shapes and dtypes)."""
        return self._region(*args)


def outline_blocks(gm: fx.GraphModule) -> tuple[fx.GraphModule, RegionPlan]:
    """A copy of ``gm`` whose repeated blocks call shared :class:`BlockRegion` modules.

    Args:
        gm: A lowered graph (``autoprec.passes.run_pipeline``'s, after the output flattening of
            :func:`autoprec.applied.outputs.flat_output_graph`); its nodes carry
            a ``NodeMeta.module`` (:mod:`autoprec.nodemeta`). It is not modified.

    Returns:
        ``(graph, plan)``: a new ``GraphModule`` computing the same values on the same Parameters
        (``get_attr`` targets are shared, not copied), and what was outlined. When no two blocks
        share a structure, ``graph`` is ``gm`` itself and ``plan.blocks`` is 0.
    """
    parts = _block_partitions(gm)
    plan = RegionPlan(containers=tuple(sorted({c for c, _ in parts})))
    keyed: dict[tuple[Any, ...], list[tuple[str, int]]] = {}
    for block, nodes in parts.items():
        if validate_partition(list(nodes)):
            keyed.setdefault(_structure_key(gm, nodes), []).append(block)
        else:
            plan.inline += 1
    shared = {key: blocks for key, blocks in keyed.items() if len(blocks) > 1}
    plan.inline += sum(len(b) for key, b in keyed.items() if key not in shared)
    if not shared:
        return gm, RegionPlan(containers=plan.containers, inline=len(parts))
    out = fx.GraphModule(gm, copy.deepcopy(gm.graph))  # the same Parameters; gm's graph untouched
    twin = dict(zip(gm.graph.nodes, out.graph.nodes))
    order = [(key, block) for key, blocks in shared.items() for block in blocks]
    fuse_by_partitions(out, [{twin[n]: None for n in parts[block]} for _, block in order], prefix=_FUSED)
    regions: dict[tuple[Any, ...], str] = {}
    for i, (key, (container, index)) in enumerate(order):
        name = regions.setdefault(key, f"autoprec_region_{len(regions)}")
        plan.region_of[f"{container}.{index}"] = name
        if not hasattr(out, name):
            out.add_module(name, BlockRegion(getattr(out, f"{_FUSED}{i}")))
    targets = {f"{_FUSED}{i}": regions[key] for i, (key, _b) in enumerate(order)}
    for node in out.graph.nodes:
        if node.op == "call_module" and node.target in targets:
            node.target = targets[node.target]
    for name in targets:
        delattr(out, name)
    out.recompile()
    plan.blocks, plan.regions = len(order), len(regions)
    return out, plan


def _block_of(node: fx.Node) -> tuple[str, int] | None:
    """``(container, index)`` of ``node``'s module path (:func:`autoprec.nodekeys.block_of`)."""
    return block_of(read_meta(node).module or "")


def _block_partitions(gm: fx.GraphModule) -> dict[tuple[str, int], dict[fx.Node, None]]:
    """The ``call_function`` nodes of each block of every container with at least two blocks.

    Nodes the passes inserted (casts, with no module path) join the block that reads them when
    every reader is in one block: a Parameter's cast to bf16 goes with the layer that owns the
    Parameter; the rotary table's cast, read by every layer, stays outside.
    """
    owner: dict[fx.Node, tuple[str, int]] = {}
    for node in gm.graph.nodes:
        block = _block_of(node) if node.op == "call_function" else None
        if block is not None:
            owner[node] = block
    for node in reversed(gm.graph.nodes):  # readers come later: one reverse pass settles chains
        if node.op != "call_function" or node in owner or read_meta(node).module:
            continue
        readers = {owner.get(user) for user in node.users}
        if len(readers) == 1 and None not in readers:
            owner[node] = readers.pop()
    parts: dict[tuple[str, int], dict[fx.Node, None]] = {}
    for node in gm.graph.nodes:  # in graph order, so every block's nodes come in one order
        if node in owner:
            parts.setdefault(owner[node], {})[node] = None
    per_container: dict[str, int] = {}
    for container, _ in parts:
        per_container[container] = per_container.get(container, 0) + 1
    return {b: parts[b] for b in sorted(parts) if per_container[b[0]] > 1}


def _structure_key(gm: fx.GraphModule, nodes: dict[fx.Node, None]) -> tuple[Any, ...]:
    """What a block computes, up to names: per node in graph order its target, arguments (nodes
    as indices: inside the block by position, outside by first use, with their shape, dtype and
    stride), output shape, dtype and stride, whether a node outside reads it (the block's outputs),
    and the ``meta["custom"]`` tags the saved-activation hooks read."""
    index: dict[fx.Node, str] = {}
    inputs: list[tuple[Any, ...]] = []
    key: list[tuple[Any, ...]] = []

    def ref(arg: Any) -> Any:
        if not isinstance(arg, fx.Node):
            return arg
        if arg not in index:  # an input of the block: a Parameter, a cast source, an activation
            index[arg] = f"in{len(inputs)}"
            inputs.append(_value_key(gm, arg))
        return index[arg]

    for node in gm.graph.nodes:
        if node not in nodes:
            continue
        args = str(fx.node.map_aggregate(node.args, ref))
        kwargs = str(fx.node.map_aggregate(node.kwargs, ref))
        index[node] = f"n{len(key)}"
        read_outside = any(user not in nodes for user in node.users)
        key.append((str(node.target), args, kwargs, _value_key(gm, node), read_outside,
                    str(node.meta.get("custom"))))
    return tuple(key), tuple(inputs)


def _value_key(gm: fx.GraphModule, node: fx.Node) -> tuple[Any, ...]:
    """Shape, dtype and stride of ``node``'s value: a ``get_attr``'s tensor (a Parameter or
    buffer, by its attributes, not its name), else ``meta["val"]`` (strings: symbolic sizes print
    as their symbols); a non-tensor by its type."""
    val = attrgetter(str(node.target))(gm) if node.op == "get_attr" else node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return str(tuple(val.shape)), str(val.dtype), str(val.stride()), node.op
    return node.op, type(val).__name__
