"""The CUDA peak rule (autoprec.measure.memory.CudaPeak) against a fake allocator: this machine has
no GPU, so the arithmetic is what is tested; its reading of CUDA's own counters waits for a GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoprec.measure.memory import CudaPeak, module_bytes


class FakeAllocator:
    """``memory_allocated`` / ``max_memory_allocated`` / ``reset_peak_memory_stats`` of one device."""

    def __init__(self) -> None:
        self.allocated = self.peak = 0

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def free(self, n: int) -> None:
        self.allocated -= n

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                            lambda device=None: setattr(self, "peak", self.allocated))


def test_a_harness_peak_leaves_out_what_another_harness_holds(monkeypatch):
    """Two harnesses resident side by side (tune --global-batch): the second one's peak was the
    process's whole peak, the first harness's model, references and initial weights included; it is
    now its own model's bytes plus what its passes allocated on top, the same whichever came first."""
    mem = FakeAllocator()
    mem.install(monkeypatch)
    dev = torch.device("cuda")
    model_a, refs_a, model_b, refs_b = 4000, 9000, 4000, 9000  # bytes: weights, FP32 references + copies

    def harness_step(peak: CudaPeak, activations: int) -> int:
        peak.start()
        mem.alloc(4000 + 8000)  # gradients + AdamW state
        mem.alloc(activations)
        mem.free(activations)
        return peak.read()

    mem.alloc(model_a + refs_a)
    first = harness_step(CudaPeak(dev, model_a), 5000)
    mem.alloc(model_b + refs_b)  # the second harness is built beside the first
    second = harness_step(CudaPeak(dev, model_b), 5000)
    assert first == second == 4000 + 12000 + 5000
    assert mem.peak > 2 * second  # what max_memory_allocated alone read


def test_module_bytes_counts_parameters_and_buffers_once_with_tied_weights():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied, as GPT-2's lm_head
    model = nn.Sequential(emb, head, nn.BatchNorm1d(10))
    expected = 10 * 4 * 4 + (10 + 10) * 4 + (10 + 10) * 4 + 8  # weight once; BN affine, stats, counter
    assert module_bytes(model) == expected
