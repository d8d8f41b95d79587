"""Issue 51: a policy's ``batching`` under Hugging Face ``Trainer``.

``AutoprecTrainer`` with ``with_policy_batching(args, policy)`` (micro-batch 2, accumulation 2) runs
forwards of 2 examples and one optimizer step per 2 of them, and those steps are ``TrainStep``'s on
the same micro-batches (``Accumulated``); arguments or batches of another size are refused with the
numbers. A tiny Qwen2, eager, on the CPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autoprec
from autoprec.modelspec.micro_batches import Accumulated
from autoprec.policy import Batching, Policy
from autoprec.training.train import TrainStep

tf = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from autoprec.integrations.transformers import (  # noqa: E402
    AutoprecTrainer,
    check_batching,
    with_policy_batching,
)
from tests.integrations.test_hf_trainer import LR, PadToLongest, _dataset  # noqa: E402

POLICY = dataclasses.replace(Policy.default("bf16"), batching=Batching(micro_batch=2, accumulation=2))
FIELDS = (r"batching.micro_batch=2, batching.accumulation=2 "
          r"\(micro-batch 2 x 2 accumulated \(global batch 4\)\)")
#: What AutoprecTrainer says of any gradient accumulation (the per-micro-batch mean loss).
ACCUMULATION_NOTE = "ignore:autoprec. gradient_accumulation_steps=2:UserWarning"


def _applied(policy: Policy = POLICY) -> tuple[torch.nn.Module, autoprec.MixedPrecisionModule]:
    """A tiny Qwen2 (seed 0) and its module under ``policy``, captured on a batch of 2 (eager)."""
    torch.manual_seed(0)
    cfg = tf.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = tf.Qwen2ForCausalLM(cfg).train()
    example = PadToLongest()([_dataset()[2], _dataset()[6]])
    return model, autoprec.apply(model, policy, example, compile=False)


def _args(tmp_path, steps: int = 3, **kw):
    return tf.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=steps, report_to=[], use_cpu=True,
                                save_strategy="no", dataloader_num_workers=0, logging_steps=1,
                                lr_scheduler_type="constant", disable_tqdm=True, **kw)


@pytest.mark.filterwarnings(ACCUMULATION_NOTE)
def test_trainer_runs_micro_batches_of_2_and_steps_once_per_2(tmp_path):
    model, mp = _applied()
    rows: list[int] = []  # examples of each forward Trainer runs
    mp.register_forward_pre_hook(lambda m, a, kw: rows.append(int(kw["input_ids"].shape[0])),
                                 with_kwargs=True)
    opt = torch.optim.AdamW(mp.parameters(), lr=LR, weight_decay=0.0)
    at_step: list[int] = []  # forwards run when each optimizer step happened
    opt.register_step_post_hook(lambda o, a, kw: at_step.append(len(rows)))
    user_args = _args(tmp_path)
    args = with_policy_batching(user_args, POLICY)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 2)
    assert (user_args.per_device_train_batch_size, user_args.gradient_accumulation_steps) == (8, 1)  # a copy
    collate = PadToLongest()
    trainer = AutoprecTrainer(model=mp, args=args, train_dataset=_dataset(), data_collator=collate,
                              optimizers=(opt, None))
    trainer.train()
    assert rows == [2] * 6 and at_step == [2, 4, 6] and trainer.state.global_step == 3

    # the same steps as TrainStep accumulating the same micro-batches (each loss / 2, one step)
    ref_model, ref_mp = _applied()
    params = list(ref_model.parameters())
    step = TrainStep(ref_mp, params, torch.optim.AdamW(params, lr=LR, weight_decay=0.0),
                     lambda out, b: out.loss, max_grad_norm=1.0)  # Trainer's default max_grad_norm
    ref = [step(Accumulated(tuple(collate.batches[2 * i:2 * i + 2]))) for i in range(3)]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    torch.testing.assert_close(losses, [st.loss for st in ref], rtol=1e-4, atol=1e-5)
    for (name, got), want in zip(model.named_parameters(), params, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.filterwarnings(ACCUMULATION_NOTE)
def test_arguments_of_another_batch_are_refused_with_the_numbers(tmp_path, monkeypatch):
    _, mp = _applied()
    with pytest.raises(ValueError, match=r"TrainingArguments\(per_device_train_batch_size=4, "
                                         r"gradient_accumulation_steps=1\) train at another batch than the "
                                         rf"policy's: the policy file says {FIELDS}\. Pass "
                                         r"args=with_policy_batching\(args, policy\)"):
        AutoprecTrainer(model=mp, args=_args(tmp_path, per_device_train_batch_size=4))
    with pytest.raises(ValueError, match=r"per_device_train_batch_size=2, gradient_accumulation_steps=4\)"):
        check_batching(_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=4), POLICY)
    with pytest.raises(ValueError, match=rf"auto_find_batch_size=True\).*\({FIELDS}\)"):
        with_policy_batching(_args(tmp_path, auto_find_batch_size=True), POLICY)
    # no arguments: Trainer's defaults, at the policy's batch
    monkeypatch.chdir(tmp_path)
    args = AutoprecTrainer(model=mp).args
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 2)
    # a policy without batching: the arguments as given
    plain = _args(tmp_path, per_device_train_batch_size=4)
    assert with_policy_batching(plain, Policy.default("bf16")) is plain
    check_batching(plain, Policy.default("bf16"))


class _Doubled(PadToLongest):
    """A collator that repeats each batch: 4 examples where the DataLoader gave 2."""

    def __call__(self, features):
        return super().__call__(list(features) * 2)


@pytest.mark.filterwarnings(ACCUMULATION_NOTE)
def test_a_batch_of_another_size_is_refused_at_the_first_step(tmp_path):
    model, mp = _applied()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = AutoprecTrainer(model=mp, args=with_policy_batching(_args(tmp_path, steps=1), POLICY),
                              train_dataset=_dataset(), data_collator=_Doubled())
    with pytest.raises(ValueError, match=r"AutoprecTrainer: training batch 1 has 4 examples \(its leading "
                                         r"dimension\), not the policy's micro-batch of 2: the policy file "
                                         rf"says {FIELDS}, and the Trainer's train DataLoader"):
        trainer.train()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # no step taken
