"""C14: loss-scaler state restored in a fresh process; the next steps are bit-identical."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from autoprec.training.scaler import DynamicLossScaler
from tests.conftest import ROOT

# Shared by the uninterrupted run (exec'd here) and the resumed run (in a fresh interpreter).
STEPS_SRC = '''
import math
import torch

def run_steps(scaler, p, kinds):
    """One SGD step per kind ('finite' or 'inf'); returns (scale after update, applied) per step."""
    opt = torch.optim.SGD([p], lr=0.125)
    out = []
    for kind in kinds:
        opt.zero_grad()
        w = torch.tensor([0.5, -1.5, 2.0, math.inf if kind == "inf" else 3.0])
        scaler.scale((p * w).sum() * 1e-3).backward()
        applied = scaler.step(opt)
        scaler.update()
        out.append((scaler.get_scale(), applied))
    return out
'''

RESUME_SRC = STEPS_SRC + '''
import json, sys
from autoprec.training.scaler import DynamicLossScaler
ckpt = json.loads(open(sys.argv[1]).read())
scaler = DynamicLossScaler()
scaler.load_state_dict(ckpt["scaler"])
assert scaler.state_dict() == ckpt["scaler"]
p = torch.nn.Parameter(torch.tensor([float.fromhex(x) for x in ckpt["p"]]))
steps = run_steps(scaler, p, ckpt["kinds"])
print(json.dumps({"steps": steps, "p": [x.hex() for x in p.tolist()], "scaler": scaler.state_dict()}))
'''

NEXT = ["finite", "inf", "finite"]


def _steps_module() -> dict:
    ns: dict = {}
    exec(STEPS_SRC, ns)  # noqa: S102 - our own source, shared with the subprocess
    return ns


def test_c14_scaler_state_survives_json_and_a_fresh_process(tmp_path: Path):
    run_steps = _steps_module()["run_steps"]
    scaler = DynamicLossScaler(init_scale=2.0**16, growth_interval=2)
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0, -3.0, 0.25]))
    history = run_steps(scaler, p, ["inf"] * 6 + ["finite"])
    assert [applied for _, applied in history] == [False] * 6 + [True]
    state = scaler.state_dict()
    assert state["scale"] == 1024.0 and state["_growth_tracker"] == 1
    assert state["skipped_steps"] == 6 and state["consecutive_skips"] == 0

    ckpt = tmp_path / "ckpt.json"
    ckpt.write_text(json.dumps({"scaler": state, "p": [x.hex() for x in p.tolist()], "kinds": NEXT}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", RESUME_SRC, str(ckpt)], cwd=ROOT, env=env, check=False,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    resumed = json.loads(proc.stdout.strip().splitlines()[-1])

    uninterrupted = run_steps(scaler, p, NEXT)
    assert uninterrupted == [(2048.0, True), (1024.0, False), (1024.0, True)]
    assert [tuple(s) for s in resumed["steps"]] == uninterrupted
    assert resumed["p"] == [x.hex() for x in p.tolist()]  # weights bit-identical
    assert resumed["scaler"] == scaler.state_dict()


def test_c14_load_state_dict_never_changes_the_state():
    scaler = DynamicLossScaler(init_scale=2.0**16, growth_interval=2)
    p = torch.nn.Parameter(torch.ones(4))
    _steps_module()["run_steps"](scaler, p, ["inf"] * 6 + ["finite"])
    d = scaler.state_dict()
    fresh = DynamicLossScaler()
    fresh.load_state_dict(json.loads(json.dumps(d)))
    assert fresh.state_dict() == d
    scaler.load_state_dict(scaler.state_dict())
    assert scaler.state_dict() == d
