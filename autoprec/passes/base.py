"""What every pass shares: :class:`PassBase`, :class:`PassResult`, the error helper and the copy rule."""

from __future__ import annotations

import abc
import contextlib
import copy
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from torch import fx

from autoprec._torch_compat import lazy_graph_module
from autoprec.errors import PassError
from autoprec.nodemeta import read_meta, unshare_meta
from autoprec.source import node_source


@dataclass
class PassResult:
    """What a pass returns (mirrors ``torch.fx.passes.infra.pass_base.PassResult``).

    Attributes:
        graph_module: The transformed ``GraphModule``: a new object, or the input itself when the
            pass has nothing to do (``modified`` False); the input is never modified, unless the
            runner owns it (:func:`writable`), and then the result is the input, modified.
        modified: Whether the pass changed the graph.
        stats: Pass-specific numbers (e.g. ``{"casts": 12, "cast_bytes": 1048576}``).
    """

    graph_module: fx.GraphModule
    modified: bool
    stats: dict[str, Any] = field(default_factory=dict)


class PassBase(abc.ABC):
    """One graph pass (mirrors ``torch.fx.passes.infra.pass_base.PassBase``).

    A pass is an object with a :attr:`name`, a transformation :meth:`call` and a post-condition
    :meth:`ensures`; :class:`autoprec.passes.manager.PassManager` runs a list of them, linting
    the graph after each ``call`` and then checking ``ensures``. Options a pass depends on (the
    policy, the placement mode...) are given to its constructor, so ``call`` takes only the graph.
    Unlike torch's ``PassBase`` there is no ``requires``: each pass's pre-condition is the
    post-condition of the pass before it, already checked by the runner.
    """

    #: The pass's name in error messages and in a node's ``NodeMeta.decided_by`` (:mod:`autoprec.nodemeta`).
    name: str = ""

    @abc.abstractmethod
    def call(self, gm: fx.GraphModule) -> PassResult:
        """Transform ``gm`` (normally a copy: see :func:`writable`).

        Raises:
            PassError: the graph cannot be transformed; the message names the pass and node.
        """

    def ensures(self, gm: fx.GraphModule) -> None:  # noqa: B027 (optional hook, as in torch)
        """Check the post-condition on ``gm``, the graph :meth:`call` returned; cheap.

        The default checks nothing.

        Raises:
            PassError: the post-condition does not hold; the message names the node.
        """

    def __repr__(self) -> str:
        return f"<pass {self.name}>"


def pass_error(pass_name: str, node: fx.Node | None, msg: str) -> PassError:
    """Build a :class:`PassError` that names the pass, the node's key and ``node.format_node()``,
    and the model's source line that made the node where the capture recorded it
    (:func:`autoprec.source.node_source`): ``"[assign_dtypes] node gt#0 (%gt : ...): <msg>
    (from model.py:25 (forward): keep = ids > 4)"``."""
    if node is None:
        return PassError(f"[{pass_name}] {msg}")
    key = read_meta(node).key or node.name
    where = node_source(node)
    return PassError(f"[{pass_name}] node {key} ({node.format_node()}): {msg}"
                     + (f" (from {where})" if where else ""))


def clone_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new ``GraphModule`` with a deep copy of ``gm``'s graph and the *same* Parameters.

    ``copy.deepcopy(gm)`` would copy the Parameters (training would then update copies), and
    ``copy.deepcopy(gm.graph)`` shares each node's ``meta`` values, so each node's
    :class:`~autoprec.nodemeta.NodeMeta` is copied here explicitly (:func:`autoprec.nodemeta.unshare_meta`).
    Pytree in/out specs (``_in_spec``/``_out_spec``) and ``gm.meta`` (e.g. the ranges of dynamic
    dimensions, ``autoprec.capture.DIMS_META``) carry over. Its Python code is generated lazily
    (:func:`autoprec._torch_compat.lazy_graph_module`): the passes' ``recompile()`` calls only mark
    it stale, and :class:`~autoprec.passes.manager.PassManager` generates it once for the graph it
    returns.
    """
    graph = copy.deepcopy(gm.graph)
    unshare_meta(graph)
    new = lazy_graph_module(gm, graph)  # code generated once, after the last pass (PassManager)
    for attr in ("_in_spec", "_out_spec"):
        if hasattr(gm, attr):
            setattr(new, attr, getattr(gm, attr))
    new.meta.update(gm.meta)
    return new


#: The graph module the running :class:`~autoprec.passes.manager.PassManager` owns (an intermediate
#: of its own, or one its caller gave away), which a pass may write into: :func:`writable`.
_OWNED: ContextVar[fx.GraphModule | None] = ContextVar("autoprec_owned_graph_module", default=None)


@contextlib.contextmanager
def owning(gm: fx.GraphModule | None) -> Iterator[None]:
    """While the block runs, :func:`writable` gives ``gm`` itself (None: nothing is owned). The
    pass runner wraps each pass in it, naming the graph no one else holds."""
    token = _OWNED.set(gm)
    try:
        yield
    finally:
        _OWNED.reset(token)


def writable(gm: fx.GraphModule) -> fx.GraphModule:
    """The graph module a transforming pass writes into: ``gm`` itself when the pass runner owns it
    (:func:`owning`: a graph an earlier pass of the same run made, which nothing else holds), else
    :func:`clone_graph_module` of it, so the caller's graph is never modified. A deep copy of a
    24-layer Qwen2's graph (1750-2090 nodes) takes 30-40 ms on one core; a search's lowering copies
    once instead of once per pass."""
    return gm if _OWNED.get() is gm else clone_graph_module(gm)
