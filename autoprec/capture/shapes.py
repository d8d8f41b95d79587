"""The input shapes a captured graph was specialised for, and a cheap check of a call against them.

A graph captured with dynamic dimensions (``capture(model, batch, dynamic=True)``) has symbolic
batch/sequence sizes; ``gm.meta[DIMS_META]`` holds their ranges (written by ``capture`` from
:func:`autoprec.capture.export.export_ranges`), and the check compares a call's sizes with them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import fx

from autoprec._torch_compat import pytree, pytree_info, tree_flatten_spec

__all__ = ["DIMS_META", "PLAN_META", "RANGE_ADVICE", "UNSERVED_ADVICE", "InputShapes", "unserved"]

#: ``gm.meta`` key of ``{symbol: (role, lo, hi)}``, the ranges of a graph's symbolic input
#: dimensions (e.g. ``{"s0": ("batch", 1, 4)}``; a bound is None when unbounded). ``gm.meta``
#: survives the passes' deep copies, so the lowered graph keeps it.
DIMS_META = "autoprec_dims"

#: ``gm.meta`` key of the :class:`~autoprec.capture.dims.DimPlan` a static capture was made under when
#: the dynamic export it planned failed (:func:`autoprec.capture.batches.capture_dynamic`): the
#: per-shape cache of ``autoprec.apply(..., dynamic=True)`` checks calls against that plan's ranges
#: instead of planning the same batch again.
PLAN_META = "autoprec_dim_plan"

#: What to do about a batch outside the ranges of a dynamic capture (the rule is autoprec.capture.dims').
RANGE_ADVICE = ("the ranges come from the example batch given to autoprec.apply (batch sizes up to its batch "
                "size; sequence lengths, and an encoder-decoder's target lengths (target_seq) on their own, "
                "up to the model's config.max_position_embeddings, else up to the example's; see "
                "autoprec.capture.dims): apply with an example batch of the largest batch size and lengths "
                "you train on, or without strict_shapes=True, which captures again with wider ranges "
                "instead of raising; inputs that share a dimension (the seq of input_ids and attention_mask) "
                "must have the same size in it.")

#: What to do about a call a module without ``strict_shapes`` cannot serve by capturing again
#: (:func:`unserved`): its sizes are not outside a range, so the fault is in the batch.
UNSERVED_ADVICE = ("capturing again cannot serve this call, as its sizes are inside the captured "
                   "ranges: inputs that share a dimension (the seq of input_ids and attention_mask) must "
                   "have the same size in it, and the batch is passed with the example batch's structure "
                   "(its tensors all by keyword, or all positional).")


def unserved(error: ValueError) -> ValueError:
    """``error`` (an :class:`InputShapes` check's) with :data:`UNSERVED_ADVICE` as its advice: for a
    module that captures again instead of raising (``apply`` without ``strict_shapes=True``), whose
    check's :data:`RANGE_ADVICE` would tell the user to do what they already do."""
    head = str(error).split("\n  What to do: ", 1)[0]
    return ValueError(f"{head}\n  What to do: {UNSERVED_ADVICE}")


class InputShapes:
    """The input shapes a captured graph was specialised for, and a cheap check of a call against them.

    ``torch.export`` specialises every dimension of every input tensor: the captured module's guards
    fail with a bare ``AssertionError: Guard failed: ids.size()[0] == 8`` on any other shape. Checking
    the call first turns that into an error that names the input, both shapes and what to do.

    Inputs are matched to the graph's placeholders exactly as the exported ``forward`` does (positional
    arguments, then keyword arguments by name, nested lists/dicts flattened by the captured pytree spec).
    Shapes come from each placeholder's ``meta["val"]``. A symbolic dimension (dynamic capture) must
    lie in its range from ``gm.meta[DIMS_META]`` (any size when the graph records none), and inputs
    that share a symbol (the batch size of ``input_ids`` and ``labels``) must agree. A call that does not
    bind to the captured inputs (one missing, an unknown keyword, a batch dict passed as one argument) is a
    ``TypeError`` naming them; another structure is left to the graph's own call, which raises its usual
    error.

    Args:
        gm: A graph from :func:`capture` (or one lowered from it by ``autoprec.passes``).
        what: How the message names the callee, e.g. ``"MixedPrecisionModule"``.

    Attributes:
        names: Display name per tensor input in placeholder order (``"ids"``, ``"extra[1]['z']"``).
        shapes: Captured shape per input (a tuple of ints, ``None`` for a symbolic dimension), or None
            for an input that is not a tensor or has no recorded shape.
        ranges: ``{symbol: (role, lo, hi)}`` of the symbolic dimensions (empty for a static graph).
    """

    def __init__(self, gm: fx.GraphModule, what: str = "the captured graph") -> None:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        info = pytree_info(gm.graph)
        spec = getattr(info, "in_spec", None)
        self.what = what
        self.shapes: list[tuple[int | None, ...] | None] = [_shape_of(n) for n in placeholders]
        self._symbols = [_symbols_of(n) for n in placeholders]
        self.ranges: dict[str, tuple[str, int | None, int | None]] = dict(gm.meta.get(DIMS_META, {}))
        # argument names of forward(); the first `n_positional` are (args), the rest the kwargs of the spec
        self._args: list[str] = [str(a) for a in info.orig_args] if info is not None else \
            [str(n.target) for n in placeholders]
        self._spec = None
        self._n_positional = len(self._args)
        self.names = list(self._args)
        self.enabled = any(s is not None for s in self.shapes)
        if spec is not None and _is_args_kwargs_spec(spec):
            self._n_positional = spec.child(0).num_children
            self.names = _leaf_names(spec, self._args)
            # one leaf per argument in argument order: index the call directly, no pytree walk
            flat = all(spec.child(i).child(j).is_leaf()
                       for i in (0, 1) for j in range(spec.child(i).num_children))
            self._spec = None if flat else spec
        elif spec is not None:
            self.enabled = False  # a layout this check does not know: let the graph check its inputs
        if (len(self.names) != len(self.shapes)
                or (self._spec is None and len(self._args) != len(self.shapes))):
            self.enabled = False  # placeholders do not map onto the arguments: leave it to the graph
        self._index = {name: i for i, name in enumerate(self._args)}

    def check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raise if a tensor input's shape differs from the captured one.

        Args:
            args, kwargs: The call's arguments, as passed to the captured module.

        Raises:
            TypeError: the call does not bind to the captured inputs (:meth:`_check_binding`).
            ValueError: an input tensor has another shape than at capture, or (dynamic capture) a
                size outside its range or two sizes that must agree do not; the message lists the
                captured and the given shapes, names the input(s) at fault (with the allowed range)
                and says what to do.
        """
        if not self.enabled:
            return
        self._check_binding(args, kwargs)
        leaves = self._leaves(args, kwargs)
        if leaves is None:
            return
        for leaf, shape in zip(leaves, self.shapes):
            if isinstance(leaf, torch.Tensor) and leaf.shape != shape and not _fits(leaf.shape, shape):
                self._raise(leaves)
        if self.ranges:
            bad = self._out_of_range(leaves)
            if bad:
                self._raise_range(leaves, bad)

    def role_extents(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, tuple[int, int]]:
        """The smallest and largest size this call gives each role of the capture's dynamic
        dimensions (``{"batch": (2, 2), "seq": (1, 1)}``), read off the captured symbols, so a
        length-1 sequence (which :func:`autoprec.capture.role_sizes` does not name) counts; empty
        for a static capture or a call that does not bind."""
        if not self.enabled or not self.ranges:
            return {}
        leaves = self._leaves(args, kwargs)
        out: dict[str, tuple[int, int]] = {}
        for leaf, syms in zip(leaves or [], self._symbols):
            if not isinstance(leaf, torch.Tensor) or syms is None:
                continue
            for i, sym in enumerate(syms):
                if sym is None or i >= leaf.dim() or sym not in self.ranges:
                    continue
                role, n = self.ranges[sym][0], int(leaf.shape[i])
                lo, hi = out.get(role, (n, n))
                out[role] = (min(lo, n), max(hi, n))
        return out

    def static_differs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether a tensor of this call has another size than the capture in a dimension the
        capture kept static (an image's height beside a dynamic batch), with as many dimensions;
        False for a call that does not bind."""
        if not self.enabled:
            return False
        leaves = self._leaves(args, kwargs)
        return any(isinstance(leaf, torch.Tensor) and shape is not None and leaf.dim() == len(shape)
                   and any(want is not None and n != want for n, want in zip(leaf.shape, shape))
                   for leaf, shape in zip(leaves or [], self.shapes))

    def _check_binding(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raise TypeError, naming the captured inputs, when the call does not bind to them: a dict
        batch passed as one argument, an input missing (an evaluation call without the ``labels``
        the training graph was captured with) or one the capture did not see."""
        given = set(self._args[:len(args)]) | set(kwargs)
        missing = [a for a in self._args if a not in given]
        unknown = [k for k in kwargs if k not in self._index] + (
            [f"{len(args) - len(self._args)} positional argument(s) more"] * (len(args) > len(self._args)))
        if not missing and not unknown:
            return
        if len(args) == 1 and isinstance(args[0], Mapping) and not kwargs:
            why = "was given the batch dict as one argument; call it as module(**batch)"
        else:
            why = "; ".join(x for x in (f"misses {', '.join(missing)}" if missing else "",
                                        f"gives {', '.join(unknown)}" if unknown else "") if x)
        hint = ("; the graph computes the loss from the labels the example batch had: pass the batch's "
                "labels in each training call, or, to compute the loss outside the model (your own loss; "
                "Hugging Face Trainer with label_smoothing_factor > 0 or compute_loss_func), apply the "
                "model with an example batch without labels, so the module returns the logits (an "
                "evaluation call in mp.eval() runs the model's own forward, labels or not)"
                if "labels" in missing else
                f": apply the policy with an example batch that holds {', '.join(unknown)} as the "
                "training batches do (autoprec.apply(model, policy, batch)), so the graph takes them"
                if unknown else "")
        raise TypeError(f"{self.what} was captured on the inputs {', '.join(self._args)} (the example "
                        f"batch's; the graph takes every one) and this call {why}{hint}")

    def _leaves(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any] | None:
        """The call's input leaves in placeholder order (None: it does not bind); the fast path
        when every argument is one tensor leaf indexes the call, with no pytree walk."""
        return self._leaves_flat(args, kwargs) if self._spec is None else self._leaves_nested(args, kwargs)

    def _leaves_flat(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        leaves: list[Any] = [None] * len(self.shapes)
        for i, a in enumerate(args[:len(leaves)]):
            leaves[i] = a
        for k, v in kwargs.items():
            i = self._index.get(k, -1)
            if 0 <= i < len(leaves):
                leaves[i] = v
        return leaves

    def _leaves_nested(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any] | None:
        """Flatten the call as the exported forward does; None where it would not bind."""
        if len(args) > len(self._args) or any(k not in self._index for k in kwargs):
            return None
        values = dict(zip(self._args, args))
        values.update(kwargs)
        if len(values) != len(self._args):
            return None
        k = self._n_positional
        tree = ([values[a] for a in self._args[:k]], {c: values[a] for c, a in
                                                      zip(self._spec.child(1).context, self._args[k:])})
        try:
            leaves = tree_flatten_spec(tree, self._spec)
        except Exception:  # noqa: BLE001 - another structure: the graph's own call reports it
            return None
        return leaves if len(leaves) == len(self.shapes) else None

    def _out_of_range(self, leaves: list[Any]) -> list[str]:
        """Message fragments for symbolic sizes outside their range or disagreeing with each other."""
        bad: list[str] = []
        seen: dict[str, tuple[str, int]] = {}
        for name, leaf, syms in zip(self.names, leaves, self._symbols):
            if not isinstance(leaf, torch.Tensor) or syms is None:
                continue
            for i, sym in enumerate(syms):
                if sym is None or i >= leaf.dim():
                    continue
                size = int(leaf.shape[i])
                role, lo, hi = self.ranges.get(sym, (f"dim {i}", None, None))
                if (lo is not None and size < lo) or (hi is not None and size > hi):
                    bad.append(f"input {name!r} has shape {_fmt(tuple(leaf.shape))}: dim {i} ({role}) is "
                               f"{size}, allowed {_fmt_range(lo, hi)}")
                elif sym in seen and seen[sym][1] != size:
                    bad.append(f"input {name!r} has {role} {size} (dim {i}) but input {seen[sym][0]!r} has "
                               f"{seen[sym][1]}: they were captured as one dimension")
                seen.setdefault(sym, (name, size))
        return bad

    def _raise_range(self, leaves: list[Any], bad: list[str]) -> None:
        accepted = [f"{n}: {_fmt(self._display(s, syms))}" for n, s, syms in zip(self.names, self.shapes,
                                                                                 self._symbols)
                    if s is not None]
        given = [f"{n}: {_fmt(tuple(x.shape))}" for n, x, s in zip(self.names, leaves, self.shapes)
                 if s is not None and isinstance(x, torch.Tensor)]
        roles = dict.fromkeys(f"{r} {_fmt_range(lo, hi)}" for r, lo, hi in self.ranges.values())
        raise ValueError(
            f"{self.what} accepts input shapes {{{', '.join(accepted)}}} with {', '.join(roles)} (captured "
            f"with dynamic dimensions), got shapes {{{', '.join(given)}}}: {'; '.join(bad)}.\n  What to do: "
            + RANGE_ADVICE
        )

    def _display(self, shape: tuple[int | None, ...], syms: tuple[str | None, ...] | None) -> tuple[Any, ...]:
        """A captured shape with each symbolic size shown by its role (``(batch, seq)``)."""
        if syms is None:
            return shape
        return tuple(d if s is None else self.ranges.get(s, ("?",))[0] for d, s in zip(shape, syms))

    def _raise(self, leaves: list[Any]) -> None:
        captured, given, differ = [], [], []
        for name, shape, leaf, syms in zip(self.names, self.shapes, leaves, self._symbols):
            if shape is None:
                continue
            want = _fmt(self._display(shape, syms))
            captured.append(f"{name}: {want}")
            if isinstance(leaf, torch.Tensor):
                got = _fmt(tuple(leaf.shape))
                given.append(f"{name}: {got}")
                if leaf.shape != shape and not _fits(leaf.shape, shape):
                    differ.append(f"input {name!r} has shape {got}, captured {want}")
            else:
                given.append(f"{name}: {'None' if leaf is None else type(leaf).__name__}")
        raise ValueError(
            f"{self.what} was captured for input shapes {{{', '.join(captured)}}}, got shapes "
            f"{{{', '.join(given)}}}: {'; '.join(differ)}.\n  What to do: the capture is per shape "
            "(torch.export specialises every dimension, batch size included). Call autoprec.apply(model, "
            "policy, batch) (or autoprec.capture(model, batch)) with a batch of the new shape and use that "
            "module for such batches (modules applied to the same model share its Parameters), or give "
            "every batch the captured shape (e.g. DataLoader(drop_last=True), or pad the last batch)."
        )


def _shape_of(node: fx.Node) -> tuple[int | None, ...] | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    return tuple(d if isinstance(d, int) else None for d in val.shape)


def _symbols_of(node: fx.Node) -> tuple[str | None, ...] | None:
    """Per dimension of a placeholder's tensor, its symbol name (``"s0"``) or None for a plain int."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    return tuple(None if isinstance(d, int) else str(d) for d in val.shape)


def _fmt_range(lo: int | None, hi: int | None) -> str:
    return f"{'?' if lo is None else lo}..{'' if hi is None else hi}"


def _fits(shape: torch.Size, want: tuple[int | None, ...] | None) -> bool:
    """Whether ``shape`` matches ``want`` where ``None`` dims match anything (the slow compare)."""
    if want is None:
        return True
    return len(shape) == len(want) and all(w is None or s == w for s, w in zip(shape, want))


def _fmt(shape: tuple[Any, ...]) -> str:
    return ("(" + ", ".join("?" if d is None else str(d) for d in shape)
            + ("," if len(shape) == 1 else "") + ")")


def _is_args_kwargs_spec(spec: Any) -> bool:
    return (spec.type is tuple and spec.num_children == 2 and spec.child(0).type is tuple
            and spec.child(1).type is dict)


def _leaf_names(spec: Any, arg_names: list[str]) -> list[str]:
    """Display names of the leaves of an ``(args, kwargs)`` spec: ``ids``, ``extra[1]['z']``."""
    n = spec.num_leaves
    tree = pytree.tree_unflatten(list(range(n)), spec)
    names = [""] * n
    for path, i in pytree.tree_flatten_with_path(tree)[0]:
        top, rest = path[1], path[2:]
        if path[0].idx == 0:
            base = arg_names[top.idx] if top.idx < len(arg_names) else f"args[{top.idx}]"
        else:
            base = str(top.key)
        names[i] = base + pytree.keystr(rest)
    return names
