"""What ``compile_graph`` hands ``torch.compile``: a lowered graph gets autoprec's Inductor options,
a module (the torch.autocast + torch.compile baseline) Inductor's defaults, as users compile it."""

from __future__ import annotations

import torch
from torch import fx, nn

from autoprec.applied import compile as compile_mod


def test_graph_gets_autoprec_options_and_a_module_inductors_defaults(monkeypatch):
    seen = []

    def fake_compile(target, **kw):
        seen.append((target, kw))
        return target

    monkeypatch.setattr(compile_mod.torch, "compile", fake_compile)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    gm = fx.symbolic_trace(model)
    compile_mod.compile_graph(gm, regional=False)
    compile_mod.compile_graph(model)
    (g_target, g_kw), (m_target, m_kw) = seen
    assert g_kw["options"] == compile_mod.INDUCTOR_OPTIONS and g_kw["options"]["emulate_precision_casts"]
    assert m_target is model and m_kw["options"] == {} and m_kw["backend"] == "inductor"
    assert m_kw["dynamic"] is False
    x = torch.randn(2, 4)
    assert torch.equal(compile_mod.compile_graph(model)(x), model(x))  # the handle calls what it compiled
