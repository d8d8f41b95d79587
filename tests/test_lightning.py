"""Lightning: ``Trainer(plugins=[AutoprecPrecision(policy)])`` trains a tiny Qwen2 under a policy,
and a run resumed from a Lightning checkpoint is bit-identical to an uninterrupted one (issue 13,
Done-when 2): weights, optimizer, loss-scaler and RNG states all come back."""

from __future__ import annotations

import dataclasses

import pytest
import torch

L = pytest.importorskip("lightning")
tf = pytest.importorskip("transformers")

from autoprec import AutoprecError, LossScalingConfig, Policy  # noqa: E402
from autoprec.integrations.lightning import AutoprecPrecision  # noqa: E402

V, T, B, EPOCH = 128, 16, 2, 20  # vocab, sequence length, batch size, batches per epoch


class LitLM(L.LightningModule):
    """A tiny Qwen2 (attention dropout on, so the RNG state matters) as ``self.model``."""

    def __init__(self) -> None:
        super().__init__()
        cfg = tf.Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             attention_dropout=0.1)
        self.model = tf.Qwen2ForCausalLM(cfg)
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _loader() -> torch.utils.data.DataLoader:
    """EPOCH deterministic batches of ``{"input_ids", "labels"}`` (B x T int64), not shuffled."""
    ids = torch.randint(0, V, (EPOCH * B, T), generator=torch.Generator().manual_seed(1))
    return torch.utils.data.DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=B)


class SaveAt(L.Callback):
    """``trainer.save_checkpoint(path)`` after optimizer step ``step`` (where ``ModelCheckpoint(
    every_n_train_steps=step)`` saves: a checkpoint saved after ``fit`` returned resumes the finished
    epoch once more, one written in ``on_train_batch_end`` starts the next epoch)."""

    def __init__(self, path, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _fit(policy: Policy, steps: int, ckpt_path=None, save=None) -> tuple[LitLM, AutoprecPrecision]:
    """Train ``steps`` optimizer steps in total (from ``ckpt_path`` if given; saving to ``save`` at the end)."""
    torch.manual_seed(0)
    lit = LitLM()
    if ckpt_path is not None:
        torch.manual_seed(1234)  # the resumed run must take its RNG state from the checkpoint
    plugin = AutoprecPrecision(policy, compile=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, plugins=[plugin], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[SaveAt(save, steps)] if save is not None else [])
    trainer.fit(lit, _loader(), ckpt_path=ckpt_path)
    return lit, plugin


def _fp16_policy() -> Policy:
    """fp16 policy whose scaler grows every 3 clean steps: at step 20 its growth tracker is not 0."""
    return dataclasses.replace(Policy.default(low="fp16"), loss_scaling=LossScalingConfig(growth_interval=3))


@pytest.mark.parametrize("policy", [Policy.default(low="bf16"), _fp16_policy()], ids=["bf16", "fp16"])
def test_resumed_run_is_bit_identical(policy, tmp_path):
    full, full_plugin = _fit(policy, EPOCH + 3)
    first, _ = _fit(policy, EPOCH, save=tmp_path / "ckpt")
    resumed, plugin = _fit(policy, EPOCH + 3, ckpt_path=tmp_path / "ckpt")

    assert len(full.losses) == EPOCH + 3 and len(first.losses) == EPOCH and len(resumed.losses) == 3
    assert full.losses[0] > full.losses[-1]  # it trains
    for a, b in zip(full.losses[:EPOCH], first.losses, strict=True):
        assert torch.equal(a, b)
    for i, (a, b) in enumerate(zip(full.losses[EPOCH:], resumed.losses, strict=True)):
        assert torch.equal(a, b), f"resumed step {EPOCH + i}: loss {b.item()!r} vs uninterrupted {a.item()!r}"
    full_state, resumed_state = full.state_dict(), resumed.state_dict()
    assert full_state.keys() == resumed_state.keys()
    for k, v in full_state.items():
        assert torch.equal(v, resumed_state[k]), k
    assert plugin.state_dict()["scaler"] == full_plugin.state_dict()["scaler"]
    assert plugin.mp is not None and plugin.mp.policy is policy


def test_checkpoint_holds_the_models_keys_the_scaler_and_the_policy(tmp_path):
    policy = _fp16_policy()
    lit, plugin = _fit(policy, 4, save=tmp_path / "ckpt")
    ck = torch.load(tmp_path / "ckpt", weights_only=True)
    assert set(ck["state_dict"]) == set(LitLM().state_dict())  # the model's own keys, nothing of autoprec
    saved = ck["AutoprecPrecision"]
    assert saved["scaler"] == plugin.scaler.state_dict()
    assert saved["scaler"]["_growth_tracker"] == 4 % 3 or saved["scaler"]["skipped_steps"] > 0
    assert Policy.from_dict(__import__("json").loads(saved["policy"])).training_key() == policy.training_key()
    assert plugin.loss_scale == saved["scaler"]["scale"] and plugin.skipped_steps == saved["scaler"]["skipped_steps"]

    other = AutoprecPrecision(Policy.default(low="bf16"))
    with pytest.raises(AutoprecError, match="different policy"):
        other.load_state_dict(saved)


def test_bf16_policy_has_no_scaler_and_eval_runs_the_models_forward():
    plugin = AutoprecPrecision(Policy.default(low="bf16"), compile=False)
    assert plugin.scaler is None and plugin.loss_scale == 1.0
    lit = LitLM()
    assert plugin.convert_module(lit) is lit and plugin.convert_module(lit) is lit  # idempotent
    batch = next(iter(_loader()))
    lit.eval()
    with torch.no_grad():
        ref = tf.Qwen2ForCausalLM.forward(lit.model, **batch).loss
        assert torch.equal(lit.model(**batch).loss, ref)
    assert plugin.mp is None  # nothing captured for eval
    lit.train()
    lit.model(**batch).loss.backward()
    assert plugin.mp is not None and plugin.mp.model is lit.model
    assert all(p.grad is not None and p.dtype == torch.float32 for p in lit.parameters())
    with pytest.raises(ValueError, match="positional and keyword"):
        lit.model(batch["input_ids"], labels=batch["labels"])


def test_a_missing_inner_module_is_named():
    with pytest.raises(AutoprecError, match="no submodule 'net'"):
        AutoprecPrecision(Policy.fp32(), module="net").convert_module(LitLM())
