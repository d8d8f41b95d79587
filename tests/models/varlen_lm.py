"""The micro language model of micro_lm.py with batches whose size and length vary, as a
pad-to-longest loader gives them: the model.py contract allows it (docs/architecture.md#modelpy-contract)."""

import runpy
from pathlib import Path

import torch

_base = runpy.run_path(str(Path(__file__).with_name("micro_lm.py")))
build_model = _base["build_model"]

#: (batch size, sequence length) of step k: cycles through these.
SHAPES = [(3, 12), (2, 8), (3, 16), (1, 10), (2, 12)]


def get_batch(step: int, device: torch.device):
    b, n = SHAPES[step % len(SHAPES)]
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, 64, (b, n), generator=g).to(device),)
