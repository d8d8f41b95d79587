"""Issue 19, "Done when" 4: every tokens/s in the report's tables (trials, finalists, side by side)
carries its noise band, and a tie is labelled as one."""

from __future__ import annotations

import optuna
import pytest

from autoprec.measure import Measurement, Outcome
from autoprec.policy import Policy
from autoprec.search import attrs
from autoprec.search.drift_budget import DriftBudget
from autoprec.search.objective import DIRECTIONS, _record
from autoprec.search.report import format_table, lever_section, write_report
from autoprec.search.results import _row

FAST = [0.010, 0.0101, 0.0099, 0.0100, 0.0102, 0.0098]  # seconds per step, ~±1%
ALMOST = [0.01005, 0.0100, 0.0102, 0.0099, 0.0101, 0.0100]  # within FAST's noise
SLOW = [0.020, 0.0201, 0.0199, 0.0200, 0.0202, 0.0198]  # 2x slower, far outside it
TOKENS = 100.0


def _measurement(times: list[float]) -> Measurement:
    from autoprec.metrics import median

    s = median(times)
    return Measurement(step_s=s, tokens_per_s=TOKENS / s, grad_rel_l2=0.01, grad_rel_l2_batches=[0.01],
                       loss_rel=0.0, grad_sqnr_db_min=30.0, peak_bytes=2**20, step_times=list(times))


def test_a_trial_records_its_step_times_and_band():
    trial = optuna.trial.FixedTrial({})
    m = _measurement(FAST)
    _record(trial, m, DriftBudget.fixed(1.0))
    ua = trial.user_attrs
    assert ua[attrs.STEP_TIMES] == FAST
    lo, hi = ua[attrs.TOKENS_PER_S_BAND]
    assert lo <= m.tokens_per_s <= hi and lo < hi


def _study(tmp_path) -> optuna.Study:
    study = optuna.create_study(directions=list(DIRECTIONS))
    for i, times in enumerate([FAST, ALMOST, SLOW]):
        m = _measurement(times)
        pol = Policy.from_dict({**Policy.fp32().to_dict(), "rules": [{"module": f"m{i}", "dtype": "bf16"}]})
        study.add_trial(optuna.trial.create_trial(
            values=[m.tokens_per_s, 0.01, 2**20], state=optuna.trial.TrialState.COMPLETE,
            user_attrs={attrs.POLICY: pol.to_dict(), attrs.TOKENS_PER_S: m.tokens_per_s,
                        attrs.STEP_TIMES: times, attrs.GRAD_REL_L2: 0.01, attrs.PEAK_BYTES: 2**20,
                        attrs.CONSTRAINT: -1.0}))
    return study


def _trial_lines(md: str) -> dict[int, str]:
    part = md.split("## Trials", 1)[1]
    return {int(line.split("|")[1]): line for line in part.splitlines() if line.startswith("| ") and
            line.split("|")[1].strip().isdigit()}


def test_trial_table_gives_each_tokens_per_s_its_band_and_labels_ties(tmp_path):
    study = _study(tmp_path)
    md = write_report(study, tmp_path / "r")[0].read_text()
    lines = _trial_lines(md)
    assert len(lines) == 3
    for line in lines.values():
        assert "±" in line.split("|")[3], line
    fastest = max((0, 1), key=lambda i: study.trials[i].values[0])
    other = 1 - fastest
    assert f"(tie with #{fastest})" in lines[other], lines[other]
    assert "tie" not in lines[fastest] and "tie" not in lines[2]  # the slow trial is not a tie


def test_side_by_side_row_without_head_to_head_timing_has_a_band_and_a_tie():
    fp32, same, slow = _measurement(FAST), _measurement(ALMOST), _measurement(SLOW)
    rows = [_row("fp32 eager", fp32, fp32), _row("autocast bf16 eager", same, fp32), _row("slow", slow, fp32)]
    table = format_table(rows).splitlines()[2:]
    for line in table:
        assert "±" in line.split("|")[2], line
    assert "(tie)" in table[1].split("|")[3] and "(tie)" not in table[2]


def test_side_by_side_says_when_there_is_no_band():
    one = _measurement([0.5])
    untimed = Measurement(outcome=Outcome.failed("failed"))
    table = format_table([_row("a", one, one), _row("b", untimed, one)]).splitlines()[2:]
    assert "(1 step: no band)" in table[0] and "| — |" in table[1]


def test_lever_table_bands_and_ties():
    def point(name, times):
        m = _measurement(times)
        return {"policy": name, "key": name, "lever": "none", "tokens_per_s": m.tokens_per_s,
                "step_times": times, "grad_rel_l2": 0.01, "peak_bytes": 2**20, "error": None}

    text = lever_section([point("a", FAST), point("b", ALMOST), point("c", SLOW)])
    rows = [line for line in text.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip() in "abc" and line.split("|")[1].strip()]
    assert len(rows) == 3 and all("±" in r.split("|")[3] for r in rows)
    assert sum("(tie with" in r for r in rows) == 1 and "tie" not in rows[2]


@pytest.mark.parametrize("times", [FAST])
def test_format_of_the_band_is_the_timing_helpers(times):
    from autoprec.measure import format_rate
    from autoprec.search.rate_bands import rate_text, timing_of

    m = _measurement(times)
    t = timing_of(m.step_times, m.tokens_per_s)
    assert rate_text(m.tokens_per_s, t) == format_rate(t)
    assert t.tokens_per_s == pytest.approx(m.tokens_per_s)


def _tune_state(compile: bool, twin_steps, fp32_compiled=None):
    """A tune's ``run`` and ``sel`` as ``results.side_by_side`` reads them: fp32 eager SLOW,
    torch.autocast (the bar, compiled or eager) FAST, the chosen ``twin`` timed at ``twin_steps``."""
    from types import SimpleNamespace

    import torch

    from autoprec.measure import Timing
    from autoprec.search.autocast_baseline import AutocastBaseline
    from autoprec.search.contest import Contest
    from autoprec.search.race import Contender
    from autoprec.search.trajectory import TrajectoryCheck

    label = "torch.autocast + torch.compile" if compile else "torch.autocast eager"
    ac = _measurement(FAST)
    timings = {label: Timing.from_steps(FAST, TOKENS), "fp32 eager": Timing.from_steps(SLOW, TOKENS),
               "twin": Timing.from_steps(twin_steps, TOKENS)}
    sel = SimpleNamespace(timings=timings, ac_label=label, autocast_compiled=ac if compile else None,
                          fp32_compiled=fp32_compiled, autocast_eager=None if compile else ac,
                          autocast_bar=ac, memory_budget=None, budget=DriftBudget.fixed(1.0),
                          decision=SimpleNamespace(chosen=SimpleNamespace(name="twin"), vs_baseline=None,
                                                   best_baseline=Contender(label, None, timings[label], 0.0,
                                                                           baseline=True)),
                          variants=[], compiled_as=Contest.compiled_as,
                          trajectory=TrajectoryCheck(None, AutocastBaseline(torch.bfloat16), 0, lambda: None))
    run = SimpleNamespace(ac_dtype=torch.bfloat16, fp32=_measurement(SLOW), autocast=_measurement(SLOW),
                          budget=DriftBudget.fixed(1.0))
    return run, sel


def test_without_compile_the_side_by_side_is_against_torch_autocast_eager():
    """A --no-compile tune's table: the bar column is ``vs autocast eager``, torch.autocast eager's
    row and the policy's are taken from the head-to-head's timings (the policy 2x slower: 0.50x),
    and the policy file's ``speedup_vs_autocast`` is against torch.autocast eager too."""
    from autoprec.search.results import measured_block, side_by_side

    pol = _measurement(SLOW)
    run, sel = _tune_state(False, SLOW)
    rows = side_by_side(run, sel, pol, compile=False)
    text = format_table(rows)
    assert "| vs autocast eager |" in text.splitlines()[0] and "+ compile" not in text
    policy_row = next(r for r in rows if r["config"] == "autoprec policy (eager)")
    assert abs(policy_row["vs_autocast"] - 0.5) < 0.02 and not policy_row["vs_autocast_tie"]
    assert next(r for r in rows if r["config"] == "autocast bf16 eager")["vs_autocast"] == 1.0
    block = measured_block(run, sel, Policy.fp32(), pol, compile=False)
    assert abs(block["speedup_vs_autocast"] - 0.5) < 0.02
    assert block["speedup_vs_baseline"] == pytest.approx(block["speedup_vs_autocast"])  # it is the bar here
    assert "traj_rel" not in block  # never measured: no 0.0 that reads as a perfect trajectory
    sel.trajectory.traj[Policy.fp32().training_key()] = 1.5e-3
    assert measured_block(run, sel, Policy.fp32(), pol, compile=False)["traj_rel"] == 1.5e-3


def test_the_speedup_that_decides_is_against_the_faster_bar_named_as_such():
    """Where torch.autocast + torch.compile is slow (native bf16 GEMMs emulated: an AVX2 CPU), the
    baseline to beat is fp32 + torch.compile: ``speedup_vs_baseline`` is against it (1.0x for the
    all-fp32 finalist chosen, while ``speedup_vs_autocast`` reads 2x) and it is named as itself, not
    as the trial that measured it; without a timed baseline the block has no such key."""
    from autoprec.measure import Timing
    from autoprec.search.race import Contender
    from autoprec.search.results import baseline_to_beat, measured_block

    run, sel = _tune_state(True, FAST)
    sel.autocast_bar = sel.autocast_compiled = _measurement(SLOW)
    sel.timings[sel.ac_label] = Timing.from_steps(SLOW, TOKENS)
    fp32_c = Contender("fp32 + torch.compile, trial 0 (eager 1699 tok/s)", Policy.fp32(),
                       Timing.from_steps(FAST, TOKENS), 0.0, baseline=True)
    sel.decision.best_baseline = fp32_c
    assert baseline_to_beat(sel, compile=True) == ("fp32 + torch.compile", fp32_c.timing.tokens_per_s)
    assert baseline_to_beat(sel, compile=False)[0] == "all-fp32"
    block = measured_block(run, sel, Policy.fp32(), _measurement(FAST), compile=True)
    assert block["speedup_vs_baseline"] == pytest.approx(1.0, rel=0.02)
    assert block["speedup_vs_autocast"] == pytest.approx(2.0, rel=0.02)
    sel.decision.best_baseline = None
    assert baseline_to_beat(sel, compile=True) is None
    block = measured_block(run, sel, Policy.fp32(), _measurement(FAST), compile=True)
    assert "speedup_vs_baseline" not in block


def test_compiled_the_table_has_both_bars_fp32_compiled_too():
    """The bar is the faster of torch.autocast + torch.compile and fp32 + torch.compile: both get a
    row, each against torch.autocast + torch.compile (fp32 compiled here 2x slower: 0.50x)."""
    from autoprec.search.results import side_by_side

    run, sel = _tune_state(True, FAST, fp32_compiled=_measurement(SLOW))
    rows = {r["config"]: r for r in side_by_side(run, sel, _measurement(FAST), compile=True)}
    assert list(rows) == ["fp32 eager", "autocast bf16 eager", "autocast bf16 + compile", "fp32 + compile",
                          "autoprec policy + compile"]
    assert abs(rows["fp32 + compile"]["vs_autocast"] - 0.5) < 0.02
    assert "| fp32 + compile |" in format_table(list(rows.values()))


def test_the_tables_ratio_to_autocast_is_the_ratio_of_the_tokens_per_s_it_shows():
    """A user divides the table's tokens/s and must get its ratio, as the policy file's
    ``speedup_vs_autocast`` and ``speedup_vs_fp32`` give it. Timed in paired rounds where a is 2x
    faster in three rounds and as fast in two, the paired ratio (the tie rule's, and the decision
    line's) is 2^(3/5) = 1.52x while the medians' ratio is 2x: the table gives 2x."""
    from autoprec.measure import Timing
    from autoprec.measure.noise import compare

    def rounds(per_round):
        r = [[x, x * 1.01] for x in per_round]
        return Timing.from_steps([x for y in r for x in y], TOKENS, rounds=len(r), round_steps=r)

    a, ac = rounds([0.5, 0.5, 0.5, 2.0, 2.0]), rounds([1.0, 1.0, 1.0, 2.0, 2.0])
    m = _measurement(a.step_times)
    c = compare(a, ac)
    assert c.rounds == 5 and c.ratio == pytest.approx(2 ** 0.6, rel=1e-3)
    row = _row("policy", m, _measurement(SLOW), a, ac)
    assert row["vs_autocast"] == pytest.approx(m.tokens_per_s / ac.tokens_per_s)
    assert row["vs_autocast"] == pytest.approx(2.0, rel=0.02)
    assert row["vs_autocast_tie"] == c.tie


def test_the_table_shows_the_compile_variants_that_raced_the_choice():
    """A user read "fp32 + compile 324" and "autoprec policy + compile 324" in the table and "0.56x
    the baseline to beat" below it: the baseline was the choice compiled flat, a row the table did
    not have. Each variant that raced the choice is a row now, and the policy's row says how it was
    compiled."""
    import dataclasses

    from autoprec.measure import Timing
    from autoprec.policy import CompileOptions
    from autoprec.search.results import side_by_side

    run, sel = _tune_state(True, SLOW)
    flat = dataclasses.replace(Policy.fp32(), compile_options=CompileOptions(False, True))
    sel.timings["twin, compiled flat"] = Timing.from_steps(FAST, TOKENS)
    sel.decision.chosen.policy = Policy.fp32()
    sel.variants = [("twin", Policy.fp32(), _measurement(SLOW)),
                    ("twin, compiled flat", flat, _measurement(FAST))]
    rows = side_by_side(run, sel, _measurement(SLOW), compile=True)
    by_name = {r["config"]: r for r in rows}
    assert list(by_name)[-2:] == ["fp32 + compile, flat", "autoprec policy + compile, regional"], rows
    assert by_name["fp32 + compile, flat"]["tokens_per_s"] == pytest.approx(_measurement(FAST).tokens_per_s)


def test_the_fp32_compile_row_is_the_bar_the_last_line_names():
    """A user read "fp32 + compile 7269" and "fp32 + compile, regional 7269" in the table (the same
    regional compile twice) and "1.00x fp32 + torch.compile" below it, against the flat compile
    (8191), which was also the choice. The "fp32 + compile" row is now the decision's baseline."""
    import dataclasses
    from types import SimpleNamespace

    from autoprec.measure import Timing
    from autoprec.policy import CompileOptions
    from autoprec.search.race import Contender
    from autoprec.search.results import side_by_side

    run, sel = _tune_state(True, SLOW)
    regional, flat = _measurement(SLOW), _measurement(FAST)
    flat_pol = dataclasses.replace(Policy.fp32(), compile_options=CompileOptions(False, True))
    name = "fp32 + torch.compile, compiled flat"
    sel.timings[name] = Timing.from_steps(FAST, TOKENS)
    sel.timings["fp32 + torch.compile"] = Timing.from_steps(SLOW, TOKENS)
    sel.fp32_compiled = regional
    sel.variants = [("fp32 + torch.compile", Policy.fp32(), regional), (name, flat_pol, flat)]
    sel.decision.chosen = SimpleNamespace(name=name, policy=flat_pol)
    sel.decision.best_baseline = Contender(name, flat_pol, sel.timings[name], 0.0, baseline=True)
    rows = {r["config"]: r for r in side_by_side(run, sel, flat, compile=True)}
    assert list(rows)[-3:] == ["fp32 + compile", "fp32 + compile, regional",
                               "autoprec policy + compile, flat"]
    assert rows["fp32 + compile"]["tokens_per_s"] == pytest.approx(flat.tokens_per_s)
    assert rows["fp32 + compile, regional"]["tokens_per_s"] == pytest.approx(regional.tokens_per_s)
