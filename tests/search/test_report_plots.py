"""Issue 20, item 8 (reports): the Pareto plot marks the chosen policy and says its speeds are eager
screening; the dtype map's legend names the white cells; a finalist rejected on ``traj_rel`` has
its reason in the report's note column."""

from __future__ import annotations

import optuna
import torch

from autoprec.measure import Harness, Timing
from autoprec.modelspec import load_model_spec
from autoprec.policy import Policy
from autoprec.search import attrs
from autoprec.search import contest as contest_mod
from autoprec.search import report as report_mod
from autoprec.search.autocast_baseline import AutocastBaseline
from autoprec.search.contest import Contest
from autoprec.search.drift_budget import DriftBudget
from autoprec.search.objective import DIRECTIONS
from autoprec.search.plots import NO_NODES, dtype_map_figure
from autoprec.search.progress import Clock
from autoprec.search.trajectory import TrajectoryCheck
from tests.conftest import MODELS

#: torch.autocast(bf16) running natively (no emulation, it can win).
AC = AutocastBaseline(torch.bfloat16)

MICRO = MODELS / "micro_lm.py"


def _study(policies: list[Policy]) -> optuna.Study:
    study = optuna.create_study(directions=list(DIRECTIONS))
    for i, pol in enumerate(policies):
        tps = 1000.0 + 100 * i
        study.add_trial(optuna.trial.create_trial(
            values=[tps, 0.01 * (i + 1), 2**20], state=optuna.trial.TrialState.COMPLETE,
            user_attrs={attrs.POLICY: pol.to_dict(), attrs.TOKENS_PER_S: tps,
                        attrs.GRAD_REL_L2: 0.01 * (i + 1), attrs.PEAK_BYTES: 2**20, attrs.CONSTRAINT: -1.0}))
    return study


def _legend_texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]


def test_pareto_plot_marks_the_chosen_policy_and_says_eager_screening(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(report_mod, "save_figure", lambda fig, path: figures.append(fig))
    pols = [Policy.fp32(), Policy.default("bf16")]
    chosen = pols[1].with_measured({"speedup_vs_fp32": 1.23, "tokens_per_s": 1500.0})
    report_mod.write_report(_study(pols), tmp_path / "r", policy=chosen,
                            table=[{"config": "fp32 eager", "tokens_per_s": 1000.0, "speedup_vs_fp32": 1.0,
                                   "grad_rel_l2": 0.0, "peak_bytes": 0}])
    fig = figures[0]
    ax = fig.axes[0]
    assert "eager screening" in ax.get_title() and "eager screening" in ax.get_ylabel()
    legend = _legend_texts(fig)
    assert any(t.startswith("chosen policy: trial 1 (eager 1.10x; compiled 1.23x)") for t in legend), legend
    assert any("1.23x fp32 eager" in t.get_text() for t in fig.texts)


def test_dtype_map_legend_names_the_white_cells():
    fig = dtype_map_figure({"blocks.0": {"matmul": "bf16", "follow": "fp32"}, "head": {"matmul": "fp32"}})
    assert NO_NODES in _legend_texts(fig)


def test_finalist_rejected_on_traj_rel_has_the_reason_in_the_report(tmp_path, monkeypatch):
    """Compiling is stubbed (the graphs run eagerly) and the head-to-head scripted (the bf16 trial
    twice as fast as the rest, so it is the choice); the trajectory check rejects every lowered
    finalist: the choice gives way to all-fp32, and its reason reaches the lever table's note and
    the trial's note."""
    monkeypatch.setattr(contest_mod, "compile_graph", lambda gm, budget=1.0, dynamic=None, **kw: gm)

    def scripted(harness, configs, **_kw):
        return {c.name: Timing.from_steps([(0.05 if c.name.startswith("trial") else 0.1) * (1 + 0.01 * i)
                                           for i in range(6)], 100.0) for c in configs}

    monkeypatch.setattr(contest_mod, "time_interleaved", scripted)

    def traj_fails(self, pol, fn):
        if not (pol.dtypes_used() - {"fp32"}):
            return True
        self.traj[pol.training_key()], self.budget = 0.5, 0.01
        return False

    monkeypatch.setattr(TrajectoryCheck, "ok", traj_fails)
    torch.manual_seed(0)
    harness = Harness(load_model_spec(MICRO), torch.device("cpu"), steps=2)
    bf16 = Policy.default("bf16")
    study = _study([bf16])
    sel = Contest(harness, DriftBudget.fixed(1.0), True, AC, None, 20, Clock(), True)
    chosen, _m = sel.run(study.trials, 1)
    assert not (chosen.dtypes_used() - {"fp32"})
    why = "traj_rel 0.5 > 2x torch.autocast's 0.01"
    point = next(q for q in sel.finalists.rows if q["key"] == bf16.training_key())
    assert point["rejected"] == why
    md = report_mod.write_report(study, tmp_path / "r", policy=chosen,
                                 levers=sel.finalists.rows)[0].read_text()
    lever_line = next(line for line in md.split("## Finalists, with memory levers")[1].splitlines()
                      if line.startswith(f"| {bf16.summary()} |"))
    assert f"rejected: {why}" in lever_line
    trial_line = next(line for line in md.split("## Trials")[1].splitlines() if line.startswith("| 0 |"))
    assert f"finalist rejected: {why}" in trial_line


def test_a_retired_finalist_is_no_fastest_to_tie_with_and_its_note_says_over_which_rounds():
    """The head-to-head retired a finalist after 3 rounds at 0.84x the fastest; the fastest's later
    rounds (a busier machine) came out slower than the retired one's 3. The report had called the
    written policy "tie with" the retired one and shown no reason; now the retired row carries the
    head-to-head's note and the written policy is not called a tie with it."""
    def point(name: str, step_s: float, n: int, retired: bool = False, note: str | None = None) -> dict:
        return {"policy": name, "key": name, "lever": "-", "tokens_per_s": 1000 / step_s,
                "step_times": [step_s * (1 + 0.05 * (i % 3)) for i in range(n)], "grad_rel_l2": 1e-3,
                "peak_bytes": 2**20, "error": None, "note": note, "retired": retired}

    why = "0.84x all-fp32, band 0.76-0.92, in the 3 rounds both ran (all-fp32: 13660 tok/s there)"
    md = report_mod.lever_section([point("all-fp32", 0.0890, 12),
                                   point("trial 14", 0.0872, 6, retired=True, note=why)])
    rows = {line.split(" | ")[0][2:]: line for line in md.splitlines() if line.startswith("| ")}
    assert "tie with" not in rows["all-fp32"], md
    assert why in rows["trial 14"], md
