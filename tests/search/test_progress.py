"""Issue 20, item 6 (progress and time accounting): a bar over every long phase of ``tune``, the
finalists' lazy compile time in ``compile_s``, and compile log lines numbered."""

from __future__ import annotations

import logging
import re
import sys
from types import SimpleNamespace

import optuna
import pytest
import torch

from autoprec.applied.shape_cache import CompileLog
from autoprec.errors import SearchError
from autoprec.measure import Harness, Measurement, Timing
from autoprec.modelspec import load_model_spec
from autoprec.policy import Policy
from autoprec.search import attrs
from autoprec.search import contest as contest_mod
from autoprec.search import study as study_mod
from autoprec.search.autocast_baseline import AutocastBaseline
from autoprec.search.contest import FP32_EAGER, Contest
from autoprec.search.drift_budget import DriftBudget
from autoprec.search.objective import DIRECTIONS
from autoprec.search.progress import Clock
from tests.conftest import MODELS

#: torch.autocast(bf16) running natively (no emulation, it can win).
AC = AutocastBaseline(torch.bfloat16)

MICRO = MODELS / "micro_lm.py"


def test_compile_log_lines_are_numbered_across_graphs(caplog):
    def f(x):
        return torch.sin(x) * 2

    def g(x):
        return torch.cos(x) + 1

    logs = [CompileLog(torch.compile(fn, backend="eager", dynamic=False), f"graph {name}")
            for name, fn in (("f", f), ("g", g))]
    with caplog.at_level(logging.INFO, logger="autoprec"):
        logs[0](torch.ones(3))
        logs[1](torch.ones(3))
        logs[0](torch.ones(5))  # a new shape: f's second compile
    found = [re.search(r"\(compile (\d+), (\w+) of this graph", r.getMessage()) for r in caplog.records]
    numbers = [(int(m.group(1)), m.group(2)) for m in found if m]
    assert len(numbers) == 3, [r.getMessage() for r in caplog.records]
    assert [n for n, _ in numbers] == list(range(numbers[0][0], numbers[0][0] + 3))
    assert [o for _, o in numbers] == ["1st", "1st", "2nd"]


def test_the_finalists_lazy_compiles_are_counted_in_compile_s(monkeypatch):
    """The compile happens in the first call of a compiled function, inside the finalists phase:
    its seconds leave ``finalists_s`` for ``compile_s``."""
    monkeypatch.setattr(study_mod, "feasible", lambda study: ["a feasible trial"])  # the contest is scripted

    class CompilingContest:
        timings = {FP32_EAGER: Timing.from_steps([0.1, 0.1], 10.0)}

        def run(self, feasible, k, budget):
            fn = torch.compile(lambda x: torch.tanh(x) @ x.T, backend="eager")
            fn(torch.ones(4, 4, requires_grad=True)).sum().backward()  # compiles now, lazily
            return Policy.fp32(), Measurement()

    clock = Clock()
    run = SimpleNamespace(harness=None, clock=clock, fp32=Measurement(), autocast=Measurement())
    study_mod._finalists(run, CompilingContest(), optuna.create_study(directions=list(DIRECTIONS)), 1, None)
    t = clock.done()
    assert t.get("compile_s", 0.0) > 0.0, t
    assert t["finalists_s"] >= 0.0


def test_tune_shows_a_bar_over_each_long_phase(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # bars only on a terminal
    study_mod.tune(MICRO, trials=3, compile=False, out=tmp_path / "p.json", dtypes="bf16", traj_steps=2,
                   report=False, device="cpu", progress=True)
    err = capsys.readouterr().err
    for phase in ("baselines", "sensitivity", "finalists"):
        assert f"[autoprec] {phase}" in err, (phase, err[-3000:])


def test_the_memory_fit_and_the_finalists_have_bars(capsys, monkeypatch):
    """Compiling is stubbed (graphs run eagerly, so recomputation frees nothing): a budget just
    above the fp32 state sends every finalist through the memory fit, whose tries get a bar."""
    monkeypatch.setattr(contest_mod, "compile_graph", lambda gm, budget=1.0, dynamic=None, **kw: gm)
    torch.manual_seed(0)
    harness = Harness(load_model_spec(MICRO), torch.device("cpu"), steps=2)
    study = optuna.create_study(directions=list(DIRECTIONS))
    study.add_trial(optuna.trial.create_trial(
        values=[1000.0, 0.01, 2**20], state=optuna.trial.TrialState.COMPLETE,
        user_attrs={attrs.POLICY: Policy.default("bf16").to_dict(), attrs.CONSTRAINT: -1.0}))
    sel = Contest(harness, DriftBudget.fixed(1.0), True, AC, None, 0, Clock(), True,
                   progress=True)
    with pytest.raises(SearchError,
                       match=r"no feasible finalist fits the memory budget \(.*even with full "
                             r"recomputation\)"):
        sel.run(study.trials, 1, lambda: harness.state_bytes + 1)
    err = capsys.readouterr().err
    assert "[autoprec] finalists" in err and "[autoprec] memory fit" in err, err[-3000:]
    assert "activation memory budget" in err


def test_optuna_failure_warnings_are_dropped_but_a_real_traceback_is_kept():
    """autoprec says why a trial failed in one line; Optuna's own warnings go, and so does the
    traceback of Ctrl-C (the CLI says "interrupted" itself); an objective that raised keeps its."""
    from autoprec.search.progress import _DropOptunaFailures

    def record(msg, exc=None):
        info = (type(exc), exc, None) if exc is not None else None
        return logging.LogRecord("optuna.study._optimize", logging.WARNING, __file__, 1, msg, None, info)

    keep = _DropOptunaFailures().filter
    assert not keep(record("Trial 3 failed with value nan."))
    assert not keep(record("Trial 9 failed with parameters: {} because of the following error: "
                           "KeyboardInterrupt().", KeyboardInterrupt()))
    assert keep(record("Trial 9 failed with parameters: {} because of the following error: "
                       "RuntimeError('boom').", RuntimeError("boom")))
    assert keep(record("Trial 4 finished with values: [1.0]"))


def test_a_long_failure_reason_keeps_its_head_and_its_tail():
    """A failed trial's log line was the reason's first 300 characters, so a long lowering or
    overflow message lost its end: where it failed (the first non-finite node and the model's line).
    Now the middle is taken out; short reasons are kept whole."""
    from autoprec.search.progress import REASON_CHARS, shorten

    reason = ("non-finite gradients on drift batch 2 after 4 loss-scale back-offs; " + "x" * 600
              + "; first non-finite output: node model.layers.3.mlp/mul#1 (from model.py:88)")
    short = shorten(reason)
    assert short.startswith("non-finite gradients on drift batch 2")
    assert short.endswith("node model.layers.3.mlp/mul#1 (from model.py:88)")
    assert " … " in short and len(short) <= REASON_CHARS + len(" … ")
    assert shorten("non-finite loss at step 0") == "non-finite loss at step 0"
