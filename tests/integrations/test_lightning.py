"""Lightning: ``Trainer(plugins=[AutoprecPrecision(policy)])`` trains a tiny Qwen2 under a policy,
and a run resumed from a Lightning checkpoint is bit-identical to an uninterrupted one (issue 13,
Done-when 2): weights, optimizer, loss-scaler and RNG states all come back."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

L = pytest.importorskip("lightning")
tf = pytest.importorskip("transformers")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from autoprec import AutoprecError, LossScalingConfig, Policy  # noqa: E402
from autoprec.integrations.lightning import AutoprecPrecision  # noqa: E402
from autoprec.training.train import make_scaler  # noqa: E402

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


def _fit(policy: Policy, steps: int, ckpt_path=None, save_dir=None) -> tuple[LitLM, AutoprecPrecision]:
    """Train ``steps`` optimizer steps in total, from ``ckpt_path`` if given; with ``save_dir``, a
    ``ModelCheckpoint`` there writes ``epoch=0-step=20.ckpt`` after step 20 (``on_train_batch_end``)."""
    torch.manual_seed(0)
    lit = LitLM()
    if ckpt_path is not None:
        torch.manual_seed(1234)  # the resumed run must take its RNG state from the checkpoint
    plugin = AutoprecPrecision(policy, compile=False)
    saving = [ModelCheckpoint(dirpath=save_dir, every_n_train_steps=EPOCH, save_top_k=-1)] if save_dir else []
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, plugins=[plugin], logger=False,
                        enable_checkpointing=bool(saving), callbacks=saving, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(lit, _loader(), ckpt_path=ckpt_path)
    return lit, plugin


def _fp16_policy() -> Policy:
    """fp16 policy whose scaler grows every 3 clean steps (by step 20 it has grown and backed off)."""
    return dataclasses.replace(Policy.default(low="fp16"), loss_scaling=LossScalingConfig(growth_interval=3))


@pytest.mark.parametrize("policy", [Policy.default(low="bf16"), _fp16_policy()], ids=["bf16", "fp16"])
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")  # the resumed run's
def test_resumed_run_is_bit_identical(policy, tmp_path):
    """An uninterrupted 23-step run saves a checkpoint after step 20 (the end of the first epoch,
    so a plain DataLoader resumes at the next batch); a fresh Trainer, module and plugin resumed
    from it (global RNG reseeded differently) repeat steps 21-23 bit for bit."""
    full, full_plugin = _fit(policy, EPOCH + 3, save_dir=tmp_path)
    ckpt = tmp_path / f"epoch=0-step={EPOCH}.ckpt"
    saved = torch.load(ckpt, weights_only=True)  # what Lightning wrote: plain tensors and numbers
    resumed, plugin = _fit(policy, EPOCH + 3, ckpt_path=ckpt, save_dir=tmp_path)  # same callbacks

    assert len(full.losses) == EPOCH + 3 and len(resumed.losses) == 3
    assert full.losses[0] > full.losses[-1]  # it trains
    for i, (a, b) in enumerate(zip(full.losses[EPOCH:], resumed.losses, strict=True)):
        assert torch.equal(a, b), f"resumed step {EPOCH + i}: loss {b.item()!r} vs uninterrupted {a.item()!r}"
    full_state, resumed_state = full.state_dict(), resumed.state_dict()
    assert full_state.keys() == resumed_state.keys() == saved["state_dict"].keys()  # the model's own keys
    for k, v in full_state.items():
        assert torch.equal(v, resumed_state[k]), k
    assert plugin.mp is not None and plugin.mp.policy is policy

    state = saved["AutoprecPrecision"]
    assert Policy.from_dict(json.loads(state["policy"])).training_key() == policy.training_key()
    assert plugin.state_dict()["scaler"] == full_plugin.state_dict()["scaler"]
    if policy.needs_loss_scaling:  # the scaler's state at step 20 is one a fresh scaler does not have
        assert state["scaler"]["scale"] != make_scaler(policy).get_scale()
        assert state["scaler"]["skipped_steps"] > 0
        assert plugin.loss_scale == full_plugin.loss_scale
        assert plugin.skipped_steps == full_plugin.skipped_steps
        with pytest.raises(AutoprecError, match="different policy"):
            AutoprecPrecision(Policy.default(low="bf16")).load_state_dict(state)
    else:
        assert state["scaler"] == {} and plugin.scaler is None


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


def test_lightning_refuses_a_precision_flag_beside_the_plugin():
    with pytest.raises(ValueError, match="Choose one"):
        L.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", logger=False,
                  plugins=[AutoprecPrecision(Policy.default(low="bf16"))])


def test_example_batch_fixes_the_capture():
    """The graph is captured on ``example_batch`` (moved to the model's device), not on the first
    call's batch: with dynamic dimensions that batch fixes the largest batch size."""
    ids = torch.randint(0, V, (2 * B, T), generator=torch.Generator().manual_seed(2))
    big = {"input_ids": ids, "labels": ids}
    small = {k: v[:B] for k, v in big.items()}
    plugin = AutoprecPrecision(Policy.default(low="bf16"), example_batch=big, compile=False)
    lit = plugin.convert_module(LitLM())
    assert torch.isfinite(lit.model(**small).loss) and torch.isfinite(lit.model(**big).loss)
    # the example's shape static, then one capture with dynamic dimensions for the batch of 2
    assert plugin.mp.shape_stats["captures"] == 2 and plugin.mp.shape_stats["recaptures"] == 1
    first_call = AutoprecPrecision(Policy.default(low="bf16"), compile=False)
    lit = first_call.convert_module(LitLM())
    lit.model(**small)  # captured on the first call's batch of 2: the batch of 4 is outside it
    assert torch.isfinite(lit.model(**big).loss)  # captured again, with the model's own forward
    assert first_call.mp.shape_stats.get("recaptures") == 1
