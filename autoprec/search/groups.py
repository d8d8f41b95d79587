"""Layer blocks grouped into search parameters, so the search's size does not grow with depth
(docs/architecture.md#search).

A 4-layer model has one ``block:<path>`` parameter per layer. A 24-layer one would have 24: the
sensitivity pass then costs 24 drift measurements of a model 6x as slow (quadratic in depth), and
20 trials sample a 24-dimensional space thinly. Instead, each container's blocks form at most
:data:`MAX_BLOCK_PARAMS` runs of neighbouring layers, one parameter each
(``blocks:model.layers.0-5``): neighbouring layers are alike in sensitivity (measured one layer at
a time on a 24-layer Qwen2 of hidden 256: the grad_rel_l2 of lowering one layer falls smoothly
with depth, see docs/architecture.md#search), and a run keeps the first layers, the most
sensitive, apart from the last. Up to :data:`MAX_BLOCK_PARAMS` blocks per container, each block is
its own parameter, named as before (``block:model.layers.3``), so studies of small models resume.
"""

from __future__ import annotations

import re

from autoprec.nodekeys import block_of

__all__ = ["MAX_BLOCK_PARAMS", "block_params", "members"]

#: The most block parameters per container (the blocks of a 4-layer model, one each).
MAX_BLOCK_PARAMS = 4

_RUN = re.compile(r"^blocks:(?P<container>.+)\.(?P<first>\d+)-(?P<last>\d+)$")


def block_params(blocks: list[str], max_params: int = MAX_BLOCK_PARAMS) -> list[str]:
    """Parameter names for ``blocks`` (module paths in graph order, e.g. ``model.layers.0`` ..):
    ``block:<path>`` each when a container has at most ``max_params``, else ``blocks:<container>.<a>-<b>``
    for near-equal runs of consecutive indices (the first runs one longer when they do not divide).
    A block without a numeric last component, or whose indices have a gap, keeps its own parameter.
    """
    by_container: dict[str, list[int]] = {}
    alone: list[str] = []
    for b in blocks:
        block = block_of(b)
        if block is None or f"{block[0]}.{block[1]}" != b:  # not a <container>.<index> path
            alone.append(b)
        else:
            by_container.setdefault(block[0], []).append(block[1])
    out: list[str] = []
    for container, indices in by_container.items():
        consecutive = indices == list(range(indices[0], indices[0] + len(indices)))
        if len(indices) <= max_params or not consecutive:
            out += [f"block:{container}.{i}" for i in indices]
            continue
        size, extra = divmod(len(indices), max_params)
        start = 0
        for g in range(max_params):
            n = size + (g < extra)
            run = indices[start:start + n]
            out.append(f"blocks:{container}.{run[0]}-{run[-1]}")
            start += n
    return out + [f"block:{b}" for b in alone]


def members(param: str) -> list[str]:
    """The block module paths a parameter from :func:`block_params` stands for:
    ``block:model.layers.3`` -> ``["model.layers.3"]``; ``blocks:model.layers.0-2`` ->
    ``["model.layers.0", "model.layers.1", "model.layers.2"]``.

    Raises:
        ValueError: ``param`` is neither form.
    """
    if param.startswith("block:"):
        return [param[len("block:"):]]
    m = _RUN.match(param)
    if m is None:
        raise ValueError(f"not a block parameter: {param!r} "
                         "(expected 'block:<path>' or 'blocks:<container>.<a>-<b>')")
    return [f"{m['container']}.{i}" for i in range(int(m["first"]), int(m["last"]) + 1)]
