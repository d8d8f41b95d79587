"""autoprec.search.groups: a deep model's blocks searched as runs of neighbouring layers, so the
search space and the sensitivity pass do not grow with depth."""

from __future__ import annotations

import sys

import pytest

import autoprec
from autoprec.nodemeta import read_meta
from autoprec.search.groups import MAX_BLOCK_PARAMS, block_params, members
from autoprec.search.space import SearchSpace, find_blocks
from tests.conftest import EXAMPLES

sys.path.insert(0, str(EXAMPLES))
from qwen2_tiny import build_qwen2, make_batch  # noqa: E402


def _layers(n, container="model.layers"):
    return [f"{container}.{i}" for i in range(n)]


def test_up_to_four_blocks_keep_their_own_parameters():
    assert block_params(_layers(4)) == [f"block:model.layers.{i}" for i in range(4)]


@pytest.mark.parametrize(("n", "runs"), [(5, ["0-1", "2-2", "3-3", "4-4"]), (8, ["0-1", "2-3", "4-5", "6-7"]),
                                         (24, ["0-5", "6-11", "12-17", "18-23"]),
                                         (26, ["0-6", "7-13", "14-19", "20-25"])])
def test_deep_containers_get_four_runs_covering_every_block_once(n, runs):
    params = block_params(_layers(n))
    assert params == [f"blocks:model.layers.{r}" for r in runs]
    assert [b for p in params for b in members(p)] == _layers(n)


def test_containers_are_grouped_apart_and_gaps_keep_blocks_alone():
    params = block_params(_layers(6, "encoder.block") + _layers(2, "decoder.block"))
    assert params == ["blocks:encoder.block.0-1", "blocks:encoder.block.2-3", "blocks:encoder.block.4-4",
                      "blocks:encoder.block.5-5", "block:decoder.block.0", "block:decoder.block.1"]
    gap = ["h.0", "h.1", "h.2", "h.3", "h.5"]
    assert block_params(gap) == [f"block:{b}" for b in gap]


def test_members_refuses_other_names():
    with pytest.raises(ValueError, match="not a block parameter: 'node:lm_head'"):
        members("node:lm_head")


def test_a_run_parameter_lowers_exactly_its_blocks():
    model = build_qwen2(hidden_size=32, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=64)
    batch = make_batch(0, "cpu", batch_size=2, seq_len=16)
    gm = autoprec.capture(model, batch)
    space = SearchSpace(["bf16"], find_blocks(gm), ["lm_head/linear#0"])
    assert space.block_params == [f"blocks:model.layers.{r}" for r in ("0-1", "2-3", "4-5", "6-7")]
    assert space.n_params == 3 + MAX_BLOCK_PARAMS + 1
    assert space.region_params()[-1] == "node:lm_head/linear#0"
    params = dict.fromkeys(space.region_params(), "inherit") | {
        "matmul": "fp32", "sensitive": "fp32", "follow": "auto", "blocks:model.layers.2-3": "bf16"}
    lowered = autoprec.apply(model, space.to_policy(params), batch, compile=False, dynamic=False).graph_module
    low = {read_meta(n).module.split(".")[2] for n in lowered.graph.nodes
           if n.op == "call_function" and read_meta(n).op_class == "matmul"
           and read_meta(n).dtype == "bf16"}
    assert low == {"2", "3"}


def test_block_of_is_the_outermost_container_and_index():
    from autoprec.nodekeys import block_of

    assert block_of("model.layers.3.mlp.down_proj") == ("model.layers", 3)
    assert block_of("encoder.block.2.layer.0") == ("encoder.block", 2)
    assert block_of("model.layers.11") == ("model.layers", 11)
    assert block_of("lm_head") is None and block_of("") is None and block_of("0") is None
