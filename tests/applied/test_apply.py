"""autoprec.apply: drop-in module on the same Parameters; numerics of lowered graphs vs FP32."""

from __future__ import annotations

import math

import pytest
import torch

import autoprec
from autoprec.metrics import grad_rel_l2
from autoprec.passes.casts import is_inserted_cast
from autoprec.training.train import TrainStep, make_scaler
from tests.conftest import RTOL
from tests.nets import Block


def _grads(fn, model, ids):
    for p in model.parameters():
        p.grad = None
    loss = fn(ids)
    loss.backward()
    g = [p.grad.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return loss.detach(), g


@pytest.fixture
def model_and_batch():
    torch.manual_seed(0)
    return Block(), torch.randint(0, 100, (4, 16))


def test_apply_shares_parameters_and_state_dict(model_and_batch):
    model, ids = model_and_batch
    mp = autoprec.apply(model, autoprec.Policy.default(), ids, compile=False)
    assert [id(p) for p in mp.parameters()] == [id(p) for p in model.parameters()]
    assert list(mp.state_dict()) == list(model.state_dict())
    assert all(p.dtype == torch.float32 for p in mp.parameters())  # master weights stay fp32


def test_a_module_holding_the_applied_one_loads_its_own_state_dict(model_and_batch):
    """A user's model with a new head around the applied backbone (and DDP, such a parent): its own
    state_dict did not load back ("Unexpected key(s): inner.emb.weight, ..."), and with
    ``strict=False`` the backbone kept its weights while ``missing_keys`` was empty."""
    from torch import nn

    model, ids = model_and_batch

    class Head(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner, self.head = inner, nn.Linear(4, 2)

    saved = Head(autoprec.apply(model, autoprec.Policy.default("bf16"), ids, compile=False))
    sd = saved.state_dict()
    assert [k for k in sd if k.startswith("inner.")] == [f"inner.{k}" for k in model.state_dict()]
    torch.manual_seed(1)
    fresh = Block()
    mp = autoprec.apply(fresh, autoprec.Policy.default("bf16"), ids, compile=False)
    holder = Head(mp)
    assert not all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    result = holder.load_state_dict(sd)
    assert not result.missing_keys and not result.unexpected_keys
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    # the graph reads the loaded weights
    torch.testing.assert_close(mp(ids), saved.inner(ids), rtol=0, atol=0)
    first = next(iter(model.state_dict()))
    partial = {k: v for k, v in sd.items() if k != f"inner.{first}"} | {"inner.extra": torch.zeros(1)}

    def another() -> Head:
        return Head(autoprec.apply(Block(), autoprec.Policy.default("bf16"), ids, compile=False))

    result = another().load_state_dict(partial, strict=False)
    assert result.missing_keys == [f"inner.{first}"] and result.unexpected_keys == ["inner.extra"]
    with pytest.raises(RuntimeError, match=rf'Missing key\(s\) in state_dict: "inner\.{first}"'):
        another().load_state_dict(partial)
    with pytest.raises(ValueError, match="assign=True"):
        holder.load_state_dict(sd, assign=True)


class _CausalLM(torch.nn.Module):
    """A Llama-family ``ForCausalLM``'s layout: a child called ``model`` (the name of the applied
    module's own attribute for the wrapped model) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Sequential(torch.nn.Embedding(100, 16), torch.nn.Linear(16, 16))
        self.lm_head = torch.nn.Linear(16, 100)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(ids)).logsumexp(-1).mean()


@pytest.mark.parametrize("make", [Block, _CausalLM], ids=["block", "child-named-model"])
def test_torch_distributed_checkpoint_state_dict_helpers_reach_the_model(model_and_batch, make):
    """``get_state_dict``/``set_state_dict`` (torch.distributed.checkpoint.state_dict) walk each
    parameter's name attribute by attribute: they raised AttributeError on an applied module, and
    on a Qwen2ForCausalLM's (its child ``model`` resolved to the applied module's own ``model``)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    _, ids = model_and_batch
    torch.manual_seed(0)
    model = make()
    mp = autoprec.apply(model, autoprec.Policy.fp32(), ids, compile=False)
    opt = torch.optim.AdamW(mp.parameters(), lr=1e-2)
    mp(ids).sum().backward()
    opt.step()
    msd, osd = get_state_dict(mp, opt)
    assert list(msd) == list(model.state_dict())
    assert set(osd["state"]) == {n for n, _ in model.named_parameters()}
    torch.manual_seed(1)
    fresh = make()
    mp2 = autoprec.apply(fresh, autoprec.Policy.fp32(), ids, compile=False)
    opt2 = torch.optim.AdamW(mp2.parameters(), lr=1e-2)
    set_state_dict(mp2, opt2, model_state_dict=msd, optim_state_dict=osd)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    assert len(opt2.state) == len(opt.state)


def _double(x: torch.Tensor) -> None:
    x.mul_(2)


def _add_one(x: torch.Tensor) -> None:
    x += 1


def _zero_first_column(x: torch.Tensor) -> None:
    x[:, 0] = 0  # through a view: slice, then an in-place fill


def _copy_slice(x: torch.Tensor) -> None:
    x[:, :4].copy_(torch.zeros(4, 4))


def _slice_mul(x: torch.Tensor) -> None:
    x[:, 0].mul_(0)  # in place on a view: the caller's x changes too


@pytest.mark.parametrize("change", [_double, _add_one, _zero_first_column, _copy_slice, _slice_mul])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_forward_that_changes_its_input_in_place_changes_the_callers_tensor(compile, change):
    """``x.mul_(2)`` on a float batch tensor: eager doubles the caller's ``x``; a bf16 policy cast
    ``x`` first and doubled the copy, so the caller's tensor kept its values (an integer one's
    change was kept). The op, and any view it writes through, now computes in the input's dtype,
    with no cast between the input and the write."""
    from torch import nn

    from autoprec.nodemeta import read_meta

    class Changing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            change(x)
            return self.fc(x).pow(2).mean()

    torch.manual_seed(0)
    x, model = torch.randn(4, 8), Changing()
    mp = autoprec.apply(model, autoprec.Policy.default("bf16"), (x.clone(),), compile=compile)
    written = [n for n in mp.graph_module.graph.nodes if read_meta(n).decided_by == "written in place"]
    assert written and all(read_meta(n).dtype == "fp32" for n in written)
    mine, expected = x.clone(), x.clone()
    loss = mp(mine)
    change(expected)
    torch.testing.assert_close(mine, expected, rtol=0, atol=0)
    ref = model(x.clone())
    torch.testing.assert_close(loss, ref, rtol=RTOL[torch.bfloat16], atol=0)  # the fc still computes in bf16
    assert loss != ref  # ... in bf16


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_tensor_filled_slice_by_slice_is_read_after_the_fill(compile):
    """``z = torch.zeros(...); z[:, :8] = x`` (padding, a buffer built slice by slice) and a write
    into an intermediate (``e[:, :4] = 0``): the bf16 graph read a cast of ``z`` made before the
    fill, and computed on zeros without a word (loss 0.93753 against eager's 0.94216)."""
    from torch import nn

    class Padding(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.emb = nn.Linear(16, 4), nn.Linear(4, 16)
            self.register_buffer("base", torch.full((4, 16), 0.5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            z = torch.zeros(4, 16)
            z[:, :8] = x[:, :8]
            b = self.base.clone()
            b[:, 8:] = x[:, 8:]
            e = self.emb(x[:, :4])
            e[:, :4] = 0
            return (self.fc(z) + self.fc(b) + self.fc(e)).pow(2).mean()

    torch.manual_seed(0)
    x, model = torch.randn(4, 16), Padding()
    ref = model(x)
    got = autoprec.apply(model, autoprec.Policy.default("bf16"), (x,), compile=compile)(x)
    # bf16's rounding is ~1e-3 here; computing on the unfilled tensors was 5e-2 off
    torch.testing.assert_close(got, ref, rtol=RTOL[torch.bfloat16], atol=0)


def test_bf16_policy_drift_within_bf16_tolerance(model_and_batch):
    model, ids = model_and_batch
    ref_loss, ref = _grads(model, model, ids)
    mp = autoprec.apply(model, autoprec.Policy.default("bf16"), ids, compile=False)
    loss, g = _grads(mp, model, ids)
    assert loss.dtype == torch.float32
    drift = grad_rel_l2(g, ref)
    # bf16 keeps 8 mantissa bits (eps 2^-8 = 3.9e-3): lowered matmuls give errors of that order,
    # above fp32 round-off yet within torch.testing's bf16 rtol (RTOL[bfloat16], 1.6e-2).
    assert 1e-5 < drift < RTOL[torch.bfloat16]
    assert abs(loss - ref_loss) / ref_loss < RTOL[torch.bfloat16]
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in model.parameters())


def test_fp32_policy_is_exact(model_and_batch):
    model, ids = model_and_batch
    ref_loss, ref = _grads(model, model, ids)
    mp = autoprec.apply(model, autoprec.Policy.fp32(), ids, compile=False)
    assert mp.stats["casts"] == 0
    loss, g = _grads(mp, model, ids)
    assert grad_rel_l2(g, ref) < 1e-6
    assert not any(is_inserted_cast(n) for n in mp.graph_module.graph.nodes)


@pytest.mark.heavy
def test_compiled_graph_honours_policy(model_and_batch):
    """With emulated casts (what tune compiles and records) Inductor must not drop the casts:
    compiled output matches eager lowered output closely, and differs from FP32 by bf16-sized error.
    Without a say the policy compiles as torch.compile would (fp32 intermediates in fused kernels):
    its output is no further from FP32 than the policy's own rounding."""
    import dataclasses

    model, ids = model_and_batch
    policy = autoprec.Policy(default_dtype="bf16", rules=(autoprec.Rule(op_class="sensitive", dtype="fp32"),
                                                         autoprec.Rule(op_class="follow", dtype="bf16")))
    emulated = dataclasses.replace(policy, compile_options=autoprec.policy.REGIONAL_EMULATED)
    with torch.no_grad():
        ref = model(ids)
        eager = autoprec.apply(model, policy, ids, compile=False)(ids)
        compiled = autoprec.apply(model, emulated, ids, compile=True)(ids)
        as_torch_compile = autoprec.apply(model, policy, ids, compile=True)(ids)
    bf16_err = abs(float(eager) - float(ref))
    assert bf16_err > 1e-5  # the policy visibly changes the numerics
    assert abs(float(compiled) - float(eager)) < 0.25 * bf16_err + 1e-6
    assert abs(float(as_torch_compile) - float(ref)) < 2 * bf16_err


def test_scaler_skips_inf_step_params_bitwise_unchanged(model_and_batch):
    model, ids = model_and_batch
    policy = autoprec.Policy.default("fp16")
    mp = autoprec.apply(model, policy, ids, compile=False)
    params = list(model.parameters())
    scaler = make_scaler(policy)
    assert scaler is not None  # any fp16 node brings a dynamic loss scaler
    opt = torch.optim.AdamW(params, lr=1e-3)
    step = TrainStep(mp, params, opt, lambda out, batch: out, scaler=scaler)
    before = [p.detach().clone() for p in params]

    def poison(grad):
        return grad + math.inf

    h = model.fc1.weight.register_hook(poison)
    st = step(ids)
    h.remove()
    assert st.skipped and st.nonfinite_grads > 0
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    assert scaler.get_scale() == policy.loss_scaling.init_scale * policy.loss_scaling.backoff_factor
    st = step(ids)  # a clean step is applied
    assert not st.skipped
    assert any(not torch.equal(a, b) for a, b in zip(before, params))


def test_step_without_scaler_never_writes_nan(model_and_batch):
    model, ids = model_and_batch
    params = list(model.parameters())
    step = TrainStep(model, params, torch.optim.SGD(params, lr=0.1), lambda out, batch: out)
    before = [p.detach().clone() for p in params]
    h = model.head.weight.register_hook(lambda g: g * math.nan)
    st = step(ids)
    h.remove()
    assert st.skipped
    assert all(torch.equal(a, b) for a, b in zip(before, params))


def test_a_call_that_does_not_bind_to_the_example_batch_names_the_inputs():
    """A dict batch passed as one argument, or an evaluation call without the ``labels`` the graph
    was captured with, used to end in FX's bare ``forward() missing 2 required positional
    arguments``; the error names the captured inputs and the fix."""

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50)

        def forward(self, input_ids, attention_mask, labels):
            logits = self.head(self.emb(input_ids) * attention_mask[..., None])
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    torch.manual_seed(0)
    batch = {"input_ids": torch.randint(0, 50, (2, 6)), "attention_mask": torch.ones(2, 6),
             "labels": torch.randint(0, 50, (2, 6))}
    mp = autoprec.apply(LM(), autoprec.Policy.default("bf16"), batch, compile=False)
    assert torch.isfinite(mp(**batch))
    inputs = "captured on the inputs input_ids, attention_mask, labels"
    with pytest.raises(TypeError, match=f"{inputs} .* as one argument; call it as module\\(\\*\\*batch\\)"):
        mp(batch)
    with pytest.raises(TypeError, match=f"{inputs} .*and this call misses labels; the graph computes the "
                                        "loss from the labels the example batch had: pass the batch's"):
        mp(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    with pytest.raises(TypeError, match="and this call gives extra: apply the policy with an example batch "
                                        "that holds extra as the training batches do"):
        mp(**batch, extra=1)


def test_get_submodule_and_get_parameter_resolve_the_names_the_module_lists():
    """``named_modules()``/``named_parameters()`` give the wrapped model's names; torch's
    ``get_submodule`` walked the module's attributes, where ``model`` is the whole wrapped model, and
    31 of 32 names of a Qwen2 failed (``get_submodule("model")`` returned the ``Qwen2ForCausalLM``)."""
    from tests.nets import qwen2_batch, tiny_qwen2

    model = tiny_qwen2()
    mp = autoprec.apply(model, autoprec.Policy.fp32(), qwen2_batch(), compile=False)
    inner = dict(model.named_modules())
    names = [n for n, _ in mp.named_modules()]
    assert len(names) > 20 and mp.get_submodule("") is mp
    assert all(mp.get_submodule(n) is inner[n] for n in names if n)
    assert mp.get_submodule("model") is model.model
    assert all(mp.get_parameter(n) is p for n, p in mp.named_parameters())
    with pytest.raises(AttributeError):
        mp.get_submodule("model.layers.9")
