"""A model file whose batches vary in size and length (a pad-to-longest loader): tune measures on
them with one dynamic capture and says which shapes it measured; train uses the same capture."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from autoprec.applied.shape_cache import is_dynamic
from autoprec.measure import Harness
from autoprec.modelspec import load_model_spec
from autoprec.nodekeys import graph_fingerprint
from autoprec.policy import Policy
from tests.conftest import MODELS

VARLEN = MODELS / "varlen_lm.py"


def test_harness_captures_once_with_dynamic_dims_and_times_every_shape():
    h = Harness(load_model_spec(VARLEN), torch.device("cpu"), warmup=1, steps=5)
    assert is_dynamic(h.graph_module)
    assert h.shapes == ["args[0] (3, 12)", "args[0] (2, 8)", "args[0] (3, 16)", "args[0] (1, 10)",
                        "args[0] (2, 12)"]
    m = h.measure(h.graph_module)
    assert m.error is None and len(m.step_times) == 5 and m.grad_rel_l2 == 0.0
    assert h.tokens == (36 + 16 + 48 + 10 + 24) / 5  # mean tokens of the timed steps, one per batch


@pytest.mark.heavy
def test_tune_and_train_on_varying_batches(tmp_path):
    out = tmp_path / "p.json"
    tune = [sys.executable, "-m", "autoprec.cli", "tune", str(VARLEN), "--out", str(out), "--trials", "2",
            "--no-compile", "--dtypes", "bf16", "--traj-steps", "3"]
    r = subprocess.run(tune, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    report = (tmp_path / "p.report.md").read_text()
    assert "## Batches measured" in report and "`args[0] (3, 16)`" in report and "`args[0] (1, 10)`" in report
    policy = Policy.load(out)
    train = [sys.executable, "-m", "autoprec.cli", "train", str(VARLEN), "--policy", str(out), "--steps", "7",
             "--no-compile"]
    r = subprocess.run(train, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "was tuned on" not in r.stderr  # train captured the same (dynamic) graph as tune
    model = load_model_spec(VARLEN).build_model()
    from autoprec.capture import capture_for

    spec = load_model_spec(VARLEN)
    gm = capture_for(model, [spec.get_batch(i, torch.device("cpu")) for i in range(5)])
    assert policy.provenance["graph_fingerprint"] == graph_fingerprint(gm)


def test_one_capture_covers_the_largest_batch_and_the_longest_sequence_of_different_batches():
    """The probe batches (4, 6) and (2, 14): the ranges reach batch 4 and length 14 although no
    single batch has both (the model has no config to bound the length)."""
    from autoprec import Policy, apply
    from autoprec.capture import capture_for

    spec = load_model_spec(MODELS / "micro_lm.py")
    model = spec.build_model()
    batches = [(torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(i)),)
               for i, shape in enumerate([(4, 6), (2, 14)])]
    gm = capture_for(model, batches)
    mp = apply(model, Policy.fp32(), batches[0], compile=False, graph_module=gm)
    for b in batches + [(torch.randint(0, 64, (4, 14)),)]:
        torch.testing.assert_close(mp(*b), model(*b))


def test_encoder_decoder_target_length_is_its_own_dimension():
    """T5's labels are as long as the target, not the source: their length gets its own range,
    so a later batch with other source and target lengths still fits one capture."""
    from transformers import T5Config, T5ForConditionalGeneration

    from autoprec.capture import SEQ, TARGET, plan_dims

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                                num_heads=2, decoder_start_token_id=0))
    kwargs = {"input_ids": torch.randint(1, 64, (4, 9)), "attention_mask": torch.ones(4, 9, dtype=torch.long),
              "labels": torch.randint(1, 64, (4, 9))}
    plan = plan_dims(model, (), kwargs, at_least={SEQ: 20, TARGET: 17})
    assert plan.ranges[SEQ].hi == 20 and plan.ranges[TARGET].hi == 17
    assert plan.dims[2][1].role == TARGET and plan.dims[0][1].role == SEQ  # equal lengths, not tied
