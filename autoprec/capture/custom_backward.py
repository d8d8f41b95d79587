"""Custom ``torch.autograd.Function``s in a model's forward (docs/architecture.md#data-flow).

``torch.export`` traces a custom Function's ``forward`` into the graph and drops its ``backward``:
autograd then differentiates the traced forward instead. Where the Function's backward is that
derivative (a fused or memory-saving op written by hand) nothing changes; where it is not (a
gradient reversal layer, a straight-through estimator over ``round``) the captured graph would
train other gradients without a word: reversed, or all zero. :func:`check_custom_backward`
compares the graph's fp32 gradients with the model's own on the example batch and refuses the
capture where they differ, naming the Function and what keeps its backward (a custom op:
``torch.library.custom_op`` with ``register_autograd``, which ``torch.export`` keeps whole).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn

from autoprec.errors import CaptureError
from autoprec.modelspec import call_model, grad_leaves, split_batch

__all__ = ["GRAD_TOLERANCE", "check_custom_backward", "custom_functions"]

_log = logging.getLogger("autoprec")

#: Relative L2 difference of all gradients (graph against model, both fp32, same RNG state) above
#: which the capture is refused. The two run the same ATen ops where no custom backward is lost, so
#: they agree to fp32 rounding (~1e-7); a lost backward differs by O(1) (a reversed gradient: 2.0).
GRAD_TOLERANCE = 1e-4
#: torch's own Functions the capture meets and handles elsewhere (gradient checkpointing is refused
#: by :func:`autoprec.capture.diagnose.checkpointing_refused`).
_HANDLED = ("torch.utils.checkpoint.CheckpointFunction",)
_CUSTOM_OP_DOCS = "https://pytorch.org/tutorials/advanced/python_custom_ops.html"


def custom_functions(seen: Sequence[type]) -> list[type]:
    """The user's Function classes among ``seen`` (:func:`autoprec._torch_compat.autograd_function_calls`),
    each once, in call order."""
    return [f for f in dict.fromkeys(seen) if f"{f.__module__}.{f.__qualname__}" not in _HANDLED]


def _where(fn: type) -> str:
    """``Name (file:line)`` of a Function class, for messages: from ``inspect``, else from its
    ``forward``'s code object (a model file the CLI loads is not a module ``inspect`` can find)."""
    try:
        return f"{fn.__qualname__} ({inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]})"
    except (OSError, TypeError):
        code = getattr(getattr(fn, "forward", None), "__code__", None)
        return f"{fn.__qualname__} ({code.co_filename}:{code.co_firstlineno})" if code else fn.__qualname__


def _gradients(run: Any, params: list[nn.Parameter], weights: list[torch.Tensor] | None,
               device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``params``' gradients of a fixed random projection of ``run()``'s floating outputs (fp32),
    from RNG seed 0 (dropout draws the same masks in both runs), and the projection weights."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        leaves = grad_leaves(run())
        if weights is None:
            g = torch.Generator().manual_seed(0)
            weights = [torch.randn(t.shape, generator=g).to(t.device) for t in leaves]
        if [t.shape for t in leaves] != [w.shape for w in weights]:
            raise ValueError("the graph's outputs differ in shape from the model's")
        total = sum((t.float() * w).sum() for t, w in zip(leaves, weights))
        grads = torch.autograd.grad(total, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)], weights


def check_custom_backward(model: nn.Module, gm: fx.GraphModule, example_batch: Any,
                          functions: Sequence[type]) -> None:
    """Refuse a capture whose fp32 gradients differ from the model's own because the custom
    ``functions`` (called in its forward) lost their backward (module docstring). One forward and
    backward of each on ``example_batch``, only when ``functions`` is not empty; ``.grad`` is not
    touched (``torch.autograd.grad``).

    Args:
        model: The model, in the training modes the capture traced it in.
        gm: Its captured graph (reads the model's own Parameters).
        example_batch: The capture's example batch.
        functions: The custom Function classes its forward called (:func:`custom_functions`).

    Raises:
        CaptureError: the relative L2 difference of all Parameter gradients exceeds
            :data:`GRAD_TOLERANCE`; names the Functions (class, file and line), the difference, the
            Parameter where it is largest, and the custom-op way to keep a backward.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not functions or not params:
        return
    device, (args, kwargs) = params[0].device, split_batch(example_batch)
    names = ", ".join(_where(f) for f in functions)
    try:
        own, weights = _gradients(lambda: call_model(model, example_batch), params, None, device)
        traced, _ = _gradients(lambda: gm(*args, **kwargs), params, weights, device)
    except (RuntimeError, ValueError) as e:  # e.g. outputs that need no gradient: nothing to compare
        _log.warning("autoprec: the forward of %s calls custom autograd.Function %s, whose backward the "
                     "captured graph does not keep; its gradients could not be compared (%s)",
                     type(model).__name__, names, e)
        return
    diff = torch.stack([(a - b).float().norm() for a, b in zip(traced, own)]).norm()
    ref = torch.stack([b.float().norm() for b in own]).norm()
    rel = (diff / ref).item() if ref > 0 else (0.0 if diff == 0 else float("inf"))
    if rel <= GRAD_TOLERANCE:
        _log.info("%s: custom autograd.Function %s: the captured graph differentiates its forward, whose "
                  "gradients match its own backward's on the example batch (relative L2 %.2g)",
                  type(model).__name__, names, rel)
        return
    by_name = {id(p): n for n, p in model.named_parameters()}
    gap = [((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(traced, own)]
    worst = params[max(range(len(params)), key=gap.__getitem__)]
    raise CaptureError(
        f"{type(model).__name__}: the forward calls custom torch.autograd.Function {names}. torch.export "
        "traces a Function's forward and drops its backward, and here that changes the gradients: the "
        f"captured graph's differ from the model's own by relative L2 {rel:.3g} (most at parameter "
        f"{by_name.get(id(worst), '?')!r}), so autoprec would train other gradients. Keep the backward by "
        "making the Function a custom op, which torch.export keeps whole: torch.library.custom_op with "
        f"register_fake and register_autograd ({_CUSTOM_OP_DOCS})")
