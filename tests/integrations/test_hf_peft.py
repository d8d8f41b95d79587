"""``AutoprecTrainer`` with a peft LoRA model: ``save_model`` and checkpoints hold the adapter as stock
``Trainer`` writes it for the same peft model (``adapter_config.json`` + ``adapter_model.safetensors``),
``PeftModel.from_pretrained`` loads the trained adapter weights from it, and a run resumed from a
checkpoint ends where the uninterrupted run does. A tiny Qwen2, eager, on the CPU."""

from __future__ import annotations

import os

import pytest
import torch

import autoprec

tf = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
peft = pytest.importorskip("peft")
from autoprec.integrations.transformers import AutoprecTrainer  # noqa: E402

CFG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=64)


def _base(seed: int = 0):
    torch.manual_seed(seed)
    return tf.Qwen2ForCausalLM(tf.Qwen2Config(**CFG))


def _lora(seed: int = 0):
    """The tiny Qwen2 with LoRA adapters on q_proj and v_proj (the same weights for the same seed)."""
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return peft.get_peft_model(_base(seed), lora).train()


def _data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 128, (16,), generator=g) for _ in range(8)]
    return [{"input_ids": x, "labels": x} for x in ids]


def _apply(pm):
    data = _data()
    batch = {k: torch.stack([d[k] for d in data[:2]]) for k in data[0]}
    return autoprec.apply(pm, autoprec.Policy.default("fp16"), batch, compile=False)


def _args(out, steps: int, **kw):
    kw = {"save_strategy": "no", "learning_rate": 1e-2, **kw}
    return tf.TrainingArguments(output_dir=str(out), max_steps=steps, per_device_train_batch_size=2,
                                lr_scheduler_type="constant", logging_steps=1, report_to=[], use_cpu=True,
                                disable_tqdm=True, dataloader_num_workers=0, seed=0, **kw)


def _adapter(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def test_save_model_writes_the_adapter_that_peft_loads(tmp_path):
    pm = _lora()
    start = _adapter(pm)
    trainer = AutoprecTrainer(model=_apply(pm), args=_args(tmp_path / "run", 4), train_dataset=_data())
    trainer.train()
    trained = _adapter(pm)
    assert trained and not any(torch.equal(trained[n], start[n]) for n in trained)  # every adapter trained

    out = tmp_path / "saved"
    trainer.save_model(str(out))
    stock = tmp_path / "stock"  # what transformers' Trainer writes for the same peft model
    tf.Trainer(model=_lora(), args=_args(tmp_path / "stock_run", 1)).save_model(str(stock))
    assert sorted(os.listdir(out)) == sorted(os.listdir(stock))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(out))
    assert "model.safetensors" not in os.listdir(out)

    loaded = peft.PeftModel.from_pretrained(_base(), str(out))
    got = _adapter(loaded)
    assert got.keys() == trained.keys()
    for n in trained:
        assert torch.equal(got[n], trained[n]), n
    ids = _data()[0]["input_ids"][None]
    pm.eval()
    torch.testing.assert_close(loaded(input_ids=ids).logits, pm(input_ids=ids).logits, rtol=0, atol=0)


def test_resume_from_an_adapter_checkpoint_ends_as_the_uninterrupted_run(tmp_path):
    pm = _lora()
    full = AutoprecTrainer(model=_apply(pm), train_dataset=_data(),
                           args=_args(tmp_path / "full", 4, save_strategy="steps", save_steps=2))
    full.train()
    ckpt = tmp_path / "full" / "checkpoint-2"
    assert {"adapter_model.safetensors", "adapter_config.json", "scaler.pt"} <= set(os.listdir(ckpt))
    assert "model.safetensors" not in os.listdir(ckpt)

    pm2 = _lora()
    resumed = AutoprecTrainer(model=_apply(pm2), train_dataset=_data(),
                              args=_args(tmp_path / "resumed", 4, save_strategy="steps", save_steps=2))
    resumed.train(resume_from_checkpoint=str(ckpt))

    def losses(trainer):  # steps 3 and 4 (the resumed history holds the checkpoint's steps 1-2 too)
        return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h and h["step"] > 2}

    assert losses(resumed) == losses(full) and len(losses(full)) == 2
    want, got = _adapter(pm), _adapter(pm2)
    for n in want:
        assert torch.equal(got[n], want[n]), n
    assert resumed.loss_scaler.state_dict() == full.loss_scaler.state_dict()


def test_load_best_model_at_end_loads_the_best_adapter(tmp_path):
    from safetensors.torch import load_file

    pm = _lora()
    # "best" = the highest eval loss: an early checkpoint while training lowers the loss, so loading it
    # changes the adapter the run ended with
    trainer = AutoprecTrainer(model=_apply(pm), train_dataset=_data(), eval_dataset=_data()[:4],
                              args=_args(tmp_path / "run", 6, save_strategy="steps", save_steps=2,
                                         eval_strategy="steps", eval_steps=2, load_best_model_at_end=True,
                                         metric_for_best_model="loss", greater_is_better=True))
    trainer.train()
    evals = {h["step"]: h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h}
    assert sorted(evals) == [2, 4, 6] and evals[6] < evals[2]
    best = trainer.state.best_model_checkpoint
    assert best.endswith(f"checkpoint-{max(evals, key=evals.get)}") and not best.endswith("checkpoint-6")

    def adapter_file(ckpt):  # peft's keys: '...lora_A.weight' for the Parameter '...lora_A.default.weight'
        return load_file(os.path.join(ckpt, "adapter_model.safetensors"))

    saved, last, got = adapter_file(best), adapter_file(tmp_path / "run" / "checkpoint-6"), _adapter(pm)
    assert len(saved) == len(got) > 0
    for n, p in got.items():
        assert torch.equal(p, saved[n.replace(".default", "")]), n
    assert any(not torch.equal(saved[k], last[k]) for k in saved)
