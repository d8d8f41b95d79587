"""A drift measurement with a dynamic loss scaler backs off as training's first steps do."""

from __future__ import annotations

import torch

from autoprec.modelspec import load_model_spec
from autoprec.passes import run_pipeline
from autoprec.policy import Policy, Rule
from autoprec.search.measure import Harness
from autoprec.training.train import make_scaler

MODEL = '''
import torch
from torch import nn

def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

def get_batch(step, device):
    g = torch.Generator().manual_seed(step)
    return (torch.randn(8, 16, generator=g).to(device),)

def loss_fn(out, batch):
    return 64 * out.sum()  # gradients ~64: times the default scale 2^16 they overflow fp16 (max 65504)
'''


def test_fp16_storage_drift_backs_off_instead_of_failing(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(MODEL)
    h = Harness(load_model_spec(f), torch.device("cpu"), warmup=0, steps=1)
    pol = Policy(default_dtype="fp32", rules=(Rule(op_class="follow", dtype="fp16", compute="fp32"),))
    gm = run_pipeline(h.graph_module, pol).graph_module
    scaler = make_scaler(pol)
    assert scaler.get_scale() == 2.0 ** 16
    m = h.drift(gm, scaler)
    assert m.error is None and 0 < m.grad_rel_l2 < 1e-2, (m.grad_rel_l2, m.error)
    assert "loss-scale backoff" in (m.note or "") and scaler.get_scale() < 2.0 ** 16
    fp32 = h.drift(run_pipeline(h.graph_module, Policy.fp32()).graph_module, None)
    assert not fp32.note
