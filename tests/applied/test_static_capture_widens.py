"""A graph captured for one shape because the batches it was captured from did not vary (``autoprec
train`` and ``tune``: :func:`autoprec.capture.capture_for` over the model file's first batches) meets
other shapes later: it is captured again once with dynamic dimensions (a loader whose lengths varied
after its first five batches stopped ``autoprec train`` at its 17th shape, in the per-shape cache);
a model that cannot be exported so gets the per-shape cache, as before."""

from __future__ import annotations

import logging

import pytest
import torch

import autoprec
from autoprec.applied.shape_cache import ShapeCache, is_dynamic
from autoprec.capture import capture_for
from autoprec.errors import CaptureError
from tests.nets import CausalLM, ParityLM, lm_batch


def test_a_static_capture_of_unvarying_batches_recaptures_dynamic_on_another_shape(caplog):
    torch.manual_seed(0)
    model = CausalLM()
    first = [lm_batch(4, 32, i) for i in range(3)]
    gm = capture_for(model, first)
    assert not is_dynamic(gm)
    mp = autoprec.apply(model, autoprec.Policy.fp32(), first[0], compile=False, graph_module=gm, force=True)
    with caplog.at_level(logging.INFO, logger="autoprec"):
        for t in list(range(33, 53)) + [16, 32]:  # 20 new lengths and back: more than MAX_SHAPES (16)
            batch = lm_batch(4, t, t)
            torch.testing.assert_close(mp(**batch), model(**batch), rtol=1e-5, atol=1e-5)
    assert is_dynamic(mp.graph_module) and not isinstance(mp.runner, ShapeCache)
    assert caplog.text.count("differ from the one shape captured; captured again with dynamic") == 1
    assert mp.shape_stats["recaptures"] == 1


def test_a_model_that_cannot_be_captured_dynamic_gets_the_per_shape_cache(caplog):
    torch.manual_seed(0)
    model = ParityLM()
    first = [lm_batch(4, 32, i) for i in range(3)]
    gm = capture_for(model, first)
    mp = autoprec.apply(model, autoprec.Policy.fp32(), first[0], compile=False, graph_module=gm, force=True)
    with caplog.at_level(logging.INFO, logger="autoprec"):
        for t in (17, 20, 17, 32):
            batch = lm_batch(2, t, 1)
            torch.testing.assert_close(mp(**batch), model(**batch))
    assert isinstance(mp.runner, ShapeCache) and mp.shape_stats["mode"] == "per_shape"
    assert "cannot be captured with dynamic dimensions for both; such shapes get a graph each" in caplog.text
    assert mp.shape_stats["captures"] == 4  # (4, 32), (2, 17), (2, 20), (2, 32)


def test_pre_shifted_views_capture_dynamic():
    """``input_ids=raw[:, :-1], labels=raw[:, 1:]`` (non-contiguous views of one tensor) made the
    dynamic export fail on a guard of their strides, so the model fell back to one graph per shape
    and a loop over 20 lengths stopped at the 17th; the example is exported from contiguous copies."""
    torch.manual_seed(0)
    model = CausalLM()

    def views(t, seed):
        raw = torch.randint(0, 32, (4, t + 1), generator=torch.Generator().manual_seed(seed))
        return {"input_ids": raw[:, :-1], "labels": raw[:, 1:]}

    gm = capture_for(model, [views(8 + 3 * i, i) for i in range(5)])
    assert is_dynamic(gm)
    pol = autoprec.Policy.fp32()
    mp = autoprec.apply(model, pol, views(8, 0), compile=False, graph_module=gm, force=True)
    for t in range(8, 28):
        b = views(t, t)
        torch.testing.assert_close(mp(**b), model(**b), rtol=1e-5, atol=1e-5)


def test_a_model_that_cannot_export_dynamic_over_varying_first_batches():
    """Batch 0 not the largest of get_batch(0..4) and no dynamic export: the static graph was the
    largest batch's, while train seeds its per-shape graphs with batch 0's shape (a raw ``Guard
    failed`` at step 0). Now it is batch 0's; and tune/bench, which run every batch on one graph,
    refuse such batches with a CaptureError saying what to do."""
    from autoprec.capture import PLAN_META, check_one_graph
    from autoprec.errors import CaptureError

    torch.manual_seed(0)
    model = ParityLM()
    batches = [lm_batch(4, 8 + 3 * i, i) for i in range(5)]
    gm = capture_for(model, batches)
    assert not is_dynamic(gm) and PLAN_META in gm.meta
    mp = autoprec.apply(model, autoprec.Policy.fp32(), batches[0], compile=False, graph_module=gm, force=True)
    for b in batches + batches[::-1]:
        torch.testing.assert_close(mp(**b), model(**b))
    with pytest.raises(CaptureError, match=r"m\.py: get_batch\(0\.\.4\) gives batches of 5 shapes(.|\n)*pad"):
        check_one_graph(gm, batches, "m.py")
    check_one_graph(capture_for(CausalLM(), batches), batches, "m.py")  # dynamic: one graph serves all


def test_shape_stats_count_the_graphs_a_recapture_replaced():
    """``captures``, ``compiles`` and ``compile_seconds`` count every graph of the module: a user
    saw ``captures: 1`` beside ``recaptures: 1`` and only the dynamic graph's compile seconds."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    mp = autoprec.apply(model, autoprec.Policy.fp32(), torch.randn(8, 16), compile=True)
    mp(torch.randn(8, 16)).sum().backward()  # the example's shape: the static graph compiles
    first = mp.shape_stats
    assert first["mode"] == "static" and first["captures"] == 1 and first["compiles"] == 1, first
    x = torch.randn(5, 16)
    torch.testing.assert_close(mp(x), model(x), rtol=1e-5, atol=1e-6)  # captured again, dynamic
    stats = mp.shape_stats
    assert stats["mode"] == "dynamic" and stats["recaptures"] == 1, stats
    assert stats["captures"] == 2 and stats["compiles"] == 2, stats
    assert stats["compile_seconds"] > first["compile_seconds"] > 0, (first, stats)


def test_an_empty_batch_is_refused_as_such_not_as_a_capture_failure():
    """A batch of 0 rows (a filtered-out last batch) made a re-capture fail with a message about
    "the example batch" and "the batch get_batch returns"; it is refused naming the empty input, and
    the module serves later batches as before."""
    torch.manual_seed(0)
    model = CausalLM()
    mp = autoprec.apply(model, autoprec.Policy.fp32(), lm_batch(4, 32, 0), compile=False)
    empty = {k: v[:0] for k, v in lm_batch(4, 32, 1).items()}
    with pytest.raises(ValueError, match=r"MixedPrecisionModule of CausalLM: input shapes \{input_ids: "
                                         r"\(0, 32\), labels: \(0, 32\)\}: an empty batch \(input_ids has a "
                                         r"dimension of size 0\).*skip it in the loop"):
        mp(**empty)
    batch = lm_batch(2, 16, 2)
    torch.testing.assert_close(mp(**batch), model(**batch), rtol=1e-5, atol=1e-5)


def test_a_recapture_leaves_the_models_buffers_as_eager_training_leaves_them():
    """BatchNorm's ``num_batches_tracked`` counted one batch more than eager training after a batch of
    another shape: the recapture's dtype check (fake-tensor propagation) ran the graph's in-place add
    on the real 0-d buffer. Every buffer ends as in the same model trained eagerly."""
    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4),
                                   torch.nn.Flatten(), torch.nn.Linear(4 * 64, 1)).train()

    model, eager = net(), net()
    mp = autoprec.apply(model, autoprec.Policy.fp32(), torch.randn(8, 3, 8, 8), compile=False)
    for rows in (8, 5, 3):
        x = torch.randn(rows, 3, 8, 8, generator=torch.Generator().manual_seed(rows))
        mp(x).sum().backward()
        eager(x).sum().backward()
    assert mp.shape_stats["recaptures"] >= 1
    for (name, b), (_, want) in zip(model.named_buffers(), eager.named_buffers(), strict=True):
        torch.testing.assert_close(b, want, rtol=1e-5, atol=1e-6, msg=name)
    assert model[1].num_batches_tracked.item() == 3


def test_an_image_of_another_size_after_a_batch_change_gets_a_graph_of_its_own(caplog):
    """A batch of another size made the graph dynamic in the batch only; an image of another height
    and width then was refused "as its sizes are inside the captured ranges ... inputs that share a
    dimension must have the same size" (one input, and 6x6 against a static 8x8), where the same call
    first got a graph of its own. Such shapes now get a graph each, exact, whatever the order."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 10))
    mp = autoprec.apply(model, autoprec.Policy.fp32(), torch.randn(4, 3, 8, 8), compile=False)
    with caplog.at_level(logging.INFO, logger="autoprec"):
        for shape in [(2, 3, 8, 8), (4, 3, 6, 6), (3, 3, 10, 10), (4, 3, 8, 8), (5, 3, 6, 6)]:
            x = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
            torch.testing.assert_close(mp(x), model(x), rtol=1e-5, atol=1e-6)
    assert "in a dimension captured static; such shapes get a graph each" in caplog.text
    assert mp.shape_stats["mode"] == "dynamic+per_shape"
    with pytest.raises(CaptureError, match=r"forward\(\) itself raised RuntimeError"):  # a wrong batch
        mp(torch.randn(4, 3, 8))
