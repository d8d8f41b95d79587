"""Every batch a model file gives is checked as it is given (autoprec.modelspec.batch_check): a
later batch of another structure, type or an empty one is a ModelSpecError naming the file and
the call, where it used to fail inside the applied module or the capture."""

from __future__ import annotations

import inspect
from collections import UserDict

import pytest
import torch

from autoprec.errors import ModelSpecError
from autoprec.modelspec import load_model_spec
from autoprec.modelspec.batch_check import CheckedGetBatch
from autoprec.modelspec.micro_batches import takes_batch_size


class Encoding(UserDict):
    """A mapping that is not a dict and not a registered pytree node (as Hugging Face's BatchEncoding)."""


def _ids(step: int, rows: int = 2, cols: int = 8) -> torch.Tensor:
    return torch.randint(0, 50, (rows, cols), generator=torch.Generator().manual_seed(step))


def checked(fn):
    return CheckedGetBatch("m.py", fn)


def test_batches_of_the_first_structure_pass_with_any_sizes_and_values():
    def get_batch(step, device, batch_size=2):
        n = 8 + step
        ids = _ids(step, batch_size, n)
        return {"input_ids": ids, "labels": ids.clone(), "mode": step % 2 == 0}

    gb = checked(get_batch)
    first = gb(0, "cpu")
    assert set(first) == {"input_ids", "labels", "mode"}
    assert gb(1, "cpu")["input_ids"].shape == (2, 9)  # another length, another flag value: the same structure
    assert gb(2, "cpu", batch_size=5)["labels"].shape == (5, 10)
    assert takes_batch_size(gb) and inspect.signature(gb) == inspect.signature(get_batch)


@pytest.mark.parametrize("later, message", [
    (lambda s: _ids(s).tolist(), "get_batch(1) returned list of 2 items, where get_batch(0) returned "
                                 "Tensor(shape=(2, 8), dtype=torch.int64)"),
    (lambda s: _ids(s).float(), "get_batch(1) returned Tensor(shape=(2, 8), dtype=torch.float32), where "
                                "get_batch(0) returned Tensor(shape=(2, 8), dtype=torch.int64)"),
    (lambda s: {"input_ids": _ids(s)},
     "get_batch(1) returned dict with keys ['input_ids'], where get_batch(0) returned Tensor"),
    (lambda s: _ids(s)[0], "get_batch(1) returned Tensor(shape=(8,), dtype=torch.int64), where get_batch(0) "
                           "returned Tensor(shape=(2, 8), dtype=torch.int64)"),  # one dimension fewer
])
def test_a_later_batch_of_another_structure_names_both_calls(later, message):
    gb = checked(lambda step, device: _ids(step) if step == 0 else later(step))
    gb(0, "cpu")
    with pytest.raises(ModelSpecError, match="every batch must have the first one's structure") as e:
        gb(1, "cpu")
    assert str(e.value).startswith(f"m.py: {message}"), str(e.value)


def test_the_first_place_that_differs_in_a_nested_batch_is_named():
    def get_batch(step, device):
        mask = torch.ones(2, 8, dtype=torch.bool if step == 0 else torch.long)
        return Encoding(input_ids=_ids(step), extra=(mask, None)), _ids(step)

    gb = checked(get_batch)
    gb(0, "cpu")
    with pytest.raises(ModelSpecError) as e:
        gb(3, "cpu")
    assert ("m.py: get_batch(3) returned batch[0]['extra'][0] = Tensor(shape=(2, 8), dtype=torch.int64), "
            "where get_batch(0)'s was Tensor(shape=(2, 8), dtype=torch.bool)") in str(e.value)
    gb = checked(lambda step, device: {"input_ids": _ids(step), **({"labels": _ids(step)} if step < 2 else {})
                                       })
    gb(0, "cpu")
    gb(1, "cpu")
    with pytest.raises(ModelSpecError, match=r"get_batch\(2\) returned dict with keys \['input_ids'\], "
                       r"where get_batch\(0\) returned dict with keys \['input_ids', 'labels'\]"):
        gb(2, "cpu")


def test_another_type_and_an_empty_batch_are_refused_even_inside_a_mapping_that_is_no_pytree_node():
    with pytest.raises(ModelSpecError,
                       match=r"^m.py: get_batch\(0\) returned int; expected a Tensor, tuple, list or dict$"):
        checked(lambda step, device: 3)(0, "cpu")
    gb = checked(lambda step, device: Encoding(input_ids=_ids(step, rows=0 if step == 4 else 2)))
    gb(0, "cpu")
    with pytest.raises(ModelSpecError, match=r"get_batch\(4\) returned an empty batch \(batch\['input_ids'\] "
                       r"has shape \(0, 8\)\).*DataLoader\(drop_last=True\)"):
        gb(4, "cpu")


def test_every_model_spec_checks_get_batch_and_get_heldout_batch(tmp_path):
    path = tmp_path / "model.py"
    path.write_text("import torch\nfrom torch import nn\n"
                    "def build_model():\n    return nn.Linear(4, 1)\n"
                    "def get_batch(step, device):\n    return torch.ones(2, 4)\n"
                    "def get_heldout_batch(step, device):\n"
                    "    return torch.ones(2, 4) if step == 0 else None\n")
    spec = load_model_spec(path)
    assert isinstance(spec.get_batch, CheckedGetBatch) and isinstance(spec.heldout_batch, CheckedGetBatch)
    spec.heldout_batch(0, "cpu")
    with pytest.raises(ModelSpecError, match=rf"^{path}: get_heldout_batch\(1\) returned None; expected"):
        spec.heldout_batch(1, "cpu")
    import dataclasses
    again = dataclasses.replace(spec, loss_fn=spec.loss_fn)
    assert again.get_batch is spec.get_batch  # not wrapped twice


def test_held_out_batches_are_held_to_get_batch_s_structure(tmp_path):
    """A user's ``get_heldout_batch`` returned ``{"x": ids}`` where ``get_batch`` returned ``ids``:
    ``tune`` passed, and ``train --compare`` trained the fp32 baseline, then died in a traceback
    (``forward() got an unexpected keyword argument 'x'``). The model file is refused by the check
    before any work (validate_spec calls get_heldout_batch(0))."""
    from autoprec.modelspec import validate_spec

    path = tmp_path / "model.py"
    path.write_text("import torch\nfrom torch import nn\n"
                    "def build_model():\n    return nn.Sequential(nn.Linear(4, 1))\n"
                    "def get_batch(step, device):\n    return torch.ones(2, 4)\n"
                    "def loss_fn(out, batch):\n    return out.sum()\n"
                    "def get_heldout_batch(step, device):\n    return {'x': torch.ones(2, 4)}\n")
    with pytest.raises(ModelSpecError, match=r"get_heldout_batch\(0\) returned dict with keys \['x'\], where "
                                             r"get_batch\(0\) returned Tensor"):
        validate_spec(load_model_spec(path))
    with pytest.raises(ModelSpecError, match=r"get_heldout_batch\(3\) returned dict"):
        load_model_spec(path).heldout_batch(3, "cpu")  # get_batch not called yet: its batch 0 is the rule
