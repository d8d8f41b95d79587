"""The region buffer bug's workaround (``REGION_OPTIONS``, autoprec/applied/compile.py; issue 52) is
still needed on the installed torch, and is the narrowest known one.

On torch 2.13.0's CPU Inductor, compiled regions (``nested_compile_region``) get wrong gradients
unless both ``allow_buffer_reuse`` and ``inplace_buffers`` are off. Measured (fp32, grad_rel_l2
against the eager graph; ``tests/models/wide_mlp.py`` / the 4-layer Qwen2 of test_regions.py):
neither off 0.119 / 1310; only ``allow_buffer_reuse`` off 0.119 / 2e-7; only ``inplace_buffers``
off 0.066 / 1310; both off 2e-7 / 2e-7. ``torch._functorch.config.donated_buffer=False`` (the
narrower workaround of pytorch/pytorch PR #193960's donated-buffer bug) leaves 0.119 / 1310: it is
another bug. When the first test here fails, the installed torch computes regions right without
the workaround: drop ``REGION_OPTIONS`` (its cost is buffer reuse in every regional compile)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import autoprec
from autoprec.applied import compile as compile_mod
from autoprec.applied.outputs import flat_output_graph
from autoprec.metrics import grad_rel_l2
from autoprec.modelspec import load_model_spec
from autoprec.policy import Policy
from tests.conftest import DRIFT, MODELS

pytestmark = pytest.mark.heavy


def _grads(options: dict, donated_buffer: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """WideMLP's fp32 gradients eagerly and compiled in regions under ``options`` as REGION_OPTIONS."""
    spec = load_model_spec(MODELS / "wide_mlp.py")
    model, batch = spec.build_model(), spec.get_batch(0, torch.device("cpu"))
    flat = flat_output_graph(autoprec.apply(model, Policy.fp32(), batch, compile=False,
                                            dynamic=False).graph_module)[0]

    def grads(fn):
        for p in model.parameters():
            p.grad = None
        out = fn(*batch)
        (out[0] if isinstance(out, (tuple, list)) else out).backward()
        return [p.grad.clone() for p in model.parameters()]

    ref = grads(flat)
    torch._dynamo.reset()
    patched = contextlib.ExitStack()
    with patched:
        patched.enter_context(pytest.MonkeyPatch.context()).setattr(compile_mod, "REGION_OPTIONS", options)
        if not donated_buffer:
            patched.enter_context(torch._functorch.config.patch(donated_buffer=False))
        compiled = compile_mod.compile_graph(flat)
        got = grads(compiled)
    assert compiled.regions is not None and compiled.regions.blocks, "the graph must compile in regions"
    return ref, got


def test_without_the_workaround_regional_gradients_are_still_wrong():
    ref, got = _grads({})
    assert grad_rel_l2(got, ref) > 1e-3, (
        f"torch {torch.__version__} computes compiled regions' gradients right without REGION_OPTIONS "
        f"(grad_rel_l2 {grad_rel_l2(got, ref):.2g}): drop the workaround in autoprec/applied/compile.py")


def test_donated_buffers_off_is_not_the_fix_and_the_workaround_is_exact():
    ref, got = _grads({}, donated_buffer=False)
    assert grad_rel_l2(got, ref) > 1e-3  # another bug than PR #193960's
    ref, got = _grads(dict(compile_mod.REGION_OPTIONS))
    assert grad_rel_l2(got, ref) < DRIFT[torch.float32]
