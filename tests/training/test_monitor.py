"""Monitor: per-step records, strict-JSON JSONL log, summary, and the first non-finite node."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from autoprec import LossScaleError, Monitor, Policy
from autoprec.applied.apply import apply
from autoprec.capture import capture
from autoprec.metrics import median
from autoprec.nodemeta import read_meta
from autoprec.training.monitor import first_nonfinite_node, json_safe, read_jsonl
from autoprec.training.scaler import DynamicLossScaler
from autoprec.training.train import StepStats, TrainStep
from tests.conftest import ROOT
from tests.models.c01_ffn import FFN


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _sum_loss(out, batch):
    return out.float().sum()


def _inject_inf(gm, key):
    """Make the node with ``key`` output +inf everywhere its value is >= 0 (and -inf below)."""
    for n in gm.graph.nodes:
        if read_meta(n).key == key:
            orig = n.target
            n.target = lambda *a, _f=orig, **k: _f(*a, **k) * math.inf
            gm.recompile()
            return
    raise AssertionError(f"no node {key}")


def test_json_safe_is_strict_json():
    d = json_safe({"a": math.inf, "b": [-math.inf, math.nan, 1.5], "c": torch.tensor(math.nan)})
    assert d == {"a": "inf", "b": ["-inf", "nan", 1.5], "c": "nan"}
    json.dumps(d, allow_nan=False)


@pytest.mark.parametrize("key", ["fc1/linear#0", "fc2/linear#0", "fc3/linear#0"])
def test_injected_inf_is_named_exactly(key):
    model = MLP()
    x = torch.randn(4, 8)
    gm = capture(model, (x,))
    assert first_nonfinite_node(gm, (x,)) is None
    _inject_inf(gm, key)
    assert first_nonfinite_node(gm, x) == key  # a single tensor batch
    assert first_nonfinite_node(gm, [x]) == key  # a tuple/list batch


def test_c01_overflow_named_by_monitor_and_loss_scale_error(tmp_path):
    """fp16 matmul overflow (C01): every step overflows, the monitor and the floor error name the node."""
    model = FFN()
    x = torch.full((1, 256), 16.0)
    mp = apply(model, Policy.default("fp16"), (x,), compile=False)
    log = tmp_path / "log.jsonl"
    mon = Monitor(log, graph_module=mp.graph_module)
    scaler = DynamicLossScaler(init_scale=4.0, min_scale=1.0, max_skips_at_floor=2, diagnose=mon.diagnoser())
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    step = TrainStep(mp, params, torch.optim.SGD(params, lr=0.1), _sum_loss, scaler=scaler)
    with pytest.raises(LossScaleError) as err:
        for i in range(10):
            mon.last_batch = (x,)
            st = step((x,))
            mon.record(i, st, tokens=1, seconds=0.5, batch=(x,))
    # 4 -> 2 -> 1 (floor) -> 2 skips at the floor: raises on the 4th step
    assert len(mon.records) == 3
    assert "forward pass" in str(err.value) and "'proj/linear#0'" in str(err.value)
    assert all(torch.equal(a, b) for a, b in zip(params, before))  # skipped steps left weights bitwise
    mon.close()
    recs = read_jsonl(log)
    assert [r["loss_scale"] for r in recs] == [4.0, 2.0, 1.0]
    assert all(r["skipped"] and r["first_nonfinite_node"] == "proj/linear#0" for r in recs)
    assert all(r["nonfinite_grads"] > 0 and math.isinf(r["grad_norm"]) for r in recs)
    for line in log.read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    s = mon.summary()
    assert s["overflow_steps"] == 3 and s["skip_rate"] == 1.0
    assert s["first_nonfinite_nodes"] == ["proj/linear#0"]
    # the fp32 graph has no non-finite value: 66355 fits fp32
    assert first_nonfinite_node(apply(model, Policy.fp32(), (x,), compile=False).graph_module, (x,)) is None


def test_records_and_summary_of_clean_steps(tmp_path):
    model = MLP()
    params = list(model.parameters())
    step = TrainStep(model, params, torch.optim.SGD(params, lr=0.01), _sum_loss)
    with Monitor(tmp_path / "a" / "log.jsonl") as mon:
        for i in range(3):
            st = step(torch.randn(4, 8))
            mon.record(i, st, tokens=4, seconds=0.01)
    recs = read_jsonl(tmp_path / "a" / "log.jsonl")
    assert [r["step"] for r in recs] == [0, 1, 2]
    assert all(not r["skipped"] and r["nonfinite_grads"] == 0 and r["grad_norm"] > 0 for r in recs)
    assert recs[0]["tokens_per_s"] == pytest.approx(400.0)
    s = mon.summary()
    assert s == {**s, "steps": 3, "overflow_steps": 0, "skipped_steps": 0, "skip_rate": 0.0,
                 "first_nonfinite_nodes": [], "final_loss_scale": 1.0}


def test_record_accepts_step_stats_with_nan_loss(tmp_path):
    mon = Monitor(tmp_path / "l.jsonl")
    mon.record(0, StepStats(math.nan, True, 65536.0, math.inf, 3))
    mon.close()
    line = (tmp_path / "l.jsonl").read_text()
    assert '"loss": "nan"' in line and '"grad_norm": "inf"' in line
    assert math.isnan(read_jsonl(tmp_path / "l.jsonl")[0]["loss"])


def test_diagnoser_needs_a_graph():
    with pytest.raises(ValueError, match="graph_module"):
        Monitor().diagnoser()


def test_autoprec_train_names_the_overflowing_node(tmp_path, capsys):
    """``autoprec train`` wires the monitor's diagnosis into the scaler: exit 2, the error names the node."""
    from autoprec.cli import main
    from autoprec.policy import LossScalingConfig

    model_file = ROOT / "tests" / "models" / "c01_ffn.py"
    pol = tmp_path / "p.json"
    Policy(default_dtype="fp16", rules=Policy.default("fp16").rules,
           loss_scaling=LossScalingConfig(init_scale=2.0, min_scale=1.0)).save(pol)
    code = main(["train", str(model_file), "--policy", str(pol), "--steps", "20", "--no-compile",
                 "--log", str(tmp_path / "log.jsonl")])
    assert code == 1  # a failed run, not bad input
    err = capsys.readouterr().err
    assert "forward pass" in err and "'proj/linear#0'" in err
    recs = read_jsonl(tmp_path / "log.jsonl")
    assert recs and all(r["skipped"] for r in recs) and recs[0]["first_nonfinite_node"] == "proj/linear#0"


def test_summary_median_is_the_one_median_rule():
    """median_tokens_per_s is the harness's throughput rule over the steps after the first: mean
    tokens per step / autoprec.metrics.median of the step seconds (for an even count the upper
    middle value, statistics.median_high): not a median of per-step rates."""
    mon = Monitor()
    for i, seconds in enumerate([10.0, 1.0, 0.5, 0.25, 0.125]):  # 1, 2, 4, 8 tokens/s after step 0
        mon.record(i, StepStats(1.0, False, 1.0, 1.0, 0), tokens=1, seconds=seconds)
    assert mon.summary()["median_tokens_per_s"] == 1 / 0.5  # median_high of (1, .5, .25, .125) s
    assert median([1.0, 2.0, 4.0, 8.0]) == 4.0 and median([3.0, 1.0, 2.0]) == 2.0
