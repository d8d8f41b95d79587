"""The torch.autocast + torch.compile bar on batches that vary in shape (pad-to-longest loaders):
``tune`` compiles it once for every shape and times no compile, as ``bench`` does."""

from __future__ import annotations

import pytest
import torch

from autoprec.capture import warmup_steps
from autoprec.commands.bench_shapes import CompileWatch
from autoprec.measure import Harness
from autoprec.modelspec import load_model_spec
from autoprec.search.autocast_baseline import AutocastBaseline
from autoprec.search.contest import Contest
from autoprec.search.drift_budget import DriftBudget
from autoprec.search.progress import Clock
from tests.conftest import MODELS

#: torch.autocast(bf16) running natively (no emulation, it can win).
AC = AutocastBaseline(torch.bfloat16)


@pytest.mark.heavy
def test_autocast_baseline_compiles_dynamic_and_times_no_compile():
    """A Hugging Face Llama with padded batches, compiled as ``torch.compile``'s default
    (``dynamic=None``), hit ``recompile_limit`` inside ``tune``'s timed steps: 15 tok/s against
    12581 fp32 eager, a 1332x "speedup". Now the module compiles with ``dynamic=True`` when the
    batches vary, the warm-up meets every shape, and no timed step compiles."""
    h = Harness(load_model_spec(str(MODELS / "varlen_lm.py")), torch.device("cpu"), warmup=1, steps=6)
    assert len(h.shapes) == 5 and h.warmup_steps(lambda: None) == warmup_steps(h.batches, 1) == 5
    sel = Contest(h, DriftBudget.fixed(1.0), True, AC, None, 0, Clock(), True)
    fn = sel.build(h.model)
    assert fn.dynamic and fn.target is h.model
    watch = CompileWatch(fn)
    m = h.measure(watch, lambda: None, autocast_dtype=torch.bfloat16)
    assert m.error is None and len(m.step_times) > 0
    warm = h.warmup_steps(fn)
    assert watch.compiled and all(k < warm for k in watch.compiled), (watch.compiled, warm)
