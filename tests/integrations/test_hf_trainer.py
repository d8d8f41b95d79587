"""Hugging Face ``Trainer`` with a policy-applied model (issue 13, Done when 1).

A tiny Qwen2 (its config's defaults, tiny sizes) on a pad-to-longest collator over a small local
dataset of varying lengths: ``transformers.Trainer(model=autoprec.apply(...))`` trains it as it
is and its losses are ``autoprec train``'s on the same batches; ``AutoprecTrainer`` with an fp16
policy skips a step whose gradients are inf, logs ``loss_scale``/``skipped_steps``, and steps as
``TrainStep`` with the policy's scaler does; Trainer's own precision and checkpointing flags are
refused with a message. Everything eager (``compile=False``) on the CPU.
"""

from __future__ import annotations

import inspect
import math
import runpy
import textwrap
import warnings

import pytest
import torch

import autoprec
from autoprec.commands.train import train as autoprec_train
from autoprec.training.train import TrainStep, make_scaler

tf = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from autoprec.integrations.transformers import AutoprecTrainer  # noqa: E402

LR = 3e-3
MODEL_PY = textwrap.dedent(f'''
    """Tiny Qwen2 (config defaults, tiny sizes); step k's batch is the k-th one Trainer used."""
    import pathlib

    import torch
    import transformers as tf

    BATCHES = pathlib.Path(__file__).with_name("batches.pt")


    def build_model():
        torch.manual_seed(0)
        cfg = tf.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
        return tf.Qwen2ForCausalLM(cfg).train()


    def get_batch(step, device):
        return {{k: v.to(device) for k, v in torch.load(BATCHES)[step].items()}}


    def make_optimizer(params):
        return torch.optim.AdamW(params, lr={LR}, weight_decay=0.0)
''')

#: Sequence lengths of the local dataset (pad-to-longest batches of 2 vary in length).
LENGTHS = [12, 7, 16, 9, 14, 10, 16, 8]


def _dataset() -> list[dict[str, torch.Tensor]]:
    """Learnable token sequences (each token is the previous one + 3, mod 64), of varying lengths."""
    return [{"input_ids": (torch.arange(n) * 3 + i) % 64} for i, n in enumerate(LENGTHS)]


class PadToLongest:
    """Pads ``input_ids`` to the batch's longest (labels -100 and attention mask 0 on padding);
    keeps every batch it made in ``batches``."""

    def __init__(self) -> None:
        self.batches: list[dict[str, torch.Tensor]] = []

    def __call__(self, features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        t = max(len(f["input_ids"]) for f in features)
        ids = torch.zeros(len(features), t, dtype=torch.long)
        mask = torch.zeros(len(features), t, dtype=torch.long)
        for i, f in enumerate(features):
            ids[i, :len(f["input_ids"])] = f["input_ids"]
            mask[i, :len(f["input_ids"])] = 1
        batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
        self.batches.append(batch)
        return batch


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "qwen2_hf.py"
    path.write_text(MODEL_PY)
    return path


def _applied(model_file, low: str = "bf16"):
    """The model file's model and the module ``autoprec.apply`` makes of it (eager, dynamic)."""
    model = runpy.run_path(str(model_file))["build_model"]()
    example = PadToLongest()([_dataset()[2], _dataset()[6]])  # the longest batch
    return model, autoprec.apply(model, autoprec.Policy.default(low), example, compile=False)


def _args(tmp_path, steps: int = 20, **kw):
    return tf.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=steps,
                                per_device_train_batch_size=2, per_device_eval_batch_size=2,
                                report_to=[], use_cpu=True, save_strategy="no", dataloader_num_workers=0,
                                logging_steps=1, lr_scheduler_type="constant", disable_tqdm=True, **kw)


def _trainer(cls, mp, tmp_path, collate, steps: int = 20, callbacks=None, **kw):
    # what the model file's make_optimizer makes
    opt = torch.optim.AdamW(mp.parameters(), lr=LR, weight_decay=0.0)
    return cls(model=mp, args=_args(tmp_path, steps, **kw), train_dataset=_dataset(), data_collator=collate,
               optimizers=(opt, None), callbacks=callbacks)


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_plain_trainer_trains_and_matches_autoprec_train(model_file, tmp_path):
    model, mp = _applied(model_file)
    collate = PadToLongest()
    trainer = _trainer(tf.Trainer, mp, tmp_path, collate)  # max_grad_norm: Trainer's default 1.0
    trainer.train()
    losses = _losses(trainer)
    assert len(losses) == 20 and sum(losses[-5:]) < 0.85 * sum(losses[:5]), losses  # the loss falls
    assert len({tuple(b["input_ids"].shape) for b in collate.batches}) > 2  # pad-to-longest: lengths vary
    torch.save(collate.batches, tmp_path / "batches.pt")
    policy = tmp_path / "bf16.json"
    autoprec.Policy.default("bf16").save(policy)
    ref = autoprec_train(model_file, policy, steps=20, device="cpu", compile=False, quiet=True,
                         max_grad_norm=1.0)
    torch.testing.assert_close(losses, ref.losses, rtol=1e-4, atol=1e-5)


def test_module_presents_the_model_to_trainer(model_file, tmp_path):
    model, mp = _applied(model_file)
    assert inspect.signature(mp.forward) == inspect.signature(model.forward)
    assert (inspect.signature(type(mp).forward).parameters.keys()
            == inspect.signature(type(model).forward).parameters.keys())
    assert isinstance(mp, autoprec.MixedPrecisionModule) and type(mp).__name__ == "MixedPrecisionModule"
    assert mp.config is model.config and mp.main_input_name == "input_ids"
    assert mp._keys_to_ignore_on_save == model._keys_to_ignore_on_save
    assert not mp.supports_gradient_checkpointing and mp.accepts_loss_kwargs is False
    trainer = _trainer(tf.Trainer, mp, tmp_path, PadToLongest(), steps=2, weight_decay=0.1)
    assert trainer.label_names == ["labels"]
    # weight-decay groups as for the model itself (norms and biases excluded)
    assert sorted(trainer.get_decay_parameter_names(mp)) == sorted(trainer.get_decay_parameter_names(model))
    trainer.train()
    assert "eval_loss" in trainer.evaluate(_dataset()[:4])  # the label names make Trainer compute it
    # not a PreTrainedModel: model.safetensors only, the model's keys
    trainer.save_model(str(tmp_path / "plain"))
    mp.config.save_pretrained(str(tmp_path / "plain"))
    _assert_same_weights(tf.Qwen2ForCausalLM.from_pretrained(str(tmp_path / "plain")), model)
    _, mp2 = _applied(model_file)
    with torch.no_grad():
        next(mp2.parameters()).add_(1.0)
    AutoprecTrainer(model=mp2, args=_args(tmp_path)).save_model(str(tmp_path / "autoprec"))
    _assert_same_weights(tf.Qwen2ForCausalLM.from_pretrained(str(tmp_path / "autoprec")), mp2.model)


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0, msg=k)


class _Snapshots(tf.TrainerCallback):
    """The lm_head weight after each optimizer step."""

    def __init__(self, param: torch.nn.Parameter) -> None:
        self.param, self.after = param, []

    def on_step_end(self, args, state, control, **kwargs):
        self.after.append(self.param.detach().clone())


def _inject_inf(param: torch.nn.Parameter, at_call: int) -> None:
    """Make ``param``'s gradient inf in the ``at_call``-th backward pass (0-based)."""
    calls = [0]

    def hook(grad: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return torch.full_like(grad, float("inf")) if calls[0] - 1 == at_call else grad

    param.register_hook(hook)


def test_autoprec_trainer_fp16_skips_inf_step_and_logs_it(model_file, tmp_path):
    model, mp = _applied(model_file, "fp16")
    collate = PadToLongest()
    snaps = _Snapshots(model.lm_head.weight)
    trainer = _trainer(AutoprecTrainer, mp, tmp_path, collate, steps=6, callbacks=[snaps])
    _inject_inf(model.lm_head.weight, at_call=2)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    init = mp.policy.loss_scaling.init_scale
    assert [h["skipped_steps"] for h in logs] == [0, 0, 1, 1, 1, 1]
    assert [h["loss_scale"] for h in logs] == [init, init, init / 2, init / 2, init / 2, init / 2]
    assert all(h["grad_norm"] < 100 for i, h in enumerate(logs) if i != 2)  # measured after unscaling
    assert torch.equal(snaps.after[1], snaps.after[2]) and not torch.equal(snaps.after[2], snaps.after[3])
    assert trainer.loss_scaler.skipped_steps == 1
    # the same steps through TrainStep with the policy's scaler: same losses, same scale
    ref_model, ref_mp = _applied(model_file, "fp16")
    params = list(ref_model.parameters())
    step = TrainStep(ref_mp, params, torch.optim.AdamW(params, lr=LR, weight_decay=0.0),
                     lambda out, b: out.loss, scaler=make_scaler(ref_mp.policy), max_grad_norm=1.0)
    _inject_inf(ref_model.lm_head.weight, at_call=2)
    ref = [step(b) for b in collate.batches[:6]]  # the loader makes one batch ahead
    assert [st.skipped for st in ref] == [False, False, True, False, False, False]
    torch.testing.assert_close([h["loss"] for h in logs], [st.loss for st in ref], rtol=1e-5, atol=1e-6)
    assert step.scaler.state_dict() == trainer.loss_scaler.state_dict()


@pytest.mark.parametrize("flag", ["bf16", "fp16", "gradient_checkpointing", "activation_checkpointing"])
def test_autoprec_trainer_refuses_trainer_precision_flags(model_file, tmp_path, flag):
    _, mp = _applied(model_file, "fp16")
    with pytest.raises(ValueError, match=rf"\b{flag}=True\)"):
        AutoprecTrainer(model=mp, args=_args(tmp_path, **{flag: True}))


def test_autoprec_trainer_needs_an_applied_model(model_file, tmp_path):
    model, _ = _applied(model_file)
    with pytest.raises(TypeError, match="MixedPrecisionModule"):
        AutoprecTrainer(model=model, args=_args(tmp_path))


def test_plain_trainer_refuses_autocast_and_checkpointing_at_train(model_file, tmp_path):
    _, mp = _applied(model_file)
    with pytest.raises(ValueError, match=r"torch.autocast\('cpu'.*bf16=True"):
        _trainer(tf.Trainer, mp, tmp_path, PadToLongest(), steps=1, bf16=True).train()
    with pytest.raises(ValueError, match="gradient checkpointing cannot be switched on after autoprec.apply"):
        _trainer(tf.Trainer, mp, tmp_path, PadToLongest(), steps=1, gradient_checkpointing=True).train()


def test_evaluate_runs_without_dropout_and_training_with_it(tmp_path):
    """A GPT-2 at its config's dropout 0.1, in eval mode as ``from_pretrained`` returns it:
    ``Trainer.evaluate`` gives the mean of the model's own eval-mode losses on its two batches every
    time (eval mode is the model's own forward; a plain Trainer's differs, as GPT-2 accepts
    ``num_items_in_batch``), and a training forward is the model's own in training mode, dropout
    masks included (the capture traced the training graph)."""
    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    model = tf.GPT2LMHeadModel(cfg).eval()
    example = PadToLongest()([_dataset()[2], _dataset()[6]])
    mp = autoprec.apply(model, autoprec.Policy.fp32(), example, compile=False)
    assert mp.training and model.training  # applied in eval mode: switched to training, one flag
    model.eval()
    with torch.no_grad():
        mean = sum(float(model(**PadToLongest()(_dataset()[i:i + 2])).loss) for i in (0, 2)) / 2
    trainer = tf.Trainer(model=mp, args=_args(tmp_path, steps=1), data_collator=PadToLongest())
    losses = [trainer.evaluate(_dataset()[:4])["eval_loss"] for _ in range(2)]
    assert losses[0] == losses[1] == pytest.approx(mean, rel=1e-6)
    model.train()
    torch.manual_seed(5)
    want = model(**example).loss
    mp.train()
    torch.manual_seed(5)
    got = mp(**example).loss
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        assert abs(float(got) - float(model.eval()(**example).loss)) > 1e-4  # dropout was on


def test_plain_trainer_with_an_fp16_policy_is_refused_at_its_first_backward(model_file, tmp_path):
    """Case C07: the stock Trainer scales no loss; AutoprecTrainer (the test above) does."""
    model, mp = _applied(model_file, "fp16")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"in fp16, and backward reached its loss unscaled.*AutoprecTrainer"):
        _trainer(tf.Trainer, mp, tmp_path, PadToLongest(), steps=1).train()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # no step taken


def test_neftune_is_refused_and_label_smoothing_says_how_to_apply(model_file, tmp_path):
    """NEFTune's hook on the embedding module never runs in the graph; label smoothing makes Trainer
    call the model without labels, which a module captured with labels cannot take: the message
    says so, and a module applied without labels (it returns logits) trains with it."""
    model, mp = _applied(model_file, "bf16")
    with pytest.raises(ValueError, match=r"neftune_noise_alpha=5.0\): NEFTune adds its noise through a "
                                         r"forward hook on the input embedding module"):
        AutoprecTrainer(model=mp, args=_args(tmp_path, neftune_noise_alpha=5.0))
    with pytest.raises(TypeError, match=r"misses labels; the graph computes the loss from the labels the "
                                        r"example batch had: .*Hugging Face Trainer with "
                                        r"label_smoothing_factor > 0 or compute_loss_func\), apply the model "
                                        r"with an example batch without labels"):
        _trainer(AutoprecTrainer, mp, tmp_path, PadToLongest(), steps=1, label_smoothing_factor=0.1).train()
    example = {k: v for k, v in PadToLongest()([_dataset()[2], _dataset()[6]]).items() if k != "labels"}
    logits_mp = autoprec.apply(model, autoprec.Policy.fp32(), example, compile=False)
    trainer = _trainer(AutoprecTrainer, logits_mp, tmp_path, PadToLongest(), steps=2,
                       label_smoothing_factor=0.1)
    trainer.train()
    assert len(_losses(trainer)) == 2 and all(math.isfinite(x) for x in _losses(trainer))


class _NoLossKwargs(torch.nn.Module):
    """A model whose forward takes no ``**kwargs``: stock Trainer divides its loss by the accumulation
    steps, as AutoprecTrainer does."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(128, 8)

    def forward(self, input_ids, labels):
        logits = self.emb(input_ids).flatten(0, 1) @ self.emb.weight.T
        return {"loss": torch.nn.functional.cross_entropy(logits, labels.flatten())}


def test_gradient_accumulation_says_how_stock_trainer_differs_only_where_it_does(model_file, tmp_path):
    """Stock Trainer does not divide by the accumulation steps for a model whose forward takes
    ``**kwargs``; where that model's loss ignores ``num_items_in_batch`` (a user's
    BertForSequenceClassification) its loss and grad_norm were twice AutoprecTrainer's, which the
    warning explained by per-token weighting alone. It names both cases, and a model stock Trainer
    divides for is not warned about."""
    _, mp = _applied(model_file, "bf16")
    with pytest.warns(UserWarning, match=r"gradient_accumulation_steps=2: the policy's graph computes each "
                                         r"micro-batch's mean loss .* Stock Trainer passes Qwen2ForCausalLM "
                                         r"num_items_in_batch and does not divide by 2: .*token counts.*"
                                         r"logged loss and gradients are 2 times these"):
        AutoprecTrainer(model=mp, args=_args(tmp_path, gradient_accumulation_steps=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        AutoprecTrainer(model=mp, args=_args(tmp_path))  # no accumulation: no warning
        ids = torch.randint(0, 128, (2, 8))
        plain = autoprec.apply(_NoLossKwargs(), autoprec.Policy.fp32(), {"input_ids": ids, "labels": ids},
                               compile=False)
        AutoprecTrainer(model=plain, args=_args(tmp_path, gradient_accumulation_steps=2))
        peft = pytest.importorskip("peft")  # stock Trainer looks at a peft model's base model
        lora = peft.get_peft_model(_NoLossKwargs(), peft.LoraConfig(r=2, target_modules=["emb"]))
        batch = {"input_ids": ids, "labels": ids}
        wrapped = autoprec.apply(lora, autoprec.Policy.fp32(), batch, compile=False)
        AutoprecTrainer(model=wrapped, args=_args(tmp_path, gradient_accumulation_steps=2))
