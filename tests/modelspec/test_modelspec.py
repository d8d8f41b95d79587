"""Tests for autoprec.modelspec and the two example model files."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from autoprec.errors import ModelSpecError
from autoprec.modelspec import (
    ModelSpec,
    call_model,
    default_loss_fn,
    default_make_optimizer,
    default_tokens_per_batch,
    load_model_spec,
)
from tests.conftest import EXAMPLES

QWEN = EXAMPLES / "qwen2_tiny.py"
MLP = EXAMPLES / "tiny_mlp.py"
CPU = torch.device("cpu")


def write(tmp_path: Path, source: str, name: str = "model.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


GOOD = """
import torch
def build_model():
    return torch.nn.Linear(4, 1)
def get_batch(step, device):
    g = torch.Generator().manual_seed(step)
    return (torch.randn(2, 4, generator=g).to(device),)
"""


# ---------------------------------------------------------------- examples


@pytest.fixture(scope="module")
def qwen() -> ModelSpec:
    pytest.importorskip("transformers")
    return load_model_spec(QWEN)


@pytest.fixture(scope="module")
def mlp() -> ModelSpec:
    return load_model_spec(MLP)


def test_qwen_batches(qwen: ModelSpec) -> None:
    b0, b0_again, b1 = qwen.get_batch(0, CPU), qwen.get_batch(0, CPU), qwen.get_batch(1, CPU)
    assert set(b0) == {"input_ids", "labels"}
    for key in b0:
        assert b0[key].shape == (4, 256) and b0[key].dtype == torch.long
        assert int(b0[key].min()) >= 0 and int(b0[key].max()) <= 255
        assert torch.equal(b0[key], b0_again[key])
    assert torch.equal(b0["input_ids"], b0["labels"])
    assert not torch.equal(b0["input_ids"], b1["input_ids"])
    assert qwen.heldout_batch is not None
    h0, h0_again = qwen.heldout_batch(0, CPU), qwen.heldout_batch(0, CPU)
    assert h0["input_ids"].shape == (4, 256)
    assert torch.equal(h0["input_ids"], h0_again["input_ids"])
    assert not torch.equal(h0["input_ids"], b0["input_ids"])
    assert qwen.tokens_per_batch(b0) == 4 * 256


def test_qwen_corpus_is_text_and_split(qwen: ModelSpec) -> None:
    ns = qwen.get_batch.__wrapped__.__globals__  # the example's module namespace
    corpus = ns["_load_corpus"]()
    assert corpus is ns["_load_corpus"]()  # cached
    assert corpus.dtype == torch.uint8 and 1_000_000 < len(corpus) <= 4_000_000
    train, held = ns["corpus_split"](heldout=False), ns["corpus_split"](heldout=True)
    assert len(train) + len(held) == len(corpus) and abs(len(held) / len(corpus) - 0.1) < 1e-3
    text = bytes(qwen.get_batch(0, CPU)["input_ids"].flatten().tolist())
    printable = sum(32 <= c < 127 or c in (9, 10) for c in text) / len(text)
    assert printable > 0.95  # Python source, not noise


def test_qwen_init_loss(qwen: ModelSpec) -> None:
    model = qwen.build_model()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.config._attn_implementation == "sdpa"
    state = torch.get_rng_state()
    again = qwen.build_model()  # seeded: identical weights; global RNG untouched
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(model.lm_head.weight, again.lm_head.weight)

    batch = qwen.get_batch(0, CPU)
    with torch.no_grad():
        loss = qwen.loss_fn(call_model(model, batch), batch)
        uniform = torch.randint(0, 256, (4, 256), generator=torch.Generator().manual_seed(0))
        loss_uniform = model(input_ids=uniform, labels=uniform).loss
    assert loss.dim() == 0 and torch.isfinite(loss)
    # Measured 5.92 at seed 0: random init gives every byte a fixed logit offset (std ~0.38),
    # and text's skewed byte frequencies meet it unevenly; on uniform labels the loss is
    # ln 256 + var/2 ~= 5.65.
    assert abs(loss.item() - math.log(256)) < 0.5
    assert abs(loss_uniform.item() - math.log(256)) < 0.3


def test_mlp_example(mlp: ModelSpec) -> None:
    b0, b0_again, b1 = mlp.get_batch(0, CPU), mlp.get_batch(0, CPU), mlp.get_batch(1, CPU)
    assert b0.shape == (8, 32) and b0.dtype == torch.long
    assert int(b0.min()) >= 0 and int(b0.max()) <= 255
    assert torch.equal(b0, b0_again) and not torch.equal(b0, b1)
    assert mlp.heldout_batch is None
    assert mlp.tokens_per_batch(b0) == 8 * 32
    model = mlp.build_model()
    out = call_model(model, b0)
    assert out.shape == (8, 32, 256)
    loss = mlp.loss_fn(out, b0)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert abs(loss.item() - math.log(256)) < 0.5
    # learnable: a few optimizer steps reduce the loss
    opt = mlp.make_optimizer(model.parameters())
    assert isinstance(opt, torch.optim.AdamW)
    for step in range(20):
        batch = mlp.get_batch(step, CPU)
        opt.zero_grad()
        mlp.loss_fn(call_model(model, batch), batch).backward()
        opt.step()
    assert mlp.loss_fn(call_model(model, b0), b0).item() < loss.item()


# ---------------------------------------------------------------- loading


def test_defaults_and_optional_entry_points(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    spec = load_model_spec(path)
    assert spec.path == path
    assert spec.heldout_batch is None
    model = spec.build_model()
    opt = spec.make_optimizer(model.parameters())
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.defaults["lr"] == 3e-4 and opt.defaults["weight_decay"] == 0.0
    batch = spec.get_batch(3, CPU)
    assert spec.tokens_per_batch(batch) == 2  # no integer tensor: batch size
    with pytest.raises(ModelSpecError) as e:
        spec.loss_fn(call_model(model, batch), batch)  # output [2, 1] has no loss
    assert path in str(e.value) and "loss_fn(output, batch)" in str(e.value)


def test_user_entry_points_and_neighbour_import(tmp_path: Path) -> None:
    (tmp_path / "helper_mod_for_spec.py").write_text("SIZE = 3\n")
    path = write(
        tmp_path,
        """
        import torch
        from helper_mod_for_spec import SIZE
        def build_model():
            return torch.nn.Linear(SIZE, 1)
        def get_batch(step, device):
            return {"input": torch.ones(5, SIZE)}
        def loss_fn(output, batch):
            return output.sum()
        def make_optimizer(params):
            return torch.optim.SGD(params, lr=0.1)
        def tokens_per_batch(batch):
            return 7
        def get_heldout_batch(step, device):
            return {"input": torch.zeros(5, SIZE)}
        if __name__ == "__main__":
            raise SystemExit("must not run")
        """,
    )
    before = list(sys.path)
    spec = load_model_spec(Path(path))
    assert sys.path == before
    assert not any(m.startswith("_autoprec_user_") for m in sys.modules)
    assert not (tmp_path / "__pycache__").exists()
    sys.modules.pop("helper_mod_for_spec", None)
    model = spec.build_model()
    batch = spec.get_batch(0, CPU)
    assert isinstance(spec.make_optimizer(model.parameters()), torch.optim.SGD)
    assert spec.tokens_per_batch(batch) == 7
    assert spec.loss_fn(call_model(model, batch), batch).dim() == 0
    assert spec.heldout_batch is not None and float(spec.heldout_batch(0, CPU)["input"].sum()) == 0.0


def test_two_loads_do_not_share_state(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        GOOD + "\nCOUNT = []\ndef tokens_per_batch(b):\n    COUNT.append(1)\n    return len(COUNT)\n",
    )
    a, b = load_model_spec(path), load_model_spec(path)
    assert a.tokens_per_batch(None) == 1 and a.tokens_per_batch(None) == 2
    assert b.tokens_per_batch(None) == 1


def error_for(tmp_path: Path, source: str) -> tuple[str, str]:
    path = write(tmp_path, source)
    with pytest.raises(ModelSpecError) as e:
        load_model_spec(path)
    return path, str(e.value)


def test_file_not_found(tmp_path: Path) -> None:
    path = str(tmp_path / "nope.py")
    with pytest.raises(ModelSpecError, match="not found") as e:
        load_model_spec(path)
    assert path in str(e.value)
    with pytest.raises(ModelSpecError, match="not a regular file"):
        load_model_spec(tmp_path)


def test_missing_build_model(tmp_path: Path) -> None:
    path, msg = error_for(tmp_path, "def get_batch(step, device):\n    return 0\n")
    assert path in msg and "build_model" in msg and "did you mean" not in msg


def test_misspelt_entry_points(tmp_path: Path) -> None:
    path, msg = error_for(
        tmp_path,
        "def build_model():\n    pass\ndef get_bacth(step, device):\n    pass\n"
        "def get_heldout_batch(step, device):\n    pass\n",
    )
    assert path in msg and "get_batch" in msg and "did you mean 'get_bacth'?" in msg
    path, msg = error_for(tmp_path, "def build_modle():\n    pass\n")
    assert path in msg and "build_model" in msg and "'build_modle'" in msg


def test_syntax_error(tmp_path: Path) -> None:
    path, msg = error_for(tmp_path, "import torch\n\ndef build_model(:\n    pass\n")
    assert path in msg and "syntax error" in msg and "line 3" in msg and "def build_model(:" in msg


def test_exception_while_importing(tmp_path: Path) -> None:
    path, msg = error_for(tmp_path, "import torch\nx = 1\nraise ValueError('boom 42')\n")
    assert path in msg and "ValueError" in msg and "boom 42" in msg and "line 3" in msg
    path, msg = error_for(tmp_path, "import no_such_module_for_autoprec\n")
    assert path in msg and "ModuleNotFoundError" in msg and "no_such_module_for_autoprec" in msg
    path, msg = error_for(tmp_path, "import sys\nsys.exit(3)\n")
    assert path in msg and "SystemExit" in msg


def test_not_callable(tmp_path: Path) -> None:
    path, msg = error_for(tmp_path, "build_model = 3\ndef get_batch(step, device):\n    pass\n")
    assert path in msg and "build_model" in msg and "not callable" in msg
    path, msg = error_for(tmp_path, GOOD + "loss_fn = 'ce'\n")
    assert path in msg and "loss_fn" in msg and "not callable" in msg


def test_wrong_arity(tmp_path: Path) -> None:
    path, msg = error_for(tmp_path, "def build_model():\n    pass\ndef get_batch(step):\n    pass\n")
    assert path in msg and "get_batch(step, device)" in msg


# ---------------------------------------------------------------- helpers


def test_call_model_forms() -> None:
    def f(*args: object, **kwargs: object) -> tuple[tuple[object, ...], dict[str, object]]:
        return args, kwargs

    t = torch.zeros(1)
    assert call_model(f, {"a": 1}) == ((), {"a": 1})
    assert call_model(f, (1, 2)) == ((1, 2), {})
    assert call_model(f, [1, 2]) == ((1, 2), {})
    assert call_model(f, t)[0][0] is t


class _Out:
    def __init__(self, loss: object) -> None:
        self.loss = loss


def test_default_loss_fn() -> None:
    scalar = torch.tensor(1.5)
    assert default_loss_fn(_Out(scalar), None) is scalar
    assert default_loss_fn({"loss": scalar, "logits": torch.zeros(2)}, None) is scalar
    assert default_loss_fn(scalar, None) is scalar
    with pytest.raises(ModelSpecError, match=r"loss=None.*define loss_fn\(output, batch\) in m\.py"):
        default_loss_fn(_Out(None), None, path="m.py")
    with pytest.raises(ModelSpecError, match=r"shape=\(2, 3\)"):
        default_loss_fn(torch.zeros(2, 3), None)
    with pytest.raises(ModelSpecError, match="no loss"):
        default_loss_fn({"logits": torch.zeros(2)}, None)
    # a tuple holding the loss (return_dict=False): the message names the item, and a batch with
    # labels is not told to include labels
    with pytest.raises(ModelSpecError, match=r"got tuple of 2 items, and a tuple is not searched for one; "
                                             r"item 1 is a one-element tensor.*in m\.py.*"
                                             r"return output\[1\]`$"):
        default_loss_fn((torch.zeros(2, 3), torch.tensor(0.5)), {"labels": 1}, path="m.py")
    with pytest.raises(ModelSpecError) as err:
        default_loss_fn({"logits": torch.zeros(2)}, {"input_ids": 1, "labels": 2})
    assert "include labels" not in str(err.value)
    with pytest.raises(ModelSpecError, match="include labels in the batch"):
        default_loss_fn({"logits": torch.zeros(2)}, {"input_ids": 1})


def test_default_tokens_per_batch() -> None:
    ids = torch.zeros(3, 5, dtype=torch.long)
    assert default_tokens_per_batch({"mask": torch.ones(3, 5, dtype=torch.bool), "input_ids": ids}) == 15
    assert default_tokens_per_batch((torch.zeros(3, 7), ids)) == 15
    assert default_tokens_per_batch([torch.zeros(4, 7)]) == 4
    assert default_tokens_per_batch(ids) == 15
    with pytest.raises(ModelSpecError, match="tokens_per_batch"):
        default_tokens_per_batch({"a": 1}, path="m.py")


def test_default_optimizer() -> None:
    opt = default_make_optimizer([torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.defaults["lr"] == 3e-4 and opt.defaults["weight_decay"] == 0.0


def test_validate_spec_returns_model_and_batch_and_restores_the_rng(tmp_path: Path) -> None:
    """``validate_spec`` runs the entry points once and returns ``(model, get_batch(0))``, the model
    in train mode; the global RNG is as before, so a later ``build_model()`` draws the same weights.
    A ``build_model`` returning no module is named in a ModelSpecError."""
    from autoprec.modelspec import validate_spec

    source = GOOD + "def loss_fn(out, batch):\n    return out.pow(2).mean()\n"
    spec = load_model_spec(write(tmp_path, source))
    torch.manual_seed(3)
    state = torch.get_rng_state()
    model, batch = validate_spec(spec)
    assert torch.equal(torch.get_rng_state(), state)
    assert isinstance(model, torch.nn.Linear) and model.training
    assert torch.equal(batch[0], spec.get_batch(0, CPU)[0])
    no_module = source.replace("return torch.nn.Linear(4, 1)", "return 3")
    bad = load_model_spec(write(tmp_path, no_module, "bad.py"))
    with pytest.raises(ModelSpecError, match=r"bad\.py: build_model returned .*torch\.nn\.Module"):
        validate_spec(bad)
    # tokens_per_batch and get_heldout_batch are entry points too: checked before any work, not
    # when the first tokens/s is computed (after the capture) or at the end of train --compare
    zero = load_model_spec(write(tmp_path, source + "def tokens_per_batch(batch):\n    return 0\n", "z.py"))
    with pytest.raises(ModelSpecError, match=r"z\.py: tokens_per_batch\(get_batch\(0\)\) returned 0; "
                                             r"expected a positive number of tokens"):
        validate_spec(zero)
    held = source + "def get_heldout_batch(step, device):\n    raise KeyError('split')\n"
    with pytest.raises(ModelSpecError, match=r"h\.py.*get_heldout_batch\(0, device\).*KeyError"):
        validate_spec(load_model_spec(write(tmp_path, held, "h.py")))


def test_public_names_stay_importable_from_the_package():
    import autoprec.modelspec as ms

    for name in ms.__all__:
        assert getattr(ms, name) is not None, name


def test_building_a_transformers_model_prints_no_torchao_import_noise(tmp_path):
    """``transformers`` imports torchao when a model is first built; on a machine without CUDA its
    "Failed to load <CUDA kernel .so>" lines and torch's ``register_constant`` deprecation warnings
    opened every command's output. They are held while the model file loads and builds."""
    pytest.importorskip("transformers")
    model = tmp_path / "llama.py"
    model.write_text(
        "import torch, transformers\n"
        "def build_model():\n"
        "    return transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=64, hidden_size=16,\n"
        "        intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))\n"
        "def get_batch(step, device):\n"
        "    return {'input_ids': torch.zeros(1, 4, dtype=torch.long, device=device)}\n")
    code = ("from autoprec.modelspec import load_model_spec\n"
            f"m = load_model_spec({str(model)!r}).build_model()\n"
            "import sys; print(type(m).__name__, 'torchao' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("LlamaForCausalLM")
    if not torch.cuda.is_available():
        assert "Failed to load" not in r.stderr, r.stderr[-2000:]
    assert "register_constant" not in r.stderr, r.stderr[-2000:]


def test_a_deterministic_batch_with_nan_or_numpy_values_is_not_called_random(tmp_path: Path) -> None:
    """NaN != NaN and an array's ``==`` is elementwise: such batches were refused as "different
    batches on two calls"; a meta-device tensor raised a raw NotImplementedError."""
    from autoprec.modelspec import validate_spec

    source = GOOD.replace("return (torch.randn(2, 4, generator=g).to(device),)",
                          "x = torch.randn(2, 4, generator=g); x[0, 0] = float('nan')\n"
                          "    return (x.to(device),)")
    nan = write(tmp_path, source + "def loss_fn(out, batch):\n    return out.sum()\n", "nan.py")
    model, batch = validate_spec(load_model_spec(nan))  # the loss is NaN: only tune's drift minds
    assert torch.isnan(batch[0][0, 0])
    arrays = write(tmp_path, GOOD.replace("return (torch.randn(2, 4, generator=g).to(device),)",
                                          "import numpy\n    return {'x': numpy.ones((2, 4), 'float32')}"),
                   "arrays.py")
    with pytest.raises(ModelSpecError) as err:
        validate_spec(load_model_spec(arrays))
    assert "different batches" not in str(err.value)
    meta = write(tmp_path, GOOD.replace("return (torch.randn(2, 4, generator=g).to(device),)",
                                        "return {'x': torch.empty(2, 4, device='meta')}"), "meta.py")
    with pytest.raises(ModelSpecError, match=r"meta.py: get_batch\(0, device\) returned a tensor on the meta "
                                             r"device at batch\['x'\] \(it has a shape and no values\)"):
        validate_spec(load_model_spec(meta))


INPLACE = """
import torch
import torch.nn.functional as F
from torch import nn

BATCH = (torch.randn(4, 8, generator=torch.Generator().manual_seed(0)), torch.randn(4, 1) * 3)

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 1)
    def forward(self, x, y):
        {change}
        return F.mse_loss(self.l2(torch.relu(self.l1(x))), y)

def build_model():
    return M()

def get_batch(step, device):
    return {batch}

def loss_fn(out, batch):
    return out
"""


@pytest.mark.parametrize("batch", ["tuple(t.clone() for t in BATCH)", "BATCH"])
def test_forward_that_changes_its_input_on_every_call_is_refused(tmp_path: Path, batch: str) -> None:
    """A forward doubling its input in place (a user's ``x.mul_(2.0)``) made every measurement see
    another input: tune blamed torch.autocast's drift (grad_rel_l2 6.57) and then every policy's.
    Also when get_batch hands out the same tensors on every call. A change that settles on the
    second call (padding labels masked once) is harmless and passes."""
    from autoprec.modelspec import validate_spec

    bad = load_model_spec(write(tmp_path, INPLACE.format(change="x.mul_(2.0)", batch=batch), "bad.py"))
    with pytest.raises(ModelSpecError, match=r"bad\.py: the model's forward changes its input batch\[0\] in "
                                             r"place, and again on every call.*x = x.clone\(\)"):
        validate_spec(bad)
    settles = INPLACE.format(change="y.clamp_(max=0.5)", batch=batch)
    model, got = validate_spec(load_model_spec(write(tmp_path, settles, "settles.py")))
    assert float(got[1].max()) <= 0.5  # changed once (the batch the check ran), then settled


def test_tokens_per_batch_may_return_a_one_element_tensor(tmp_path: Path) -> None:
    """A user's ``tokens_per_batch`` returned ``mask.sum()`` (a 0-d tensor): validation passed, then
    every trial failed storing it in the study ("Object of type Tensor is not JSON serializable").
    The spec reads it as its number; a tensor of several elements is still refused."""
    import json

    from autoprec.modelspec import validate_spec

    src = GOOD + ("\ndef loss_fn(out, batch):\n    return out.pow(2).mean()\n"
                  "\ndef tokens_per_batch(batch):\n    return torch.tensor({n})\n")
    spec = load_model_spec(write(tmp_path, src.format(n=64), "t0.py"))
    n = spec.tokens_per_batch(spec.get_batch(0, "cpu"))
    assert n == 64 and isinstance(n, int) and json.dumps({"tokens": n})
    validate_spec(spec)
    numpy = load_model_spec(write(tmp_path, src.replace("torch.tensor({n})", "np.int64(64)").replace(
        "import torch", "import numpy as np\nimport torch"), "np.py"))
    assert numpy.tokens_per_batch(None) == 64 and type(numpy.tokens_per_batch(None)) is int
    bad = load_model_spec(write(tmp_path, src.format(n="[1, 2]"), "t2.py"))
    with pytest.raises(ModelSpecError, match=r"tokens_per_batch\(get_batch\(0\)\) returned Tensor"):
        validate_spec(bad)
