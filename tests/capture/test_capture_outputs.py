"""Outputs as real libraries return them: ModelOutput dataclasses, KV caches, None fields, nested
containers and non-tensor values, through capture and apply, compiled or not (issue 12)."""

from __future__ import annotations

import dataclasses
import enum
import logging
from typing import Any

import pytest
import torch
from torch import nn

import autoprec
from autoprec.capture import CALL_KWARGS_META, capture
from autoprec.errors import CaptureError
from autoprec.modelspec import training_kwargs

ModelOutput = pytest.importorskip("transformers").utils.ModelOutput


@dataclasses.dataclass
class LMOut(ModelOutput):
    """A ModelOutput as transformers' models return (registered as a pytree node by transformers)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: Any = None


class KVCache:
    """Stands for transformers' DynamicCache: an unregistered class holding the keys and values."""

    def __init__(self) -> None:
        self.layers: list[dict[str, torch.Tensor]] = []


class CacheLM(nn.Module):
    """A causal LM whose forward defaults to use_cache=True and then returns a cache, as HF's do."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32)

    def forward(self, input_ids, labels=None, use_cache=True):
        h = self.proj(self.emb(input_ids))
        logits = self.head(torch.relu(h))
        loss = None if labels is None else nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        cache = None
        if use_cache:
            cache = KVCache()
            cache.layers.append({"keys": h, "values": h * 2})
        return LMOut(loss=loss, logits=logits, cache=cache)


def _batch():
    ids = torch.randint(0, 32, (2, 8))
    return {"input_ids": ids, "labels": ids}


def test_use_cache_is_off_for_training_and_said_once(caplog, monkeypatch):
    import sys

    monkeypatch.setattr(sys.modules["autoprec.capture.trace"], "_announced", set())  # as in a fresh process
    model, batch = CacheLM(), _batch()
    with caplog.at_level(logging.INFO, logger="autoprec"):
        gm = capture(model, batch)
        capture(model, batch)  # the same model again: nothing new to say
        capture(CacheLM(), batch)  # nor another instance: once per process (issue 20)
    said = [r for r in caplog.records if r.name == "autoprec"]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    assert "CacheLM" in said[0].getMessage() and "use_cache=False" in said[0].getMessage()
    assert gm.meta[CALL_KWARGS_META] == {"use_cache": False}
    out, ref = gm(**batch), model(**batch)
    assert type(out) is LMOut and out.cache is None
    torch.testing.assert_close(out.loss, ref.loss)
    torch.testing.assert_close(out.logits, ref.logits)


def test_training_kwargs_only_when_forward_names_it_and_the_batch_does_not_set_it():
    model, ids = CacheLM(), torch.zeros(1, 2, dtype=torch.long)
    assert training_kwargs(model, (), {"input_ids": ids}) == {"use_cache": False}
    assert training_kwargs(model, (), {"input_ids": ids, "use_cache": True}) == {}
    assert training_kwargs(model, (ids, None, True), {}) == {}  # set positionally
    assert training_kwargs(model, (ids,), {}) == {"use_cache": False}

    class KwargsOnly(nn.Module):
        def forward(self, x, **kwargs):
            return x

    assert training_kwargs(KwargsOnly(), (ids,), {}) == {}


def test_batch_that_asks_for_the_cache_names_the_type_and_field():
    with pytest.raises(CaptureError) as ei:
        capture(CacheLM(), {**_batch(), "use_cache": True})
    msg = str(ei.value)
    assert "KVCache" in msg and "output['cache']" in msg and "layers[0]['keys']" in msg
    assert "What to do" in msg and "use_cache" in msg and "register_pytree_node" in msg
    assert "torch.cond" not in msg and "data-dependent" not in msg


class Mode(enum.Enum):
    TRAIN = 1


class Note:
    """A value without tensors: kept out of the graph and returned unchanged."""

    def __init__(self, text: str) -> None:
        self.text = text


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return {"y": y, "none": None, "n": 3, "s": "hi", "mode": Mode.TRAIN, "note": Note("kept"),
                "nested": (y * 2, {"z": y.sum(), "w": None}), "out": LMOut(loss=y.mean(), logits=y)}


def _check_mixed(out, ref):
    assert set(out) == set(ref)
    assert out["none"] is None and out["n"] == 3 and out["s"] == "hi" and out["mode"] is Mode.TRAIN
    assert type(out["note"]) is Note and out["note"].text == "kept"
    assert type(out["out"]) is LMOut and list(out["out"].keys()) == ["loss", "logits"]
    assert type(out["nested"]) is tuple and out["nested"][1]["w"] is None
    # wide enough for the bf16 policies of the apply tests below (the fp32 capture is exact)
    torch.testing.assert_close(out["nested"][0], ref["nested"][0], rtol=2e-2, atol=2e-2)


def test_non_tensor_values_are_returned_unchanged_by_capture():
    model, x = Mixed(), torch.randn(2, 4)
    _check_mixed(capture(model, (x,))(x), model(x))


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_apply_keeps_the_output_type_and_fields(compile):
    model, batch = CacheLM(), _batch()
    mp = autoprec.apply(model, autoprec.Policy.default("bf16"), batch, compile=compile)
    out = mp(**batch)
    assert type(out) is LMOut and list(out.keys()) == ["loss", "logits"] and out.cache is None
    assert out.logits.dtype == torch.float32 and torch.isfinite(out.loss)
    out.loss.backward()
    assert model.proj.weight.grad is not None
    # the capture fixed use_cache=False: the module runs with it on every call
    assert mp(**batch, use_cache=False).logits.shape == out.logits.shape
    with pytest.raises(ValueError, match=r"use_cache=False.*use_cache=True"):
        mp(**batch, use_cache=True)
    if compile:
        m2, x = Mixed(), torch.randn(2, 4)
        _check_mixed(autoprec.apply(m2, autoprec.Policy.default("bf16"), (x,), compile=True)(x), m2(x))


MODEL_PY = '''
import torch
from torch import nn


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 32)

    def forward(self, input_ids, labels=None, use_cache=True):
        logits = self.head(self.emb(input_ids))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits, "cache": [object()] if use_cache else None}


def build_model():
    torch.manual_seed(0)
    return LM()


def get_batch(step, device):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 32, (2, 8), generator=g)
    return {"input_ids": ids.to(device), "labels": ids.to(device)}
'''


def test_cli_shows_the_use_cache_line_prefixed(tmp_path, capsys):
    from autoprec.cli import main

    path = tmp_path / "model.py"
    path.write_text(MODEL_PY)
    autoprec.Policy.default("bf16").save(str(tmp_path / "p.json"))
    code = main(["train", str(path), "--policy", str(tmp_path / "p.json"), "--steps", "1", "--no-compile"])
    err = capsys.readouterr().err
    assert code == 0, err
    lines = [ln for ln in err.splitlines() if "use_cache=False" in ln]
    assert len(lines) == 1 and lines[0].startswith("[autoprec] capturing LM for training with "
                                                   "use_cache=False"), err
    assert not logging.getLogger("autoprec").handlers  # the CLI's handler is gone after main()
