"""Capture errors name the real cause and what to do, one test per cause (issue 12, Done when 4).

Only a data-dependent branch gets the control-flow advice (torch.where / torch.cond); every other
failure names its own cause and says what to do instead.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoprec.capture import capture
from autoprec.errors import CaptureError


@torch.library.custom_op("autoprec_test::no_fake", mutates_args=())
def no_fake(x: torch.Tensor) -> torch.Tensor:
    """A custom op registered without a fake (meta) kernel: the tracer cannot run it."""
    return x.clone()


def _message(model: nn.Module, batch) -> str:
    with pytest.raises(CaptureError) as ei:
        capture(model, batch)
    msg = str(ei.value)
    assert "What to do:" in msg, msg
    return msg


def _no_control_flow_advice(msg: str) -> None:
    assert "torch.cond" not in msg and "torch.where" not in msg and "data-dependent" not in msg, msg


class Branchy(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x
        return -x


def test_data_dependent_branch_names_module_line_and_the_rewrite():
    msg = _message(Branchy(), (torch.randn(3),))
    assert "a data-dependent branch" in msg
    assert "test_capture_causes.py:" in msg and "if x.sum() > 0:" in msg and "(Branchy)" in msg
    assert "torch.where" in msg and "torch.cond" in msg


class Holder:
    """An unregistered class holding a tensor."""

    def __init__(self, t: torch.Tensor) -> None:
        self.state = t


class ReturnsHolder(nn.Module):
    def forward(self, x):
        return {"y": x * 2, "extra": [x, Holder(x + 1)]}


def test_output_type_that_cannot_be_flattened_names_type_and_field_path():
    msg = _message(ReturnsHolder(), (torch.randn(3),))
    assert "Holder" in msg and "output['extra'][1]" in msg and "Holder.state" in msg
    assert "register_pytree_node" in msg
    assert "use_cache" not in msg  # not a cache: no cache advice
    _no_control_flow_advice(msg)


class CustomOp(nn.Module):
    def forward(self, x):
        return no_fake(x) * 2


def test_unsupported_op_is_named_with_how_to_register_it():
    msg = _message(CustomOp(), (torch.randn(3),))
    assert "an unsupported op: autoprec_test::no_fake" in msg
    assert "torch.library.register_fake('autoprec_test::no_fake')" in msg
    _no_control_flow_advice(msg)


class ToNumpy(nn.Module):
    def forward(self, x):
        return torch.from_numpy(x.detach().numpy()) * 2


def test_tensor_data_leaving_torch_is_named():
    msg = _message(ToNumpy(), (torch.randn(3),))
    assert "Tensor.numpy()" in msg and "test_capture_causes.py:" in msg
    _no_control_flow_advice(msg)


class Raises(nn.Module):
    def forward(self, x):
        raise ValueError("labels must be given")


def test_an_error_of_the_model_code_itself_says_so():
    msg = _message(Raises(), (torch.randn(3),))
    assert "forward() itself raised ValueError" in msg and "labels must be given" in msg
    _no_control_flow_advice(msg)


class TakesIds(nn.Module):
    def forward(self, input_ids):
        return input_ids.float().sum()


def test_batch_that_does_not_match_forward_names_the_signature():
    msg = _message(TakesIds(), {"ids": torch.zeros(2, dtype=torch.long)})
    assert "does not match forward(input_ids)" in msg and "'ids'" in msg and "get_batch" in msg
    _no_control_flow_advice(msg)


class SliceByValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        k = int(y.argmax().item())
        return y[: k + 1].sum()


def test_value_used_as_a_size_is_not_called_a_branch():
    """`.item()` used as a slice bound raises the same torch error as an `if` on a tensor, but
    there is no branch: the message says what it is, without the control-flow advice."""
    msg = _message(SliceByValue(), (torch.randn(3, 4),))
    assert "a value read from a tensor (.item(), int(tensor)) used as a size or an index" in msg
    assert "k = int(y.argmax().item())" in msg and "torch._check" in msg
    assert ("torch.cond" not in msg and "an `if` on tensor values" not in msg
            and "a data-dependent branch" not in msg)


class _BatchNormNet(nn.Module):
    """A model written in the user's file around a BatchNorm with a cumulative average."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=None)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x))).mean((2, 3))


@pytest.mark.parametrize("own_class", [False, True])
def test_a_library_modules_own_data_dependent_line_names_the_module_and_its_option(own_class):
    """``BatchNorm2d(momentum=None)`` reads its batch counter with ``float()`` in torch's own forward:
    the message said "at unknown location" (stock modules only) or named the user's line calling it
    with advice on slicing (a model class of the user's), and advised rewriting forward(). It names
    the module, torch's line, the user's call, and the option to change."""
    model = _BatchNormNet() if own_class else nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=None), nn.Flatten())
    msg = _message(model.train(), torch.randn(2, 3, 8, 8))
    assert "unknown location" not in msg and "torch.cond" not in msg and "slicing" not in msg, msg
    assert "a value read from a tensor in a library module's own forward, at " in msg, msg
    assert "batchnorm.py" in msg, msg
    name = "bn" if own_class else "1"
    assert (f"float(self.num_batches_tracked) [in module '{name}' (BatchNorm2d)], in the library's code, not "
            "the model's file") in msg, msg
    called = "(called from " in msg and "test_capture_causes.py:" in msg
    assert called if own_class else "called from" not in msg, msg
    assert "a momentum such as the default 0.1" in msg, msg


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_a_model_not_in_fp32_is_refused_naming_its_first_parameter(dtype):
    """``model.half()`` (or a checkpoint loaded in its saved bf16) before apply trained low-precision
    weights without fp32 master weights or a loss scaler, silently; float64 failed in a pass with an
    unknown-dtype error. Refused before the export, naming the parameter, its dtype and the fix."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).to(dtype)
    with pytest.raises(CaptureError, match=rf"Sequential: parameter '0.weight' is {dtype} \(and 3 more not "
                                           r"fp32\); autoprec captures an fp32 model.*model\.float\(\)"):
        capture(model, torch.randn(3, 4, dtype=dtype))
    half_head = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    half_head[1].to(dtype)
    with pytest.raises(CaptureError, match=rf"parameter '1.weight' is {dtype} \(and 1 more not fp32\)"):
        capture(half_head, torch.randn(3, 4))


def test_a_model_that_fails_eagerly_is_named_as_the_cause_not_export():
    """A forward that raises on the batch in plain PyTorch (here labels of another length than the
    output; a T5 given non-contiguous labels fails its ``labels.view(-1)`` alike) was reported as
    "torch.export cannot trace this code" with export's message; now the eager error is the cause,
    at the model's line, and the RNG is untouched."""
    class ViewsLabels(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.drop = nn.Dropout(0.5)

        def forward(self, x, labels):
            y = self.drop(self.lin(x))
            return ((y.view(-1) - labels.view(-1)) ** 2).mean()

    batch = {"x": torch.randn(4, 2, 8), "labels": torch.randn(4, 2, 7)}
    torch.manual_seed(3)
    before = torch.rand(1)
    torch.manual_seed(3)
    with pytest.raises(CaptureError) as ei:
        capture(ViewsLabels(), batch)
    msg = str(ei.value)
    assert msg.startswith("autoprec could not capture ViewsLabels: forward() itself raised RuntimeError "
                          "on the example batch, without autoprec or torch.export"), msg
    assert "labels.view(-1)" in msg and "RuntimeError: The size of tensor a (64) must match" in msg
    assert "torch.export cannot trace" not in msg
    torch.manual_seed(3)
    assert torch.equal(torch.rand(1), before)


def test_a_moe_model_with_eager_experts_is_told_the_experts_implementation_that_captures():
    """transformers' ``experts_implementation="eager"`` loops over the experts the tokens were routed
    to (a data-dependent count): the error says so and names the default implementation, which
    captures (tests/capture/test_archs.py, qwen2_moe)."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_local_experts=4,
                           num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, use_cache=False, experts_implementation="eager")
    ids = torch.randint(0, 64, (2, 8))
    msg = _message(tf.MixtralForCausalLM(cfg).train(), {"input_ids": ids, "labels": ids})
    assert "MixtralExperts" in msg and "experts_implementation='eager'" in msg, msg
    assert "no experts_implementation argument; 'grouped_mm' or 'batched_mm'" in msg, msg


def test_layerdrop_is_named_and_no_experts_are_blamed_for_a_model_without_them():
    """A Wav2Vec2 (transformers 5 sets ``experts_implementation`` on it too) was told to change its
    experts implementation; the branch was LayerDrop's (``torch.rand([]) < layerdrop``)."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Wav2Vec2Config(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, layerdrop=0.1,
                            num_labels=3)
    audio = torch.randn(2, 1600)
    msg = _message(tf.Wav2Vec2ForSequenceClassification(cfg).train(),
                   {"input_values": audio, "labels": torch.tensor([0, 2])})
    assert "LayerDrop (layerdrop=0.1)" in msg and "build it with layerdrop=0.0" in msg, msg
    assert "experts" not in msg, msg
