"""Case C07 at the applied module: an fp16 policy trained without loss scaling is refused on its
first backward (it used to train with flushed gradients, silently), while scaled training, bf16
policies and outputs without a loss are left alone."""

from __future__ import annotations

import pytest
import torch

import autoprec
from tests.nets import Block


def _applied(low: str):
    torch.manual_seed(0)
    model = Block()
    ids = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(1))
    return model, autoprec.apply(model, autoprec.Policy.default(low), ids, compile=False), ids


@pytest.mark.parametrize("divide", [1, 4])  # 4: gradient accumulation's loss / steps, unscaled still
def test_fp16_backward_through_an_unscaled_loss_is_refused_and_nothing_trains(divide):
    model, mp, ids = _applied("fp16")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as err:
        (mp(ids) / divide).backward()
    msg = str(err.value)
    assert msg.startswith("MixedPrecisionModule of Block: its policy computes in fp16, and backward reached "
                          f"its loss unscaled (d/d loss = {1 / divide:.3g})"), msg
    assert "case C07" in msg and "scaler = autoprec.make_scaler(mp.policy)" in msg
    assert "AutoprecTrainer" in msg
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_fp16_scaled_training_passes_and_is_checked_once():
    model, mp, ids = _applied("fp16")
    ref_model, _, _ = _applied("fp16")  # the same initial weights, trained in fp32 eager
    scaler = autoprec.make_scaler(mp.policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = mp(ids)
    scaler.scale(loss).backward()
    assert scaler.step(opt) is not False
    scaler.update()
    ref_model(ids).backward()
    torch.optim.SGD(ref_model.parameters(), lr=0.1).step()
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=2e-2, atol=2e-3, msg=name)  # fp16 compute, fp32 masters
    mp(ids).backward()  # checked once: a later backward (a scale backed off to 1, say) is not judged


def test_bf16_policy_and_outputs_without_a_loss_are_not_checked():
    _, mp, ids = _applied("bf16")
    mp(ids).backward()  # bf16 needs no loss scaling
    assert all(p.grad is not None for p in mp.parameters())

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(x)

    x = torch.randn(4, 8)
    lm = autoprec.apply(Logits(), autoprec.Policy.default("fp16"), x, compile=False)
    lm(x).pow(2).mean().backward()  # the loss is the caller's: its scaling cannot be seen, so no check
    with torch.no_grad():
        lm(x)


class TupleOut(torch.nn.Module):
    """x [B, 8] -> ``(loss, logits)`` as Hugging Face's ``return_dict=False``, or ``(logits, loss)``."""

    def __init__(self, loss_first: bool) -> None:
        super().__init__()
        self.fc, self.loss_first = torch.nn.Linear(8, 8), loss_first

    def forward(self, x):
        logits = self.fc(x)
        loss = logits.float().pow(2).mean()
        return (loss, logits) if self.loss_first else (logits, loss)


@pytest.mark.parametrize("loss_first", [True, False])
def test_a_tuple_output_holding_the_loss_is_checked_too(loss_first):
    """``return_dict=False`` gives ``(loss, logits)``: an unscaled fp16 backward through it trained
    silently (C07). Refused; a scaled one and a loss made from the logits outside are not."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    mp = autoprec.apply(TupleOut(loss_first), autoprec.Policy.default("fp16"), x, compile=False)
    k = 0 if loss_first else 1
    with pytest.raises(ValueError, match=r"backward reached its loss unscaled \(d/d loss = 1\)"):
        mp(x)[k].backward()
    mp2 = autoprec.apply(TupleOut(loss_first), autoprec.Policy.default("fp16"), x, compile=False)
    mp2(x)[1 - k].float().pow(2).mean().backward()  # a loss of the caller's: no hook reached, no check
    mp3 = autoprec.apply(TupleOut(loss_first), autoprec.Policy.default("fp16"), x, compile=False)
    autoprec.make_scaler(mp3.policy).scale(mp3(x)[k]).backward()
    assert all(p.grad is not None for p in mp3.parameters())
