"""The pass runner: runs a list of passes, linting and checking after each one.

Mirrors ``torch.fx.passes.infra.pass_manager.PassManager``, which runs a list of passes and,
with ``run_checks_after_each_pass``, lints after each; on failure it raises a bare
``Exception`` naming the pass. This runner always lints (``graph.lint()``) and checks each
pass's post-condition (:meth:`PassBase.ensures`), and raises
:class:`autoprec.errors.PassError` instead, so a bad policy stays a user error (CLI exit code 2).
It runs each pass once (torch's ``steps`` and pass-order constraints are not needed: the
lowering passes run once, in a fixed order).

A runner can be sliced (``manager[:1]``, ``manager[1:]``) and a slice continued from an
earlier result with :meth:`PassManager.resume`, so a caller can look at the graph between
passes: the search fingerprints the assigned dtypes and skips the rest for graphs it has
already measured. ``manager[k:].resume(manager[:k](gm))`` gives the same graph and stats as
``manager(gm)``.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import fx

from autoprec._torch_compat import materialize
from autoprec.errors import PassError
from autoprec.passes.base import PassBase, PassResult, owning, pass_error

__all__ = ["PassManager"]


def _run_one(p: PassBase, gm: fx.GraphModule) -> PassResult:
    """``p.call(gm)``, then lint, then ``p.ensures``; every failure as a ``PassError`` naming ``p``."""
    try:
        result = p.call(gm)
    except PassError:
        raise
    except Exception as e:
        raise pass_error(p.name, None, f"{type(e).__name__}: {e}") from e
    if not isinstance(result, PassResult):
        raise pass_error(p.name, None, f"call() returned {type(result).__name__}, not a PassResult")
    try:
        result.graph_module.graph.lint()
    except Exception as e:
        raise pass_error(p.name, None, f"graph.lint() failed after this pass: {e}") from e
    try:
        p.ensures(result.graph_module)
    except PassError:
        raise
    except Exception as e:
        raise pass_error(p.name, None, f"post-condition check failed: {type(e).__name__}: {e}") from e
    return result


class PassManager:
    """Run passes in order; lint and check each pass's post-condition after it.

    Args:
        passes: The passes, run in this order; each name must be unique.

    Raises:
        ValueError: two passes have the same name.
    """

    def __init__(self, passes: Sequence[PassBase]) -> None:
        self.passes: tuple[PassBase, ...] = tuple(passes)
        names = [p.name for p in self.passes]
        if len(set(names)) != len(names):
            raise ValueError(f"pass names must be unique; got {names}")

    @property
    def names(self) -> list[str]:
        """The pass names, in run order."""
        return [p.name for p in self.passes]

    def __len__(self) -> int:
        return len(self.passes)

    def __getitem__(self, index: slice) -> PassManager:
        """A runner of ``self.passes[index]`` (a prefix, the rest, ...).

        Raises:
            TypeError: ``index`` is not a slice (a single pass is ``manager.passes[i]``).
        """
        if not isinstance(index, slice):
            raise TypeError(f"PassManager indices must be slices, not {type(index).__name__}")
        return PassManager(self.passes[index])

    def __call__(self, gm: fx.GraphModule, code: bool = True) -> PassResult:
        """Run every pass on ``gm`` (the first transforming pass copies the graph, so ``gm``'s graph
        is not modified; ``Verify`` only refreshes ``node.meta["val"]`` of the graph it is given).
        ``code`` as :meth:`resume`'s.

        Returns:
            ``PassResult`` of the last pass's graph; ``modified`` if any pass modified the graph;
            ``stats`` the union of the passes' stats (a later pass's key wins). With no passes,
            ``PassResult(gm, False, {})``.

        Raises:
            PassError: a pass, the lint after it or its post-condition failed; the message
                names the pass (and the node, where the failing check knows it). An exception
                other than ``PassError`` is wrapped, chained as ``__cause__``.
        """
        return self.resume(PassResult(gm, False, {}), code=code)

    def resume(self, done: PassResult, owned: bool = False, code: bool = True) -> PassResult:
        """Run the passes on ``done.graph_module``, carrying ``done``'s ``modified`` and ``stats``.

        ``manager[k:].resume(manager[:k](gm))`` equals ``manager(gm)``. The first pass that
        transforms copies the graph; the passes after it write into that copy
        (:func:`autoprec.passes.base.writable`), which no one else holds.

        Args:
            done: The result of the passes before these (e.g. ``manager[:1](gm)``).
            owned: The caller gives ``done.graph_module`` away (it reads it no more), so even the
                first pass may write into it.
            code: Generate the graph module's Python code (False: a caller that only reads the
                graph, e.g. the search's fingerprint of the assigned dtypes, skips it: 0.1 s for
                a 24-layer Qwen2's 2,000 nodes; the module generates it when first called).

        Returns:
            As :meth:`__call__`, with ``done.stats`` first in the union; with ``code``, the graph
            module's Python code is generated (:func:`autoprec._torch_compat.materialize`), once for
            all passes.

        Raises:
            PassError: as :meth:`__call__`.
        """
        gm, modified, stats = done.graph_module, done.modified, dict(done.stats)
        mine = owned
        for p in self.passes:
            with owning(gm if mine else None):
                result = _run_one(p, gm)
            mine = mine or result.graph_module is not gm  # a new graph: this run's own copy
            gm, modified = result.graph_module, modified or result.modified
            stats.update(result.stats)
        return PassResult(materialize(gm) if code else gm, modified, stats)

    def __repr__(self) -> str:
        return f"PassManager({self.names})"
