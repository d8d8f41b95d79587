"""Batches whose shape changes (issue 12): one capture with dynamic batch/sequence dimensions,
compiled once; the per-shape graph cache where a model cannot be captured so; range errors."""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from torch import nn

import autoprec
from autoprec.applied.shape_cache import ShapeCache
from autoprec.capture import BATCH, DIMS_META, SEQ, capture, plan_dims
from autoprec.errors import AutoprecError, ShapeLimitError
from autoprec.graph import tensor_bytes
from autoprec.metrics import grad_rel_l2
from autoprec.nodemeta import read_meta
from autoprec.passes import run_pipeline
from tests.conftest import EXAMPLES, RTOL
from tests.nets import VOCAB, CausalLM, ParityLM, lm_batch

#: 20 distinct shapes, batch 1-4 and sequence 17-256 (the example batch (4, 256) is the largest).
SHAPES = [(4 - i % 4, 17 + (i * 239) // 19) for i in range(20)]


# ------------------------------------------------------------------ the rule: autoprec.capture.dims
def test_plan_dims_finds_batch_and_sequence_with_bounds():
    class Cfg:
        max_position_embeddings = 512

    model = nn.Linear(2, 2)
    model.config = Cfg()
    ids = torch.zeros(4, 64, dtype=torch.long)
    kwargs = {"input_ids": ids, "attention_mask": torch.ones(4, 64), "labels": ids.clone(),
              "pixel_scale": torch.ones(4, 3), "temperature": torch.ones(())}
    plan = plan_dims(model, (), kwargs)
    assert plan.ranges[BATCH].lo == 1 and plan.ranges[BATCH].hi == 4
    assert (plan.ranges[SEQ].lo, plan.ranges[SEQ].hi) == (2, 512)  # config.max_position_embeddings
    dims = dict(zip(plan.names, plan.dims))
    assert set(dims["input_ids"]) == set(dims["attention_mask"]) == set(dims["labels"]) == {0, 1}
    assert set(dims["pixel_scale"]) == {0} and dims["temperature"] == {}  # dim 1 is 3, not the sequence
    assert plan.describe() == "batch 1..4, seq 2..512"
    # no config: the example's length bounds the sequence; images have no sequence; batch 1 is static
    assert plan_dims(nn.Linear(2, 2), (ids,), {}).ranges[SEQ].hi == 64
    assert set(plan_dims(nn.Linear(2, 2), (torch.ones(4, 64, 8, 8),), {}).ranges) == {BATCH}
    assert not plan_dims(nn.Linear(2, 2), (torch.ones(1, 8),), {}).dynamic
    bad = plan.out_of_range((), {**kwargs, "input_ids": torch.zeros(5, 600, dtype=torch.long)})
    assert "input 'input_ids' has shape (5, 600): dim 0 (batch) is 5, allowed 1..4" in bad[0]
    assert "dim 1 (seq) is 600, allowed 2..512" in bad[1]


# ------------------------------------------------------------------ capture and passes on symbolic shapes
def test_dynamic_capture_lowers_with_symbolic_shapes_and_example_costs():
    torch.manual_seed(0)
    model, batch = CausalLM(), lm_batch(4, 32, 0)
    gm = capture(model, batch, dynamic=True)
    assert sorted(r for r, _, _ in gm.meta[DIMS_META].values()) == [BATCH, SEQ]
    low = run_pipeline(gm, autoprec.Policy.default("bf16"))
    static = run_pipeline(capture(model, batch), autoprec.Policy.default("bf16"))
    # verify's fake-tensor propagation ran in the export's own mode: sizes stay symbolic
    shapes = [n.meta["val"].shape for n in low.graph_module.graph.nodes
              if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)]
    assert any(not isinstance(d, int) for s in shapes for d in s)
    assert low.graph_module.meta[DIMS_META] == gm.meta[DIMS_META]  # the ranges survive the passes
    # byte costs are counted at the example's sizes: the same placement as the static capture's
    assert low.stats["casts"] == static.stats["casts"]
    assert low.stats["cast_bytes"] == static.stats["cast_bytes"]
    emb = next(n for n in gm.graph.nodes if read_meta(n).op == "embedding")
    assert tensor_bytes(emb) == 4 * 32 * 32 * 4
    for b, t in [(1, 17), (3, 30)]:
        batch = lm_batch(b, t, 1)  # one lowered graph runs every shape in range, close to FP32
        torch.testing.assert_close(low.graph_module(**batch), model(**batch), rtol=RTOL[torch.bfloat16],
                                   atol=0)


def test_call_outside_the_range_names_input_shape_and_range():
    torch.manual_seed(0)
    model = CausalLM()
    mp = autoprec.apply(model, autoprec.Policy.default("bf16"), lm_batch(4, 32, 0), compile=False,
                        # default: a batch outside the ranges is captured again (test_t5_example)
                        dynamic=True, strict_shapes=True)
    mp(**lm_batch(2, 20, 1))  # in range: runs
    with pytest.raises(ValueError) as err:
        mp(**lm_batch(5, 20, 1))
    msg = str(err.value)
    # seq 3..32, not 2..32: logits[:, :-1] needs 2+ positions, and the capture took torch.export's
    # suggested narrower range (autoprec.capture.export.export_program)
    assert ("accepts input shapes {input_ids: (batch, seq), labels: (batch, seq)} "
            "with batch 1..4, seq 3..32") in msg
    assert "input 'input_ids' has shape (5, 20): dim 0 (batch) is 5, allowed 1..4" in msg
    assert "example batch of the largest batch size and lengths" in msg
    with pytest.raises(ValueError, match=r"dim 1 \(seq\) is 33, allowed 3\.\.32"):
        mp(**lm_batch(2, 33, 1))
    with pytest.raises(ValueError, match=r"input 'labels' has seq 19 \(dim 1\) but input 'input_ids' has 20"):
        mp(input_ids=lm_batch(2, 20, 1)["input_ids"], labels=lm_batch(2, 19, 1)["labels"])



def test_non_strict_module_refusing_disagreeing_inputs_does_not_advise_non_strict():
    """Without ``strict_shapes`` a call whose inputs captured as one dimension disagree is still
    refused (a fault in the batch, not a range), and its advice no longer says "or without
    strict_shapes=True", which is what the user already does (a user test found it)."""
    torch.manual_seed(0)
    model = CausalLM()
    mp = autoprec.apply(model, autoprec.Policy.fp32(), lm_batch(4, 32, 0), compile=False, dynamic=True)
    mp(**lm_batch(2, 20, 1))  # another shape: captured again with dynamic dimensions
    assert mp.shape_stats["mode"] == "dynamic"
    with pytest.raises(ValueError) as err:
        mp(input_ids=lm_batch(2, 20, 1)["input_ids"], labels=lm_batch(2, 19, 1)["labels"])
    msg = str(err.value)
    assert "input 'labels' has seq 19 (dim 1) but input 'input_ids' has 20" in msg
    assert "strict_shapes" not in msg
    assert "What to do: capturing again cannot serve this call" in msg
    assert "must have the same size in it" in msg

# ------------------------------------------------------------------ fallback: one graph per shape
def test_model_that_specialises_falls_back_to_a_bounded_logged_cache(caplog):
    torch.manual_seed(0)
    model = ParityLM()
    with caplog.at_level(logging.INFO, logger="autoprec"):
        mp = autoprec.apply(model, autoprec.Policy.fp32(), lm_batch(4, 32, 0), compile=False, dynamic=True,
                            strict_shapes=True)
        assert mp.shape_stats["mode"] == "per_shape"
        assert "cannot be captured with dynamic batch/sequence dimensions" in caplog.text
        for b, t in [(4, 32), (2, 17), (3, 20), (2, 17)]:
            batch = lm_batch(b, t, 1)
            torch.testing.assert_close(mp(**batch), model(**batch))
    assert caplog.text.count("new input shape") == 2  # (2, 17) and (3, 20); the example's is built at apply
    assert "new input shape {input_ids: (2, 17), labels: (2, 17)}" in caplog.text
    stats = mp.shape_stats
    assert stats["mode"] == "per_shape" and stats["captures"] == 3
    with pytest.raises(ValueError, match=r"dim 0 \(batch\) is 5, allowed 1\.\.4"):
        mp(**lm_batch(5, 20, 1))
    assert isinstance(mp.runner, ShapeCache)
    mp.runner.max_shapes = 3  # instead of MAX_SHAPES = 16, to reach the bound in a few calls
    with pytest.raises(ShapeLimitError) as err:  # a ValueError; the CLI exits 2 without a traceback
        mp(**lm_batch(1, 25, 1))
    assert isinstance(err.value, ValueError) and isinstance(err.value, AutoprecError)
    assert "already holds graphs for 3 input shapes" in str(err.value) and "MAX_SHAPES" in str(err.value)
    assert "pad" in str(err.value)


def test_per_shape_cache_matches_keywords_by_name_not_order():
    """A batch given with its keywords in another order is the same shape: range-checked by
    input name and served by the graph already built (no second capture)."""
    torch.manual_seed(0)
    model = ParityLM()
    mp = autoprec.apply(model, autoprec.Policy.fp32(), lm_batch(4, 32, 0), compile=False, dynamic=True)
    batch = lm_batch(2, 17, 1)
    torch.testing.assert_close(mp(**batch), model(**batch))
    reordered = {k: batch[k] for k in reversed(list(batch))}
    torch.testing.assert_close(mp(**reordered), model(**batch))
    assert mp.shape_stats["captures"] == 2


def test_static_apply_still_refuses_other_shapes():
    torch.manual_seed(0)
    mp = autoprec.apply(CausalLM(), autoprec.Policy.fp32(), lm_batch(4, 32, 0), compile=False, dynamic=False)
    with pytest.raises(ValueError, match="the capture is per shape"):
        mp(**lm_batch(2, 32, 1))


# ------------------------------------------------------------------ Done when 2
def _train_on_shapes(model, mp, shapes, lr=3e-3):
    """Train ``mp`` one step per shape; per step the drift of its gradients (and autocast's) vs FP32."""
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=lr)
    losses, drifts, autocast_drifts = [], [], []
    for step, (b, t) in enumerate(shapes):
        batch = lm_batch(b, t, step + 1)
        grads = []
        for run in ("fp32", "autocast", "autoprec"):
            opt.zero_grad(set_to_none=True)
            if run == "autoprec":
                loss = model_loss(mp(**batch))
            else:
                with torch.autocast("cpu", torch.bfloat16, enabled=run == "autocast"):
                    loss = model_loss(model(**batch))
            loss.backward()
            grads.append([p.grad.detach().clone() for p in params])
        losses.append(float(loss.detach()))
        drifts.append(grad_rel_l2(grads[2], grads[0]))
        autocast_drifts.append(grad_rel_l2(grads[1], grads[0]))
        opt.step()
    return losses, drifts, autocast_drifts


def model_loss(out):
    return out.loss if hasattr(out, "loss") else out


def _check_training(losses, drifts, autocast_drifts):
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5]), losses  # the loss falls
    for shape, d, ac in zip(SHAPES, drifts, autocast_drifts):
        # bf16 policy: within the bf16 tolerance of tests/conftest.py, and of autocast's own drift
        assert 1e-6 < d < RTOL[torch.bfloat16] and d < 2 * ac, (shape, d, ac)


@pytest.mark.heavy
def test_trains_on_20_shapes_one_capture_bounded_logged_compiles(caplog):
    from torch._dynamo.utils import counters

    assert len(set(SHAPES)) == 20 and {b for b, _ in SHAPES} == {1, 2, 3, 4}
    assert min(t for _, t in SHAPES) == 17 and max(t for _, t in SHAPES) == 256
    torch.manual_seed(0)
    model = CausalLM()
    graphs = counters["stats"]["unique_graphs"]
    with caplog.at_level(logging.INFO, logger="autoprec"):
        mp = autoprec.apply(model, autoprec.Policy.default("bf16"), lm_batch(4, 256, 0), dynamic=True)
        stats = mp.shape_stats  # torch.compile's rule: the example's shape static first
        assert stats["mode"] == "static" and stats["compiles"] == 0, stats
        assert SHAPES[0] != (4, 256)
        _check_training(*_train_on_shapes(model, mp, SHAPES))
    # the first call has another shape than the example's: one capture with dynamic dimensions
    # (the static graph, never called, never compiled), compiled once, plus once for batch size 1
    # (Dynamo specialises size 1); each one logged
    compiles = counters["stats"]["unique_graphs"] - graphs
    stats = mp.shape_stats
    assert stats["mode"] == "dynamic" and stats["recaptures"] == 1, stats
    assert compiles == stats["compiles"] <= 2, (compiles, stats)
    assert caplog.text.count("compiled the dynamic-shape graph") == stats["compiles"]
    assert caplog.text.count("differ from the one shape captured; captured again with dynamic") == 1


@pytest.mark.slow
def test_tiny_qwen2_trains_on_20_shapes():
    sys.path.insert(0, str(EXAMPLES))
    import qwen2_tiny

    model = qwen2_tiny.build_qwen2(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, intermediate_size=64, vocab_size=VOCAB,
                                   max_position_embeddings=256, use_cache=False)
    mp = autoprec.apply(model, autoprec.Policy.default("bf16"), lm_batch(4, 256, 0), dynamic=True)
    assert mp.shape_stats["mode"] == "static"
    _check_training(*_train_on_shapes(model, mp, SHAPES))
    assert mp.shape_stats["mode"] == "dynamic" and mp.shape_stats["recaptures"] == 1
    assert mp.shape_stats["compiles"] <= 2


def test_a_larger_batch_widens_its_own_range_and_never_past_the_position_table(caplog):
    """GPT-2's position table has n_positions rows: a larger batch used to double every range (seq
    2..256 of 128 positions), and a 130-token batch then aborted the process in a compiled graph
    (eager: ``IndexError``). Only the batch range widens now, and a longer sequence is refused."""
    model, mp = _gpt2_64_positions()
    with caplog.at_level(logging.INFO, logger="autoprec"):
        batch = lm_batch(5, 16, 1)  # batch above its range 1..2
        torch.testing.assert_close(mp(**batch).loss, model(**batch).loss, rtol=1e-5, atol=1e-6)  # fp32
    assert mp.shape_stats["recaptures"] == 1
    assert "captured again with dynamic dimensions, ranges batch 1..5, seq 2..64" in caplog.text, caplog.text
    with pytest.raises(ValueError, match=r"seq length 65 is above the model's config.max_position_embeddings "
                                         r"\(64\), the longest the capture serves"):
        mp(**lm_batch(2, 65, 1))
    with pytest.raises(IndexError):  # what the model itself does with it
        model(**lm_batch(2, 65, 1))


@pytest.mark.parametrize("first", ["one token", "dynamic"])
def test_a_one_token_batch_is_served_and_the_position_table_still_bounds_later_shapes(first):
    """Two faults a user found with GPT-2: after a one-token batch had put the module in
    ``dynamic+per_shape`` mode, a sequence past n_positions went to a per-shape graph unguarded
    (eager: the model's ``IndexError``; compiled: the process aborted on the out-of-range index);
    and a one-token batch after a dynamic recapture raised "allowed 2..64" in the non-strict mode
    (its sequence role was not found at length 1). The one-token batch now gets a graph of its own
    whichever came first, and the position table bounds every shape."""
    model, mp = _gpt2_64_positions()
    one = {"input_ids": lm_batch(2, 16, 1)["input_ids"][:1, :1]}
    one["labels"] = one["input_ids"].clone()
    if first == "dynamic":
        mp(**lm_batch(2, 24, 1))  # the dynamic recapture first
        assert mp.shape_stats["mode"] == "dynamic"
    torch.testing.assert_close(mp(**one).logits, model(**one).logits, rtol=1e-5, atol=1e-6)
    assert mp.shape_stats["mode"] == "dynamic+per_shape"
    with pytest.raises(ValueError, match=r"seq length 65 is above the model's config.max_position_embeddings "
                                         r"\(64\)"):
        mp(**lm_batch(2, 65, 1))
    batch = lm_batch(2, 40, 2)  # in the dynamic graph's ranges: still served by it
    torch.testing.assert_close(mp(**batch).loss, model(**batch).loss, rtol=1e-5, atol=1e-6)


def _gpt2_64_positions():
    """A 1-layer GPT-2 without dropout whose position table has 64 rows, and its fp32 module from
    an example batch of (2, 16)."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    model = tf.GPT2LMHeadModel(cfg)
    return model, autoprec.apply(model, autoprec.Policy.fp32(), lm_batch(2, 16, 0), compile=False)


def test_a_users_torch_compile_of_the_applied_module_serves_a_new_shape():
    """``torch.compile(mp)`` (by habit, or ``TrainingArguments(torch_compile=True)``): Dynamo traced
    into the re-capture at the first batch outside the captured ranges (the epoch's short last batch)
    and failed with "PassError: [assign_dtypes] RuntimeError: expected int arg". The re-capture runs
    outside Dynamo now, and the new shape's loss is what the applied module alone gives."""
    torch.manual_seed(0)
    model = CausalLM()
    policy = autoprec.Policy.default("bf16")
    mp = autoprec.apply(model, policy, lm_batch(2, 16, 0), compile=False)
    compiled = torch.compile(mp)
    for step in range(2):
        compiled(**lm_batch(2, 16, step)).backward()
    short = lm_batch(1, 9, 5)  # batch 1, a length outside the captured range
    got = compiled(**short)
    alone = autoprec.apply(model, policy, lm_batch(2, 16, 0), compile=False)(**short)
    torch.testing.assert_close(got, alone, rtol=RTOL[torch.bfloat16], atol=0)
    assert mp.shape_stats["recaptures"] == 1 and mp.shape_stats["shapes"] == ["((1, 9), (1, 9))"]
