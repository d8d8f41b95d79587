"""The final choice rule (autoprec.search.race.decide), both ways, on synthetic and committed
timings (issue 18: never lose to a measured baseline)."""

from __future__ import annotations

import json
import random

import pytest

from autoprec import Policy
from autoprec.measure import Timing, TimingEnd, compare
from autoprec.policy import Rule
from autoprec.search.race import (
    EQUIVALENCE_MARGIN,
    Contender,
    decide,
    out_of_the_running,
    settled,
    tie_order,
)
from tests.conftest import ROOT

TOKENS = 1024.0


def _timing(step_s: float, noise: float = 0.01, n: int = 12, seed: int = 0) -> Timing:
    rng = random.Random(seed)
    steps = [step_s * (1 + rng.uniform(-noise, noise)) for _ in range(n)]
    return Timing.from_steps(steps, TOKENS, rounds=n // 2)


SEARCHED = Policy(default_dtype="bf16", rules=(Rule(op_class="sensitive", dtype="fp32"),
                                               Rule(op_class="follow", dtype="bf16")))


def _field(searched_s: float, twin_s: float, autocast_s: float = 0.150, fp32c_s: float = 0.400):
    return [
        Contender("trial 7", SEARCHED, _timing(searched_s, seed=1), 7.3e-3),
        Contender("autocast twin", Policy.autocast("bf16"), _timing(twin_s, seed=2), 7.1e-3),
        Contender("torch.autocast + torch.compile", None, _timing(autocast_s, seed=3), 7.1e-3, baseline=True),
        Contender("fp32 + torch.compile", Policy.fp32(), _timing(fp32c_s, seed=4), 0.0, baseline=True),
        Contender("fp32 eager", Policy.fp32(), _timing(0.420, seed=5), 0.0, baseline=True),
    ]


def test_a_searched_policy_that_beats_autocast_compile_is_chosen():
    d = decide(_field(searched_s=0.120, twin_s=0.150))
    assert d.chosen.name == "trial 7" and d.verdict == "beats"
    assert d.best_baseline.name == "torch.autocast + torch.compile"
    assert d.vs_baseline.ratio == pytest.approx(0.150 / 0.120, rel=0.03) and d.vs_baseline.band[0] > 1.0
    assert "beats torch.autocast + torch.compile" in d.describe()


def test_the_twin_is_written_when_no_searched_policy_beats_autocast_compile():
    # the searched policy ties with autocast too, but drifts more: the tie goes to the twin
    d = decide(_field(searched_s=0.1505, twin_s=0.1502))
    assert d.chosen.name == "autocast twin" and d.chosen.policy == Policy.autocast("bf16")
    assert d.verdict == "tie" and "trial 7" in d.tied
    assert "tie" in d.describe()
    # a searched policy slower than autocast is never chosen over the twin that ties with it
    d = decide(_field(searched_s=0.210, twin_s=0.1501))
    assert d.chosen.name == "autocast twin" and d.verdict == "tie"


def test_a_tie_with_fp32_goes_to_fp32():
    # a device where low precision does not pay: every low policy ties with fp32 compiled
    field = _field(searched_s=0.400, twin_s=0.401, autocast_s=0.402, fp32c_s=0.400)
    d = decide(field)
    assert d.chosen.policy == Policy.fp32() and d.verdict == "tie"


def test_when_nothing_ties_with_autocast_the_fastest_policy_is_written_and_called_slower():
    d = decide(_field(searched_s=0.200, twin_s=0.180))
    assert d.chosen.name == "autocast twin" and d.verdict == "slower"
    assert d.vs_baseline.band[1] < 1.0
    assert "no policy was as fast as torch.autocast + torch.compile" in d.describe()


def test_when_no_policy_is_as_fast_as_fp32_eager_a_tie_among_policies_goes_to_the_simpler():
    """A tiny model where fp32 eager beats every compiled contender: the bf16 policy (24569 tok/s,
    ±28%) and fp32 compiled (23634, ±11%) tie with each other, and fp32, exact, is written (it
    wrote the bf16 one, the raw fastest); a policy clearly faster than the rest still wins."""
    noisy = lambda s, seed: _timing(s, noise=0.3, seed=seed)  # noqa: E731
    field = [Contender("trial 1", SEARCHED, noisy(0.0417, 1), 2.7e-3),
             Contender("fp32 + torch.compile", Policy.fp32(), noisy(0.0433, 2), 0.0, baseline=True),
             Contender("torch.autocast + torch.compile", None, noisy(0.0445, 3), 2.7e-3, baseline=True),
             Contender("fp32 eager", None, _timing(0.0331, seed=4), 0.0, baseline=True)]
    d = decide(field)
    assert d.fastest.name == "fp32 eager" and d.verdict == "slower"
    assert d.chosen.name == "fp32 + torch.compile"
    field[0].timing = _timing(0.0300 * 1.2, seed=1)  # clearly faster than fp32 compiled, slower than eager
    assert decide(field).chosen.name == "trial 1"


def test_untimed_contenders_are_ignored_and_no_policy_is_an_error():
    field = _field(searched_s=0.100, twin_s=0.150)
    field[0].timing = Timing(end=TimingEnd.FAILED, note="RuntimeError: boom")
    assert decide(field).chosen.name == "autocast twin"
    with pytest.raises(ValueError, match="no policy was timed"):
        decide([c for c in field if c.policy is None])


def test_committed_native_bf16_run_replayed_the_old_choice_is_called_slower():
    """benchmarks/results/make_tune_2026-12-01_kernels: the policy the old rule wrote (chosen on
    eager screening) measured 0.71x autocast + compile on an AVX512-BF16 CPU. Replayed through
    the rule with that run's own step times, it is flagged as slower than the baseline."""
    path = ROOT / "benchmarks" / "results" / "make_tune_2026-12-01_kernels" / "bench.json"
    cfg = json.loads(path.read_text())["configs"]
    tokens = json.loads(path.read_text())["tokens_per_batch"]

    def t(name: str) -> Timing:
        return Timing.from_steps(cfg[name]["step_times"], tokens)

    field = [
        Contender("old choice", SEARCHED, t("policy_compiled"), cfg["policy_compiled"]["grad_rel_l2"]),
        Contender("torch.autocast + torch.compile", None, t("autocast_compiled"),
                  cfg["autocast_compiled"]["grad_rel_l2"], baseline=True),
        Contender("fp32 + torch.compile", Policy.fp32(), t("fp32_compiled"), 0.0, baseline=True),
        Contender("fp32 eager", Policy.fp32(), t("fp32_eager"), 0.0, baseline=True),
    ]
    d = decide(field)
    assert d.verdict == "slower" and d.vs_baseline.ratio == pytest.approx(4626.0 / 6554.5, rel=0.01)
    # with a twin timed as fast as autocast + compile in the same rounds, the twin is written
    field.append(Contender("autocast twin", Policy.autocast("bf16"), t("autocast_compiled"),
                           cfg["autocast_compiled"]["grad_rel_l2"]))
    d = decide(field)
    assert d.chosen.name == "autocast twin" and d.verdict == "tie"


@pytest.mark.parametrize("run, ratio", [("qwen2_tiny_run1", 1.12), ("qwen2_tiny_run2", 1.18),
                                        ("qwen2_tiny_run3", 1.21), ("qwen2_deep", 1.38)])
def test_committed_native_bf16_runs_replayed_the_written_policy_beats_autocast_compile(run, ratio):
    """benchmarks/results/attention_math_2026-12-02 (AVX512-BF16 CPU, issue 18 done-when 1 and 2):
    three `make tune` runs and the 24-layer tune, each benched in one process. Replayed through the
    rule with the bench's own step times, the written policy is chosen over every baseline and
    beats torch.autocast + torch.compile beyond the noise, at the committed ratio; its drift is
    autocast's within the budget's 2%. A machine without native bf16 replays it here."""
    path = ROOT / "benchmarks" / "results" / "attention_math_2026-12-02" / run / "bench.json"
    bench = json.loads(path.read_text())
    cfg, tokens = bench["configs"], bench["tokens_per_batch"]

    def contender(name: str, label: str, policy: Policy | None, baseline: bool) -> Contender:
        return Contender(label, policy, Timing.from_steps(cfg[name]["step_times"], tokens),
                         cfg[name]["grad_rel_l2"], baseline=baseline)

    d = decide([
        contender("policy_compiled", "written policy", Policy.autocast("bf16"), False),
        contender("autocast_compiled", "torch.autocast + torch.compile", None, True),
        contender("fp32_compiled", "fp32 + torch.compile", Policy.fp32(), True),
        contender("fp32_eager", "fp32 eager", Policy.fp32(), True),
    ])
    assert d.chosen.name == "written policy" and d.verdict == "beats"
    assert d.best_baseline.name == "torch.autocast + torch.compile"
    assert d.vs_baseline.ratio == pytest.approx(ratio, abs=0.01) and d.vs_baseline.band[0] > 1.0
    # and today's drift gate passes it against torch.autocast's drift (the auto rule on the means)
    from autoprec.measure import Measurement
    from autoprec.search.drift_budget import DriftBudget
    from autoprec.search.gates import Candidate, DriftGate, Entry, Role

    g, ac = cfg["policy_compiled"]["grad_rel_l2"], cfg["autocast_compiled"]["grad_rel_l2"]
    written = Entry(Candidate("written policy", Role.POLICY, Policy.autocast("bf16")), None,
                    Measurement(grad_rel_l2=g, grad_rel_l2_batches=[g] * 4))
    assert DriftGate(DriftBudget.auto([ac] * 4)).judge(written).going_on


def _roles(field, skip=()):
    """``out_of_the_running``'s ``(baselines, policies)`` of a field, without the names in ``skip``."""
    return ({c.name for c in field if c.baseline and c.name not in skip},
            {c.name for c in field if c.policy is not None and c.name not in skip})


def test_out_of_the_running_retires_the_clearly_slower_but_keeps_ties_and_the_best_baseline():
    field = _field(searched_s=0.100, twin_s=0.100)
    timings = {c.name: c.timing for c in field}
    out = out_of_the_running(*_roles(field))(timings)
    # trial 7 is the fastest, the twin ties with it (the same step time), torch.autocast +
    # torch.compile is the fastest baseline (the bar): kept. fp32 compiled and eager are 4x
    # slower, beyond the noise.
    assert set(out) == {"fp32 + torch.compile", "fp32 eager"}
    assert out["fp32 eager"].startswith("0.24x trial 7, band 0.2"), out
    # the rate it is judged against is the fastest's in the same rounds, which later rounds may change
    rate = f"{timings['trial 7'].tokens_per_s:.0f}"
    assert f"in the 6 rounds both ran (trial 7: {rate} tok/s there)" in out["fp32 eager"], out
    # were torch.autocast no baseline, it would be only a slower contender
    assert "torch.autocast + torch.compile" in out_of_the_running(set(), set(timings))(timings)
    # what it keeps, decide() still chooses from: the written policy is the same
    kept = [c for c in field if c.name not in out]
    assert decide(kept).chosen.name == decide(field).chosen.name
    assert out_of_the_running(set(), {"A"})({"A": Timing()}) == {}


def test_the_fastest_policy_stays_timed_when_a_baseline_is_faster():
    """When torch.autocast + torch.compile is the fastest and no policy ties with it, decide()
    writes the fastest policy: that one is timed to the end, the slower ones are retired."""
    field = _field(searched_s=0.200, twin_s=0.300, autocast_s=0.100)
    out = out_of_the_running(*_roles(field))({c.name: c.timing for c in field})
    assert "trial 7" not in out and "torch.autocast + torch.compile" not in out
    assert out["autocast twin"].startswith("0.33x torch.autocast + torch.compile")
    kept = [c for c in field if c.name not in out]
    assert decide(kept).chosen.name == decide(field).chosen.name == "trial 7"


def test_a_configuration_timed_beside_the_contenders_is_never_the_fastest_they_are_judged_against():
    """torch.autocast + torch.compile over the drift budget is timed for the table but is no
    contender: the others are judged against the fastest contender, not against it."""
    field = _field(searched_s=0.100, twin_s=0.150, autocast_s=0.050)
    out = out_of_the_running(*_roles(field, skip={"torch.autocast + torch.compile"}))(
        {c.name: c.timing for c in field})
    # trial 7 is the fastest contender; the twin 1.5x slower; the autocast row, 2x faster than
    # trial 7, is neither retired nor the reference
    assert "trial 7" not in out and "torch.autocast + torch.compile" not in out
    assert out["autocast twin"].startswith("0.67x trial 7")


def test_settled_once_no_contender_still_timed_ties_with_the_fastest():
    """The head-to-head may stop before the bands are narrow once decide()'s choice cannot change,
    two rounds in a row: trial 7 beats the twin and torch.autocast + torch.compile beyond the noise
    (settled); a twin within the noise of trial 7 keeps it going while the band is wider than the
    equivalence margin; a configuration timed beside the contenders (not one of them) is ignored,
    even when it ties."""
    field = _field(searched_s=0.100, twin_s=0.130)
    done = settled(*_roles(field))
    timings = {c.name: c.timing for c in field}
    assert not done(timings) and done(timings)  # fixed after two rounds in a row, not one
    tied = timings | {"autocast twin": _timing(0.100, noise=0.15, n=6, seed=2)}
    assert compare(tied["autocast twin"], tied["trial 7"]).band[0] < 1 - EQUIVALENCE_MARGIN
    done = settled(*_roles(field))
    # a tie restarts the count
    assert not done(timings) and not done(tied) and not done(timings) and done(timings)
    ignore = settled(*_roles(field, skip={"autocast twin"}))
    assert not ignore(tied) and ignore(tied)
    done = settled(*_roles(field))
    assert not done({}) and not done({})


def test_a_tie_whose_band_lies_within_the_equivalence_margin_is_settled_as_a_tie():
    """Two contenders whose ratio's band contains 1.0 but lies within 1 ± EQUIVALENCE_MARGIN
    (fp32 + torch.compile and a searched policy both at 0.400 s, ±1%): more rounds could at most
    show a difference under the margin, so the rounds stop (two in a row) and decide() writes the
    simpler one; a band reaching past the margin (the same speeds, ±15% noise) keeps them timed."""
    fp32c = Contender("fp32 + torch.compile", Policy.fp32(), _timing(0.400, seed=4), 0.0, baseline=True)
    close = Contender("trial 7", SEARCHED, _timing(0.401, seed=1), 7.3e-3)
    c = compare(close.timing, fp32c.timing)
    assert c.tie and 1 - EQUIVALENCE_MARGIN < c.band[0] and c.band[1] < 1 + EQUIVALENCE_MARGIN
    roles = ({"fp32 + torch.compile"}, {"fp32 + torch.compile", "trial 7"})
    done = settled(*roles)
    timings = {"fp32 + torch.compile": fp32c.timing, "trial 7": close.timing}
    assert not done(timings) and done(timings)
    d = decide([fp32c, close])
    assert d.chosen.name == "fp32 + torch.compile" and d.verdict == "tie"
    wide = timings | {"trial 7": _timing(0.401, noise=0.15, n=6, seed=1)}
    assert compare(wide["trial 7"], wide["fp32 + torch.compile"]).tie
    done = settled(*roles)
    assert not any(done(wide) for _ in range(4))


def test_a_tie_settles_on_the_side_where_more_rounds_could_change_what_is_written():
    """A searched policy 0.96x fp32 + torch.compile, band 0.89-1.01 (a tie): fp32 + torch.compile is
    written while they tie (lower drift), so only the policy turning out over 5% faster could change
    that, and the band's high end excludes it: settled. Roles swapped (the searched policy the
    fastest, fp32 + torch.compile 0.96x of it), fp32 + torch.compile is written as long as it ties,
    and it may still fall 11% behind: timed on. Without a tie order both ends must lie within the
    margin."""
    fast, slow = _timing(0.400, noise=0.03, n=6, seed=4), _timing(0.412, noise=0.10, n=6, seed=1)
    c = compare(slow, fast)
    assert c.tie and c.band[0] < 1 - EQUIVALENCE_MARGIN and c.band[1] <= 1 + EQUIVALENCE_MARGIN
    fp32c, searched = ("fp32 + torch.compile", Policy.fp32(), 0.0), ("trial 7", SEARCHED, 7.3e-3)
    order = tie_order([searched, fp32c])
    assert order == ["fp32 + torch.compile", "trial 7"]
    roles = ({"fp32 + torch.compile", "fp32 eager"}, {"fp32 + torch.compile", "trial 7"})

    done = settled(*roles, order)
    timings = {"fp32 + torch.compile": fast, "trial 7": slow}
    assert not done(timings) and done(timings)
    assert decide([Contender(*fp32c[:2], fast, 0.0, baseline=True),
                   Contender(*searched[:2], slow, 7.3e-3)]).chosen.name == "fp32 + torch.compile"
    symmetric = settled(*roles)
    assert not any(symmetric(timings) for _ in range(4))

    swapped = {"fp32 + torch.compile": slow, "trial 7": fast}
    done = settled(*roles, order)
    assert not any(done(swapped) for _ in range(4))


def test_a_retired_contender_is_neither_the_fastest_nor_the_baseline_to_beat():
    """fp32 eager, retired after 4 rounds at 0.91x fp32 + torch.compile, kept the rate of those
    rounds (868 tok/s); fp32 + torch.compile's later rounds came out slower on a drifting machine
    (847 tok/s over all 12). The retire rule judged fp32 eager out of the running, so the decision
    compares with fp32 + torch.compile, not with a rate from other rounds (a 24-layer Qwen2's tune
    had written "0.98x fp32 eager: tie" for the baseline itself)."""
    fp32c = Contender("fp32 + torch.compile", Policy.fp32(), _timing(TOKENS / 847, n=24, seed=4), 0.0,
                      baseline=True)
    eager_t = _timing(TOKENS / 868, n=8, seed=5)
    eager_t.end = TimingEnd.RETIRED
    eager_t.note = "0.91x fp32 + torch.compile, band 0.80-0.94, after 4 rounds"
    eager = Contender("fp32 eager", None, eager_t, 0.0, baseline=True)
    searched = Contender("trial 8", SEARCHED, _timing(TOKENS / 819, noise=0.05, n=24, seed=1), 8.6e-4)
    d = decide([searched, fp32c, eager])
    assert eager.timing.tokens_per_s > fp32c.timing.tokens_per_s
    assert d.fastest.name == d.best_baseline.name == d.chosen.name == "fp32 + torch.compile"
    assert "fp32 eager" not in d.tied
    eager_t.end = TimingEnd.TIMED  # as before: the retired rate would be the bar
    assert decide([searched, fp32c, eager]).best_baseline.name == "fp32 eager"


def test_a_tie_with_fp32_eager_does_not_claim_the_tie_rule_chose_over_it():
    """fp32 eager (a baseline without a policy) fastest on a noisy machine, fp32 + torch.compile
    tying with it: the log said "tie, the lower-drift, simpler of fp32 + torch.compile, fp32 eager",
    though fp32 eager has the lower drift and no compile; it was chosen over because it is no policy."""
    eager = Contender("fp32 eager", None, _timing(0.200, noise=0.6, seed=5), 0.0, baseline=True)
    fp32c = Contender("fp32 + torch.compile", Policy.fp32(), _timing(0.400, noise=0.6, seed=4), 9.5e-10,
                      baseline=True)
    d = decide([fp32c, eager])
    assert d.chosen.name == "fp32 + torch.compile" and d.verdict == "tie" and d.unwritable == ["fp32 eager"]
    text = d.describe()
    assert text.endswith(": tie; fp32 eager ties too, but is no policy to write"), text
    assert "simpler of" not in text


def test_the_decision_line_says_when_its_ratio_is_paired_by_round():
    """Contenders timed in the same rounds are compared round by round (a geometric mean of the
    per-round ratios, not the ratio of medians the tables give): the decision line says over how
    many rounds; two-sample comparisons say nothing more."""
    def rounds(step_s: float) -> Timing:
        r = [[step_s * (1 + 0.01 * i), step_s * (1 + 0.01 * i) * 1.005] for i in range(4)]
        return Timing.from_steps([x for y in r for x in y], TOKENS, rounds=4, round_steps=r)

    paired = decide([Contender("trial 7", SEARCHED, rounds(0.120), 7.3e-3),
                     Contender("fp32 + torch.compile", Policy.fp32(), rounds(0.150), 0.0, baseline=True),
                     Contender("fp32 eager", Policy.fp32(), rounds(0.200), 0.0, baseline=True)])
    assert paired.chosen.name == "trial 7" and paired.vs_baseline.rounds == 4
    assert paired.describe().startswith("chosen: trial 7, 1.25x fp32 + torch.compile (band 1.25-1.25, "
                                        "4 rounds paired)")
    assert "rounds paired" not in decide(_field(searched_s=0.120, twin_s=0.150)).describe()


def test_narrow_names_the_policy_written_and_every_baseline():
    """Once settled, the head-to-head times on only what its ratios compare (Race.narrow): the written
    policy, by decide's rule on the timings so far (here the twin, tied with torch.autocast and
    simpler than trial 7's drift; then trial 7 when it is faster), and every baseline (whichever
    ends fastest is timed in the same rounds); every name still timed when no policy has been."""
    from autoprec.search.race import Race

    def lineup(timings):
        return [replace_timing(c, timings) for c in _field(searched_s=0.1505, twin_s=0.1502)]

    def replace_timing(c, timings):
        return Contender(c.name, c.policy, timings.get(c.name, Timing()), c.grad_rel_l2, c.baseline)

    race = Race.of(_field(0.150, 0.150))
    both = {c.name: c.timing for c in _field(searched_s=0.1505, twin_s=0.1502)}
    bars = {"torch.autocast + torch.compile", "fp32 + torch.compile", "fp32 eager"}
    assert race.narrow(lineup)(both) == {"autocast twin"} | bars
    faster = {c.name: c.timing for c in _field(searched_s=0.100, twin_s=0.1502)}
    assert race.narrow(lambda ts: [replace_timing(c, ts) for c in _field(0.100, 0.1502)])(faster) == {
        "trial 7"} | bars
    some = {n: t for n, t in both.items() if n != "fp32 eager"}  # retired: not offered
    assert race.narrow(lineup)(some) == {"autocast twin"} | bars - {"fp32 eager"}
    no_policy = {"torch.autocast + torch.compile": both["torch.autocast + torch.compile"]}
    assert race.narrow(lineup)(no_policy) == set(no_policy)
