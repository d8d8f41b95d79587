"""Micro-batches and global batches built from a model file (issue 51,
``autoprec/modelspec/micro_batches.py``): the rows a step sees do not depend on the micro-batch,
splitting refuses a batch it cannot split, and the errors name the numbers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autoprec.errors import ModelSpecError
from autoprec.modelspec import load_model_spec
from autoprec.modelspec.micro_batches import Accumulated, MicroBatches, count_tokens, divisors, step_batches
from autoprec.policy import Batching
from tests.conftest import EXAMPLES

CPU = torch.device("cpu")


def _spec(get_batch):
    return dataclasses.replace(load_model_spec(EXAMPLES / "tiny_mlp.py"), get_batch=get_batch)


def _file_batch(step, device):  # 4 rows, a dict with a non-tensor entry
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 100, (4, 3), generator=g)
    return {"input_ids": ids, "labels": ids + 1, "flag": True}


def test_global_batch_concatenates_the_files_batches_and_splits_into_micro_batches():
    spec = _spec(_file_batch)
    mb = MicroBatches(spec, global_batch=8, micro_batch=2, device=CPU)
    assert (mb.file_batch, mb.accumulation, mb.sized) == (4, 4, False)
    whole = mb.global_at(1, CPU)  # step 1 = file steps 2 and 3
    assert torch.equal(whole["input_ids"], torch.cat([_file_batch(2, CPU)["input_ids"],
                                                      _file_batch(3, CPU)["input_ids"]]))
    step = mb.step(1, CPU)
    assert isinstance(step, Accumulated) and len(step.parts) == 4
    assert all(p["flag"] is True and p["input_ids"].shape == (2, 3) for p in step.parts)
    assert torch.equal(torch.cat([p["labels"] for p in step.parts]), whole["labels"])
    # the micro-batch stream: micro(i) is part i % 4 of step i // 4; the same rows at any micro-batch
    assert torch.equal(mb.micro(5, CPU)["input_ids"], step.parts[1]["input_ids"])
    one = MicroBatches(spec, global_batch=8, micro_batch=8, device=CPU)
    assert torch.equal(one.step(1, CPU)["input_ids"], whole["input_ids"])
    assert count_tokens(lambda b: b["input_ids"].numel(), step) == 24
    assert divisors(12) == [1, 2, 3, 4, 6, 12]


def test_a_get_batch_with_batch_size_gives_the_global_batch_itself():
    seen = []

    def get_batch(step, device, batch_size=4):
        seen.append(batch_size)
        return torch.arange(batch_size * 2, dtype=torch.float32).reshape(batch_size, 2) + step

    mb = MicroBatches(_spec(get_batch), global_batch=6, micro_batch=3, device=CPU)
    assert mb.sized and seen[-1] == 4  # get_batch(0)'s own size is the file's batch
    parts = mb.step(2, CPU).parts
    assert seen[-1] == 6 and [tuple(p.shape) for p in parts] == [(3, 2), (3, 2)]
    assert torch.equal(torch.cat(parts), get_batch(2, CPU, batch_size=6))


def test_a_get_batch_with_only_kwargs_is_concatenated_not_asked_for_a_size():
    """A ``get_batch(step, device, **kw)`` that ignores ``kw`` was asked for ``batch_size=8``, returned
    its 4 rows and was refused as a short batch; without a ``batch_size`` parameter it is concatenated."""
    def get_batch(step, device, **kw):
        return _file_batch(step, device)

    mb = MicroBatches(_spec(get_batch), global_batch=8, micro_batch=4, device=CPU)
    assert not mb.sized
    assert torch.equal(mb.global_at(1, CPU)["input_ids"], torch.cat([_file_batch(2, CPU)["input_ids"],
                                                                     _file_batch(3, CPU)["input_ids"]]))


def test_batches_that_cannot_be_resized_are_refused_naming_the_entry_and_the_numbers():
    with pytest.raises(ModelSpecError, match=r"micro-batch 3 does not divide the global batch 8; the micro-"
                                             r"batches that do: 1, 2, 4, 8"):
        MicroBatches(_spec(_file_batch), global_batch=8, micro_batch=3, device=CPU)
    with pytest.raises(ModelSpecError, match=r"global batch 6 is not a multiple of the file's batch 4 .*"
                                             r"add one: def get_batch\(step, device, batch_size=...\)"):
        MicroBatches(_spec(_file_batch), global_batch=6, micro_batch=2, device=CPU)

    def shared_mask(step, device):
        return {"input_ids": torch.zeros(4, 3, dtype=torch.long), "mask": torch.ones(1, 3)}

    with pytest.raises(ModelSpecError, match=r"batch\['mask'\] has leading dimension 1, not the batch's 4 "
                                             r"\(batch\['input_ids'\]\)"):
        MicroBatches(_spec(shared_mask), global_batch=8, micro_batch=4, device=CPU)
    with pytest.raises(ModelSpecError, match=r"trains at micro-batch 3 x 2 accumulated \(global batch 6\), "
                                             "which the model file cannot give"):
        step_batches(_spec(_file_batch), Batching(3, 2), CPU)
    with pytest.raises(ModelSpecError, match=r"^p\.json: the policy's batching trains at micro-batch 3 x 2"):
        step_batches(_spec(_file_batch), Batching(3, 2), CPU, "p.json")  # train and compare name the file
    assert step_batches(_spec(_file_batch), None, CPU) is None
