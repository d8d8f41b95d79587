"""Train and eval modes of an applied module (docs/architecture.md#runtime): the capture traces
the training graph whatever mode the model is in, the module runs it in training mode only, and in
eval mode a call is the model's own forward (fp32, dropout off), so evaluation is deterministic
and equals the model's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autoprec
from autoprec.policy import Policy
from autoprec.randomness import random_nodes


class DropNet(nn.Module):
    """x [B, 16] fp32 -> Linear(16, 32) -> tanh -> Dropout(0.5) -> Linear(32, 4) -> [B, 4]."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.drop, self.b = nn.Linear(16, 32), nn.Dropout(0.5), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.tanh(self.a(x))))


def _seeded(fn, x: torch.Tensor, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    with torch.no_grad():
        return fn(x)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_the_graph_is_the_training_graph_whatever_mode_the_model_is_applied_in(mode):
    """A model applied in eval mode (as ``from_pretrained`` returns it) gets the graph with its
    dropout, trains with the masks the model draws in training mode, and is switched to training
    mode with the module (one flag: ``ModelFacade.training``)."""
    torch.manual_seed(0)
    model, x = DropNet(), torch.randn(8, 16)
    getattr(model, mode)()
    mp = autoprec.apply(model, Policy.fp32(), x, compile=False, dynamic=False)
    assert mp.training and model.training and model.drop.training
    assert [n.name for n in random_nodes(mp.graph_module)] == ["dropout"]
    got = _seeded(mp, x, 1)
    model.train()
    torch.testing.assert_close(got, _seeded(model, x, 1), rtol=0, atol=0)  # same masks, same fp32 math
    assert not torch.equal(got, _seeded(mp, x, 2))


def test_eval_mode_is_the_models_own_forward_and_train_mode_the_graph_again():
    """``mp.eval()``: every call equals the model's eval forward exactly (no dropout, deterministic),
    for any batch shape; ``mp.train()`` sets both flags back and draws masks again."""
    torch.manual_seed(0)
    model, x = DropNet(), torch.randn(8, 16)
    mp = autoprec.apply(model, Policy.default("bf16"), x, compile=False, dynamic=False)
    assert mp.eval() is mp and not model.training
    with torch.no_grad():
        want = model(x)
        torch.testing.assert_close(mp(x), want, rtol=0, atol=0)
        torch.testing.assert_close(_seeded(mp, x, 3), want, rtol=0, atol=0)
        assert mp(torch.randn(3, 16)).shape == (3, 4)  # not the captured shape: the model's forward
    mp.train()
    assert mp.training and model.training
    train_out = _seeded(mp, x, 3)
    assert not torch.equal(train_out, want)
    assert ((train_out - want).abs() / want.abs().clamp_min(1e-3)).max() > 0.1  # dropout, not bf16 rounding
    with pytest.raises(ValueError, match=r"shape"):
        mp(torch.randn(3, 16))  # training mode: the captured shapes


def test_the_wrapped_models_train_and_eval_switch_the_module_too():
    """``model.eval()`` for validation left the module running the training graph (dropout on, the
    policy's dtypes); ``mp.eval(); model.train()`` left it running the model's own fp32 forward in
    training, without the policy. The module's mode is the wrapped model's: either call switches both."""
    torch.manual_seed(0)
    model, x = DropNet(), torch.randn(8, 16)
    mp = autoprec.apply(model, Policy.default("bf16"), x, compile=False, dynamic=False)
    model.eval()
    assert not mp.training
    with torch.no_grad():
        torch.testing.assert_close(_seeded(mp, x, 4), model(x), rtol=0, atol=0)  # no dropout: eval
    mp.eval()
    model.train()
    assert mp.training
    graph, own = _seeded(mp, x, 5), _seeded(model, x, 5)  # same dropout masks
    assert not torch.equal(graph, own)  # not the model's own fp32 forward: the bf16 graph ran
    torch.testing.assert_close(graph, own, rtol=5e-2, atol=5e-2)


def test_parameters_converted_after_apply_are_refused_at_the_next_training_call():
    """``model.to(torch.bfloat16)`` (or ``.half()``) on the wrapped model after apply kept the
    Parameter objects, so training went on with bf16 master weights, whose small updates round away
    (C08: 1.0 stayed 1.0 after 100 AdamW steps at lr 1e-4). Refused, naming the Parameter and
    ``model.float()``, which makes the module train again."""
    torch.manual_seed(0)
    model, x = DropNet(), torch.randn(8, 16)
    mp = autoprec.apply(model, Policy.default("bf16"), x, compile=False, dynamic=False)
    model.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"MixedPrecisionModule of DropNet: the model's Parameter "
                                         r"'a\.weight' is torch\.bfloat16 since autoprec\.apply "
                                         r"\(4 converted.*model\.float\(\)"):
        mp(x)
    model.float()
    mp(x).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_compiled_module_evaluates_with_the_models_forward():
    """The same rule for a compiled module: eval calls never reach the compiled graph (nothing is
    compiled), training calls do, with the masks the model draws (eager's random ops, the RNG rule)."""
    torch.manual_seed(0)
    model, x = DropNet(), torch.randn(8, 16)
    mp = autoprec.apply(model, Policy.fp32(), x, compile=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(mp(x), model(x), rtol=0, atol=0)
    assert mp.shape_stats["compiles"] == 0
    got = _seeded(mp.train(), x, 4)
    assert mp.shape_stats["compiles"] == 1
    torch.testing.assert_close(got, _seeded(model, x, 4), rtol=1e-5, atol=1e-6)


class FrozenNorm(nn.Module):
    """x [B, 16] -> Linear(16, 32) -> BatchNorm1d(32) -> relu -> Linear(32, 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.bn(self.a(x))))


def test_a_submodule_left_in_eval_mode_stays_so_in_the_graph_and_after_the_capture():
    """A frozen BatchNorm (the model in training mode, its norm in eval mode on purpose): the graph
    normalises with the running statistics and never updates them, as the model does, and every
    module's flag is what it was (``model.train(flag)`` after the capture would have reset it)."""
    torch.manual_seed(0)
    model, x = FrozenNorm(), torch.randn(8, 16)
    with torch.no_grad():
        model(torch.randn(64, 16) * 3 + 1)  # running statistics away from 0 and 1
    model.train()
    model.bn.eval()
    stats = model.bn.running_mean.clone()
    mp = autoprec.apply(model, Policy.fp32(), x, compile=False, dynamic=False)
    assert model.training and not model.bn.training
    with torch.no_grad():
        torch.testing.assert_close(mp(x), model(x), rtol=0, atol=0)
    assert torch.equal(model.bn.running_mean, stats)


@pytest.mark.parametrize("convert", ["half", "bfloat16", "double", "to_fp16"])
def test_a_dtype_conversion_of_the_module_is_refused_and_converts_nothing(convert):
    """``mp.half()`` / ``mp.to(torch.float16)`` after apply failed inside the graph with a mixed-dtype
    RuntimeError (and ``double()`` silently trained float64): refused, the Parameters left fp32;
    ``.to(device)`` and ``.float()`` still work."""
    torch.manual_seed(0)
    model, x = DropNet(), torch.randn(8, 16)
    mp = autoprec.apply(model, Policy.fp32(), x, compile=False, dynamic=False)
    call = (lambda: mp.to(torch.float16)) if convert == "to_fp16" else getattr(mp, convert)
    with pytest.raises(ValueError, match=r"MixedPrecisionModule of DropNet: this conversion would make the "
                                         r"model's Parameters torch\.\w+; they are the fp32 master weights"):
        call()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert mp.to("cpu") is mp and mp.float() is mp
    assert mp(x).dtype == torch.float32


def test_parameters_replaced_after_apply_are_refused_at_the_next_training_call():
    """``model.load_state_dict(..., assign=True)`` on the wrapped model left the graph training the
    old tensors (no gradient reached the new ones), silently; a replaced module (as
    ``resize_token_embeddings`` does) failed inside the graph. Both are refused naming the first
    Parameter, as is a Parameter given data of another shape (``resize_token_embeddings``); in-place
    loading (``mp.load_state_dict``) and eval calls go on, and a deep copy (an EMA copy) trains its
    own Parameters."""
    import copy

    torch.manual_seed(0)
    model, x = DropNet(), torch.randn(8, 16)
    mp = autoprec.apply(model, Policy.fp32(), x, compile=False, dynamic=False)
    twin = copy.deepcopy(mp)
    twin(x).sum().backward()
    assert all(p.grad is not None for p in twin.parameters())
    assert all(p.grad is None for p in model.parameters())
    mp.load_state_dict({k: v + 1 for k, v in model.state_dict().items()})  # in place: fine
    mp(x)
    model.load_state_dict(model.state_dict(), assign=True)
    with pytest.raises(ValueError, match=r"MixedPrecisionModule of DropNet: the model's Parameters changed "
                                         r"since autoprec\.apply \(a\.weight: .*assign=True"):
        mp(x)
    model2 = DropNet()
    mp2 = autoprec.apply(model2, Policy.fp32(), x, compile=False, dynamic=False)
    model2.b = nn.Linear(32, 4)
    with pytest.raises(ValueError, match=r"changed since autoprec\.apply \(b\.weight"):
        mp2(x)
    with torch.no_grad():
        torch.testing.assert_close(mp2.eval()(x), model2.eval()(x), rtol=0, atol=0)
    model3 = DropNet()
    mp3 = autoprec.apply(model3, Policy.fp32(), x, compile=False, dynamic=False)
    model3.b.weight.data = torch.zeros(4, 40)  # resize_token_embeddings' way: same object, other shape
    with pytest.raises(ValueError, match=r"changed since autoprec\.apply \(b\.weight"):
        mp3(x)


def test_pickling_the_module_is_refused_with_what_to_save_and_a_deep_copy_still_works(tmp_path):
    """``torch.save(mp)`` failed with a PicklingError about the per-signature class: refused saying
    to save the state dict; ``copy.deepcopy`` (an EMA copy) still gives an independent module
    whose outputs equal the original's."""
    import copy
    import pickle

    torch.manual_seed(0)
    model, x = DropNet(), torch.randn(8, 16)
    mp = autoprec.apply(model, Policy.fp32(), x, compile=False, dynamic=False)
    for save in (lambda: torch.save(mp, tmp_path / "mp.pt"), lambda: pickle.dumps(mp)):
        with pytest.raises(TypeError, match=r"MixedPrecisionModule of DropNet cannot be pickled .*"
                                            r"save mp\.state_dict\(\)"):
            save()
    ema = copy.deepcopy(mp)
    assert type(ema) is type(mp) and ema.model is not model and ema.graph_module is not mp.graph_module
    torch.testing.assert_close(_seeded(ema, x, 5), _seeded(mp, x, 5), rtol=0, atol=0)
    torch.save(mp.state_dict(), tmp_path / "sd.pt")


def test_a_submodule_switched_after_apply_warns_once_that_the_graph_keeps_its_captured_modes():
    """``model.drop.eval()`` after apply (no dropout in some layers) left the graph drawing that
    dropout's masks, silently: a training call warns once, naming the submodule and what to do."""
    torch.manual_seed(0)
    model, x = DropNet(), torch.randn(8, 16)
    mp = autoprec.apply(model, Policy.fp32(), x, compile=False, dynamic=False)
    mp(x)  # the captured modes: nothing to say
    model.drop.eval()
    with pytest.warns(UserWarning, match=r"MixedPrecisionModule of DropNet: 1 submodule\(s\) are in another "
                                         r"mode than the graph was captured with \('drop' is now in eval mode"
                                         r".*apply the policy again"):
        mp(x)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mp(x)  # once


def test_a_backward_through_an_eval_mode_call_warns_once_that_it_trains_without_the_policy():
    """``model.eval()`` to train without dropout (PPO/RLHF updates) trained the model's own fp32
    forward, silently: the first backward through an eval-mode call warns; evaluation under
    ``torch.no_grad`` and a forward without backward do not."""
    import warnings

    torch.manual_seed(0)
    model, x = DropNet(), torch.randn(8, 16)
    mp = autoprec.apply(model, Policy.default("bf16"), x, compile=False, dynamic=False)
    mp.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            mp(x)
        mp(x)  # no backward: nothing trained
    with pytest.warns(UserWarning, match=r"MixedPrecisionModule of DropNet: backward through a call in eval "
                                         r"mode, which is the model's own fp32 forward.*without the policy"):
        mp(x).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mp(x).sum().backward()  # once
