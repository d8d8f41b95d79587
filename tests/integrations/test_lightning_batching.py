"""Issue 51: a policy's ``batching`` under Lightning's ``AutoprecPrecision`` plugin.

With micro-batch 2 and accumulation 2 and a ``Trainer`` at Lightning's default accumulation, ``fit``
sets ``accumulate_grad_batches=2`` (saying so), runs forwards of 2 examples and one optimizer step
per 2 of them, the steps ``TrainStep`` takes on the same micro-batches; a ``DataLoader`` or a
``Trainer`` that says otherwise is refused with the numbers; a policy without ``batching`` leaves
both as given. A tiny Qwen2 (no dropout), eager, on the CPU.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

L = pytest.importorskip("lightning")
tf = pytest.importorskip("transformers")

from lightning.pytorch.callbacks import GradientAccumulationScheduler  # noqa: E402

import autoprec  # noqa: E402
from autoprec.integrations.lightning import AutoprecPrecision  # noqa: E402
from autoprec.modelspec.micro_batches import Accumulated  # noqa: E402
from autoprec.policy import Batching, Policy  # noqa: E402
from autoprec.training.train import TrainStep  # noqa: E402

V, T, LR = 128, 16, 1e-3
POLICY = dataclasses.replace(Policy.default("bf16"), batching=Batching(micro_batch=2, accumulation=2))
FIELDS = (r"batching.micro_batch=2, batching.accumulation=2 "
          r"\(micro-batch 2 x 2 accumulated \(global batch 4\)\)")


def _qwen2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = tf.Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return tf.Qwen2ForCausalLM(cfg).train()


class LitLM(L.LightningModule):
    """The tiny Qwen2 as ``self.model``; records the examples of each training batch (``rows``), its
    loss, and how many batches had run at each optimizer step (``at_step``)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _qwen2()
        self.rows: list[int] = []
        self.losses: list[float] = []
        self.at_step: list[int] = []

    def training_step(self, batch, batch_idx):
        self.rows.append(int(batch["input_ids"].shape[0]))
        loss = self.model(**batch).loss
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.0)
        opt.register_step_post_hook(lambda o, a, kw: self.at_step.append(len(self.rows)))
        return opt


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    """``n`` examples ``{"input_ids", "labels"}`` (T int64 each), deterministic."""
    ids = torch.randint(0, V, (n, T), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": x, "labels": x} for x in ids]


def _fit(policy: Policy, batch_size: int, steps: int, lit: LitLM | None = None, **trainer_kw) -> tuple:
    lit = lit if lit is not None else LitLM()
    loader = torch.utils.data.DataLoader(_batches(16), batch_size=batch_size)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        plugins=[AutoprecPrecision(policy, compile=False)], **trainer_kw)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(lit, loader)
    return lit, trainer, [str(w.message) for w in seen if str(w.message).startswith("autoprec:")]


def test_fit_runs_micro_batches_of_2_and_steps_once_per_2():
    lit, trainer, said = _fit(POLICY, batch_size=2, steps=3)
    assert trainer.accumulate_grad_batches == 2
    assert len(said) == 1 and said[0].startswith(
        "autoprec: Trainer(accumulate_grad_batches=1), Lightning's default, set to 2: the policy file says "
        "batching.micro_batch=2")
    assert lit.rows == [2] * 6 and lit.at_step == [2, 4, 6] and trainer.global_step == 3

    # the same steps as TrainStep accumulating the same micro-batches (each loss / 2, one step)
    ref_model = _qwen2()
    data = torch.utils.data.default_collate(_batches(12))
    parts = [{k: v[2 * j:2 * j + 2] for k, v in data.items()} for j in range(6)]
    ref_mp = autoprec.apply(ref_model, POLICY, parts[0], compile=False)
    params = list(ref_model.parameters())
    step = TrainStep(ref_mp, params, torch.optim.AdamW(params, lr=LR, weight_decay=0.0),
                     lambda out, b: out.loss)
    ref = [step(Accumulated(tuple(parts[2 * i:2 * i + 2]))) for i in range(3)]
    got = [(a + b) / 2 for a, b in zip(lit.losses[::2], lit.losses[1::2], strict=True)]
    torch.testing.assert_close(got, [st.loss for st in ref], rtol=1e-5, atol=1e-6)
    for (name, p), want in zip(lit.model.named_parameters(), params, strict=True):
        torch.testing.assert_close(p, want, rtol=1e-5, atol=1e-6, msg=name)

    # a Trainer that says accumulate_grad_batches=2 itself: nothing to say
    _, trainer, said = _fit(POLICY, batch_size=2, steps=1, accumulate_grad_batches=2)
    assert said == [] and trainer.accumulate_grad_batches == 2


def test_a_dataloader_of_another_batch_size_is_refused_at_the_first_step():
    lit = LitLM()
    before = {k: v.clone() for k, v in lit.state_dict().items()}
    with pytest.raises(ValueError, match=r"AutoprecPrecision: training batch 1 has 4 examples \(its leading "
                                         r"dimension\), not the policy's micro-batch of 2: the policy file "
                                         rf"says {FIELDS}, and the training DataLoader .* build the "
                                         r"DataLoader with batch_size=2"):
        _fit(POLICY, batch_size=4, steps=1, lit=lit, accumulate_grad_batches=2)
    assert all(torch.equal(v, before[k]) for k, v in lit.state_dict().items())  # no step taken


@pytest.mark.parametrize("trainer_kw, message", [
    ({"accumulate_grad_batches": 3}, r"Trainer\(accumulate_grad_batches=3\) accumulates otherwise than the "
                                     rf"policy: the policy file says {FIELDS}; pass "
                                     r"Trainer\(accumulate_grad_batches=2\)"),
    ({"callbacks": [GradientAccumulationScheduler({0: 2})]},
     rf"GradientAccumulationScheduler callback .* \({FIELDS}\): remove the callback"),
], ids=["accumulate_grad_batches", "scheduler"])
def test_a_trainer_that_accumulates_otherwise_is_refused(trainer_kw, message):
    lit = LitLM()
    with pytest.raises(ValueError, match=message):
        _fit(POLICY, batch_size=2, steps=1, lit=lit, **trainer_kw)
    assert lit.rows == []  # refused when fit starts


def test_a_policy_without_batching_leaves_the_trainer_and_the_batches_as_given():
    lit, trainer, said = _fit(Policy.default("bf16"), batch_size=4, steps=1, accumulate_grad_batches=3)
    assert said == [] and trainer.accumulate_grad_batches == 3
    assert lit.rows == [4, 4, 4] and lit.at_step == [3]


class ManualLM(LitLM):
    """Manual optimization: one optimizer step per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        self.manual_backward(super().training_step(batch, batch_idx))
        opt.step()
        opt.zero_grad()


def test_manual_optimization_is_told_it_must_accumulate_itself():
    lit, trainer, said = _fit(POLICY, batch_size=2, steps=1, lit=ManualLM())
    assert trainer.accumulate_grad_batches == 1 and lit.rows == [2]
    assert len(said) == 1 and "uses manual optimization" in said[0]
    assert "must call optimizer.step() once per 2 micro-batches of 2" in said[0]
