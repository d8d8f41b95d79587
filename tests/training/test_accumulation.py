"""Issue 51, done-when 3: ``autoprec train`` with a policy's micro-batch and accumulation trains what
one micro-batch of the whole global batch trains: over 20 optimizer steps on the same data the loss
trajectories agree (fp32: to rounding; bf16: within the same policy's own drift against fp32)."""

from __future__ import annotations

import dataclasses

import pytest

from autoprec import Policy
from autoprec.commands.train import train
from autoprec.policy import Batching
from tests.conftest import EXAMPLES

TINY = EXAMPLES / "tiny_mlp.py"  # its file batch is 8 examples


def _losses(pol: Policy, batching: Batching, tmp_path, name: str) -> list[float]:
    path = tmp_path / f"{name}.json"
    dataclasses.replace(pol, batching=batching).save(path)
    res = train(TINY, path, steps=20, compile=False, quiet=True)
    return res.losses


@pytest.mark.parametrize("low", ["fp32", "bf16"])
def test_accumulated_micro_batches_follow_one_micro_batch_of_the_global_batch(low, tmp_path):
    pol = Policy.fp32() if low == "fp32" else Policy.default("bf16")
    whole = _losses(pol, Batching(micro_batch=16, accumulation=1), tmp_path, "whole")
    split = _losses(pol, Batching(micro_batch=4, accumulation=4), tmp_path, "split")
    worst = max(abs(a - b) / abs(b) for a, b in zip(split, whole, strict=True))
    if low == "fp32":
        assert worst < 1e-5, worst
    else:  # bf16 rounds each micro-batch's activations; its own drift against fp32 is the scale
        ref = _losses(Policy.fp32(), Batching(micro_batch=16, accumulation=1), tmp_path, "ref")
        own = max(abs(a - b) / abs(b) for a, b in zip(whole, ref, strict=True))
        assert worst <= max(2 * own, 1e-3), (worst, own)
    # the loss goes down: the steps trained (a run that skipped every update would match too)
    assert split[-1] < split[0]
