"""The MLP of sgd_mlp.py trained with SGD with momentum (one momentum buffer per parameter), for
the memory tests: its training state is parameters + gradients + momentum, 3x the parameter bytes."""

import runpy
from pathlib import Path

import torch

_base = runpy.run_path(str(Path(__file__).with_name("sgd_mlp.py")))
build_model, get_batch, loss_fn = _base["build_model"], _base["get_batch"], _base["loss_fn"]


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)
