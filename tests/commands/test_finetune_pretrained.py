"""examples/finetune_pretrained.py: a local ``from_pretrained`` checkpoint, fine-tuned by ``autoprec train``.

The example builds its checkpoint directory (tokenizer + masked-LM pre-trained BERT, written with
``save_pretrained``) under ``$AUTOPREC_CACHE``; here that is a per-module temporary directory, so
the test also covers building it from nothing. A checkpoint written by ``autoprec train`` must load
into the stock ``BertForSequenceClassification`` with a strict ``load_state_dict`` (keys unchanged)
and give the trained module's logits.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autoprec import Policy
from autoprec.applied.apply import apply
from autoprec.commands.train import train
from autoprec.modelspec import load_model_spec, validate_spec
from autoprec.training.checkpoint import load_checkpoint
from autoprec.training.monitor import read_jsonl
from tests.conftest import EXAMPLES, ROOT, RTOL

EXAMPLE = EXAMPLES / "finetune_pretrained.py"
transformers = pytest.importorskip("transformers")


def _import_example():
    spec = importlib.util.spec_from_file_location("finetune_pretrained_under_test", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """``AUTOPREC_CACHE`` pointed at a fresh directory for this module; the example's checkpoint built in
    it."""
    root = tmp_path_factory.mktemp("autoprec_cache")
    patch = pytest.MonkeyPatch()
    patch.setenv("AUTOPREC_CACHE", str(root))
    example = _import_example()
    directory = example.ensure_pretrained()
    yield example, directory
    patch.undo()


def test_checkpoint_directory_is_built_and_loads_with_from_pretrained(cache):
    example, directory = cache
    assert directory.parent.parent == Path(os.environ["AUTOPREC_CACHE"])
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in directory.iterdir()}
    assert not [p for p in directory.parent.iterdir() if p.name.startswith(".")], \
        "temporary build dir left behind"
    assert json.loads((directory / "config.json").read_text())["model_type"] == "bert"
    stamp = (directory / "model.safetensors").stat().st_mtime_ns
    assert example.ensure_pretrained() == directory
    assert (directory / "model.safetensors").stat().st_mtime_ns == stamp, "rebuilt although complete"

    from safetensors.torch import load_file
    from transformers import AutoTokenizer, BertForSequenceClassification

    saved = load_file(directory / "model.safetensors")
    stock = BertForSequenceClassification.from_pretrained(directory, num_labels=len(example.CLASSES))
    encoder = {k: v for k, v in stock.state_dict().items() if k.startswith("bert.encoder.")}
    assert encoder and all(torch.equal(v, saved[k]) for k, v in encoder.items()), \
        "encoder not loaded from the file"
    tokenizer = AutoTokenizer.from_pretrained(directory)
    ids = tokenizer(["import os"])["input_ids"][0]
    assert ids[0] == tokenizer.cls_token_id and ids[-1] == tokenizer.sep_token_id


def test_a_lost_build_race_keeps_the_winner(cache, tmp_path, monkeypatch):
    """Another process renames its complete directory into place first: ours is discarded, theirs used."""
    example, built = cache
    target = example.pretrained_dir(tmp_path)

    def racing_pretrain(_tokenizer, _lines):
        shutil.copytree(built, target)  # the other process finishes while this one trains
        return example.load_classifier(built)  # what this process would save (any model will do)

    monkeypatch.setattr(example, "_train_tokenizer", lambda _lines: example.load_tokenizer(built))
    monkeypatch.setattr(example, "_pretrain", racing_pretrain)
    assert example.ensure_pretrained(tmp_path) == target
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]
    assert (target / "model.safetensors").read_bytes() == (built / "model.safetensors").read_bytes()


def test_a_partial_directory_in_the_way_is_named(cache, tmp_path, monkeypatch):
    example, built = cache
    target = example.pretrained_dir(tmp_path)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # a copy cut short: no weights
    monkeypatch.setattr(example, "_train_tokenizer", lambda _lines: example.load_tokenizer(built))
    monkeypatch.setattr(example, "_pretrain", lambda _tokenizer, _lines: example.load_classifier(built))
    with pytest.raises(OSError, match=f"{target}.*delete it to rebuild"):
        example.ensure_pretrained(tmp_path)
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name], "temporary build dir left behind"


def test_model_file_follows_the_contract(cache):
    example, _ = cache
    spec = load_model_spec(EXAMPLE)
    validate_spec(spec)
    batch = spec.get_batch(3, torch.device("cpu"))
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (example.BATCH_SIZE, example.MAX_LEN)
    assert batch["labels"].tolist() == [r % 4 for r in range(example.BATCH_SIZE)]
    pad = batch["attention_mask"] == 0
    assert pad.any() and (batch["input_ids"][pad] == 0).all()
    assert spec.tokens_per_batch(batch) == int(batch["attention_mask"].sum())
    again = spec.get_batch(3, torch.device("cpu"))
    assert all(torch.equal(batch[k], again[k]) for k in batch)
    assert not torch.equal(batch["input_ids"], spec.get_batch(4, torch.device("cpu"))["input_ids"])
    held = spec.heldout_batch(3, torch.device("cpu"))
    assert not torch.equal(batch["input_ids"], held["input_ids"])
    sources = ("# x", "from a import b", "async def f():", "x = 1")
    assert [example.label_of(s) for s in sources] == [0, 1, 2, 3]


def test_train_checkpoint_loads_into_the_stock_model(cache, tmp_path):
    example, directory = cache
    policy = Policy.default(low="bf16")
    policy.save(tmp_path / "policy.json")
    ck = tmp_path / "ckpt.pt"
    result = train(EXAMPLE, tmp_path / "policy.json", steps=3, compile=False, quiet=True, checkpoint=ck)
    assert len(result.losses) == 3 and all(map(torch.isfinite, torch.tensor(result.losses)))

    from transformers import BertForSequenceClassification

    saved = torch.load(ck, map_location="cpu", weights_only=True)["model"]
    stock = BertForSequenceClassification.from_pretrained(
        directory, num_labels=len(example.CLASSES), hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    assert list(saved) == list(stock.state_dict()), "checkpoint keys differ from the stock model's"
    stock.load_state_dict(saved)  # strict
    initial = example.build_model().state_dict()
    assert any(not torch.equal(saved[k], initial[k]) for k in saved), "training changed no weight"

    spec = load_model_spec(EXAMPLE)
    batch = spec.heldout_batch(0, torch.device("cpu"))
    model = spec.build_model()
    load_checkpoint(ck, model, restore_rng=False)
    trained = apply(model, policy, batch, compile=False)  # the module `autoprec train` trained, restored
    with torch.no_grad():
        fp32 = model(**batch).logits
        assert torch.equal(stock(**batch).logits, fp32)
        lowered = trained(**batch).logits
        torch.testing.assert_close(apply(stock, policy, batch, compile=False)(**batch).logits, lowered,
                                   rtol=RTOL[torch.float32], atol=0.0)
    rel = float((lowered.float() - fp32).norm() / fp32.norm())
    assert 0.0 < rel < 0.1, f"bf16 logits drift {rel:.3g} from the fp32 ones"
    scores = example.evaluate(stock, batches=2)
    assert 0.0 <= scores["heldout_accuracy"] <= 1.0 and scores["heldout_loss"] > 0.0


@pytest.mark.slow
def test_tune_then_train_100_steps_loss_falls(cache, tmp_path):
    """Done-when 3 of issue 12: the example tunes and trains from the CLI; the loss falls."""
    env = dict(os.environ)  # carries the module's AUTOPREC_CACHE
    cli = [sys.executable, "-m", "autoprec.cli"]
    policy = tmp_path / "finetune.policy.json"
    subprocess.run([*cli, "tune", str(EXAMPLE), "--out", str(policy), "--trials", "4", "--no-compile"],
                   cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=900)
    log = tmp_path / "train.jsonl"
    subprocess.run([*cli, "train", str(EXAMPLE), "--policy", str(policy), "--steps", "100", "--no-compile",
                    "--log", str(log), "--log-every", "50"], cwd=ROOT, env=env, check=True,
                   capture_output=True, text=True, timeout=900)
    losses = [rec["loss"] for rec in read_jsonl(log)]
    assert len(losses) == 100
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert first > 1.3 and last < 0.5 * first, (first, last)
