"""autoprec.source: which frames are the model's code, and the model line behind a captured node."""

from __future__ import annotations

import os

import torch
from torch import fx, nn

import autoprec
from autoprec.capture import capture
from autoprec.nodemeta import read_meta
from autoprec.source import is_user_file, node_source


def test_library_frames_are_not_the_users():
    assert not is_user_file(torch.nn.modules.linear.__file__)
    assert not is_user_file(autoprec.__file__)
    assert not is_user_file("<eval_with_key>.3")
    assert is_user_file(__file__)


def test_a_folder_named_like_a_library_is_still_the_users(tmp_path):
    # the packages are told apart by where they are installed, not by a folder name in the path
    for name in ("autoprec", "torch"):
        path = tmp_path / name / "model.py"
        assert is_user_file(os.fspath(path)), path


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)  # the line node_source names for the linear
        return torch.relu(h)


def test_node_source_names_the_models_line_not_torchs():
    gm = capture(_Net(), (torch.randn(2, 4),))
    by_op = {read_meta(n).op: n for n in gm.graph.nodes if n.op == "call_function"}
    where = node_source(by_op["linear"])
    assert where is not None and where.startswith(f"{__file__}:"), where
    assert where.endswith("(forward): h = self.fc(x)  # the line node_source names for the linear")
    assert "(forward): return torch.relu(h)" in node_source(by_op["relu"])
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert node_source(placeholder) is None


def test_node_source_of_a_graph_without_stack_traces():
    gm = fx.symbolic_trace(_Net())  # symbolic tracing records no stack by default
    assert [node_source(n) for n in gm.graph.nodes] == [None] * len(gm.graph.nodes)
