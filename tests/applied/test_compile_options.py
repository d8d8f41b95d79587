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


def test_an_unloadable_fx_cache_entry_is_one_info_line_not_a_traceback(caplog):
    """Inductor warns with a traceback when its FX graph cache cannot load an entry (a dynamic-shape
    region on a warm cache, torch 2.13); a compiled call says so in one line instead."""
    import logging

    from autoprec.applied.compile import _UnloadableCacheEntries

    codecache = logging.getLogger("torch._inductor.codecache")
    with caplog.at_level(logging.INFO):
        with _UnloadableCacheEntries():
            try:
                raise RuntimeError("aten::full() Expected a value of type 'List[int]'")
            except RuntimeError:
                codecache.warning("fx graph cache unable to load compiled graph", exc_info=True)
            codecache.warning("another warning")  # passes
    texts = [(r.name, r.getMessage()) for r in caplog.records]
    assert ("torch._inductor.codecache", "another warning") in texts
    assert not any("unable to load" in m for n, m in texts if n == "torch._inductor.codecache")
    assert ("autoprec", "Inductor's FX graph cache could not load 1 entry of this graph (a torch limitation "
            "with dynamic shapes in shared regions); recompiled") in texts
    codecache.warning("fx graph cache unable to load compiled graph")  # outside the block: torch's own
    assert caplog.records[-1].name == "torch._inductor.codecache"


def test_apply_compiles_what_the_policy_records_and_as_torch_compile_without_a_say(monkeypatch, caplog):
    """Issue 52: ``apply`` compiles with the policy's ``compile_options`` (what ``tune`` measured);
    a policy without them compiles as ``torch.compile(model)``: one flat graph, Inductor's defaults
    (no emulated casts); a file ``tune`` wrote compiled before the field existed, as that tune
    measured it (regional, emulated casts)."""
    import dataclasses
    import logging

    import autoprec
    from autoprec.policy import REGIONAL_EMULATED, TORCH_COMPILE, CompileOptions, Policy

    seen = []
    monkeypatch.setattr(compile_mod.torch, "compile", lambda target, **kw: seen.append(kw) or target)

    class Deep(nn.Module):  # three blocks of one structure: regions to outline
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(3))

        def forward(self, x):
            for b in self.blocks:
                x = x + b(x)
            return x.sum()

    model, x = Deep(), torch.randn(4, 8)
    bf16 = Policy.default("bf16")
    flat = CompileOptions(False, True)
    cases = [(bf16, TORCH_COMPILE, None),  # flat: no outlining, no "compile:" line
             (dataclasses.replace(bf16, compile_options=REGIONAL_EMULATED), REGIONAL_EMULATED, "in 1 region"),
             (dataclasses.replace(bf16, compile_options=flat), flat, None),
             (bf16.with_provenance(compiled=True), REGIONAL_EMULATED, "in 1 region")]
    for policy, how, line in cases:
        assert policy.compiled_as == how
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="autoprec"):
            autoprec.apply(model, policy, x, dynamic=False)
        assert seen[-1]["options"]["emulate_precision_casts"] is how.emulate_precision_casts
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compile:")]
        assert (any(line in x for x in lines) if line else not lines), lines


def test_a_policy_kept_flat_records_flat_not_the_regions_it_asked_for(monkeypatch):
    """tune recorded ``compile_options.regional: true`` for a policy with saved-activation dtypes
    (``tune --global-batch``'s saved bf16 lever) or an activation memory budget below 1.0, which
    compile_graph compiles as one flat graph: the file now says flat, as the graph really compiles."""
    import dataclasses

    from autoprec.policy import REGIONAL_EMULATED, TORCH_COMPILE, Policy
    from autoprec.search.space import with_saved

    bf16 = Policy.default("bf16")
    saved = with_saved(bf16, "bf16")
    recompute = dataclasses.replace(bf16, activation_memory_budget=0.5)
    assert bf16.carried_out(REGIONAL_EMULATED) == REGIONAL_EMULATED
    for pol in (saved, recompute):
        got = pol.carried_out(REGIONAL_EMULATED)
        assert not got.regional and got.emulate_precision_casts
    assert saved.carried_out(TORCH_COMPILE) == TORCH_COMPILE
    # a file that says regional by hand: show says what compiling it does
    said = dataclasses.replace(saved, compile_options=REGIONAL_EMULATED).summary()
    assert "compiled flat (regional asked for: kept flat by its saved dtypes or memory budget)" in said
    assert "compiled regional" in dataclasses.replace(bf16, compile_options=REGIONAL_EMULATED).summary()

    # the rule is compile_graph's own: the graph with saved dtypes compiles flat though regional is asked
    seen = []
    monkeypatch.setattr(compile_mod.torch, "compile", lambda target, **kw: seen.append(target) or target)
    block = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)], block)
    gm = fx.symbolic_trace(model)
    compiled = compile_mod.compile_graph(gm, 0.5, regional=True)
    assert compiled.regions is None and recompute.kept_flat is not None
