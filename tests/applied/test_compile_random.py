"""A compiled policy graph that draws random numbers (dropout) runs eager's random ops
(``autoprec.applied.compile.RANDOM_OPTIONS``), as ``tune`` measures it: ``train`` after ``tune``
compiles the graph ``tune`` measured (Inductor's caches serve it) and draws the masks it measured."""

from __future__ import annotations

import pytest
import torch

from autoprec.applied.compile import compile_graph
from autoprec.measure import Harness
from autoprec.modelspec import load_model_spec
from autoprec.training.rng import same_rng
from tests.measure.test_measure_rng import DROPOUT_MODEL


def _loss(h: Harness, fn) -> float:
    """The model file's loss of one forward of ``fn`` on drift batch 0 from the measurement seed
    (its dropout masks)."""
    batch = h.batches[0]
    with same_rng(h.device):  # with autograd: the training graph, as train compiles it
        out = fn(*batch)
    return float(h.spec.loss_fn(out[0] if isinstance(out, (tuple, list)) else out, batch).detach())


@pytest.mark.heavy
def test_train_compiles_the_random_graph_tune_measured_and_draws_its_masks(tmp_path, monkeypatch):
    from autoprec._torch_compat import compile_cache_counts

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    p = tmp_path / "model.py"
    p.write_text(DROPOUT_MODEL)
    h = Harness(load_model_spec(p), torch.device("cpu"), warmup=1, steps=2)
    assert h.random
    counts = []
    for run in ("tune", "train"):
        torch._dynamo.reset()  # a new process as far as Dynamo's in-memory caches go
        before = compile_cache_counts()
        fn = compile_graph(h.graph_module)
        if run == "tune":  # compiled by its first drift pass, as tune's finalists are
            assert h.drift(fn).error is None
        else:  # compiled by its first call outside any measurement, as train's first step
            compiled_loss = _loss(h, fn)
        counts.append({k: v - before[k] for k, v in compile_cache_counts().items()})
    assert counts[0]["aot_autograd_miss"] == 1, counts  # (its compiled FP32 reference: the same graph, a hit)
    assert (counts[1]["aot_autograd_hit"], counts[1]["aot_autograd_miss"]) == (1, 0), counts
    # eager's masks: the eager FP32 graph's loss from the same seed, within fp32 rounding (Inductor's
    # own RNG drops other units: a loss off by several percent)
    assert compiled_loss == pytest.approx(_loss(h, h.graph_module), rel=1e-5)
