"""Interleaved timing with a noise band (autoprec.measure.timing; issues 18 and 19)."""

from __future__ import annotations

import math
import time

import pytest
import torch

from autoprec.measure import Config, Harness, Timing, compare, format_rate, time_interleaved
from autoprec.modelspec import load_model_spec
from tests.conftest import MODELS

SGD = str(MODELS / "sgd_mlp.py")


@pytest.fixture(scope="module")
def harness():
    return Harness(load_model_spec(SGD), torch.device("cpu"), warmup=1, steps=2)


def _fake(h: Harness, name: str, calls: list[str], sleep_s: float = 0.0, fail: bool = False):
    """The harness's model, recording ``name`` in ``calls`` and sleeping ``sleep_s`` per call."""
    def fn(*args):
        calls.append(name)
        if fail:
            raise RuntimeError(f"{name} broke")
        if sleep_s:
            time.sleep(sleep_s)
        return h.model(*args)

    return fn


def test_rounds_alternate(harness):
    calls: list[str] = []
    cfgs = [Config(n, _fake(harness, n, calls)) for n in "ABC"]
    res = time_interleaved(harness, cfgs, min_rounds=3, max_rounds=3, steps_per_round=2, warmup=1)
    assert list(res) == ["A", "B", "C"]
    warm = ["A", "B", "C"]  # one warm-up step each (one batch shape), in turn
    assert calls == warm + ["A", "A", "B", "B", "C", "C"] * 3
    for t in res.values():
        assert t.rounds == 3 and len(t.step_times) == 6 and t.error is None
        assert t.round_steps == [t.step_times[0:2], t.step_times[2:4], t.step_times[4:6]]


def test_weights_restored_and_same_start(harness):
    """Every turn starts from the initial weights; the harness's weights are the initial ones after."""
    seen: list[torch.Tensor] = []

    def fn(*args):
        seen.append(harness.params[0].detach().clone())
        return harness.model(*args)

    time_interleaved(harness, [Config("A", fn), Config("B", lambda *a: harness.model(*a))],
                     min_rounds=2, max_rounds=2, steps_per_round=2, warmup=1)
    for p, p0 in zip(harness.params, harness.initial):
        assert torch.equal(p, p0) and p.grad is None
    assert len(seen) == 1 + 2 * 2  # A: one warm-up step, then 2 rounds of 2
    for k in (0, 1, 3):  # warm-up turn, round 1, round 2: each turn starts from the initial weights
        assert torch.equal(seen[k], harness.initial[0])
    assert not torch.equal(seen[2], harness.initial[0])  # the second step of a turn has trained


def test_band_contains_median_and_rates(harness):
    res = time_interleaved(harness, [Config("A", _fake(harness, "A", [], 0.002))], min_rounds=3, max_rounds=3)
    t = res["A"]
    lo, hi = t.band_s
    assert lo <= t.step_s <= hi and t.iqr_s >= 0
    assert t.tokens_per_s == pytest.approx(harness.tokens / t.step_s)
    assert t.tokens_per_s_band[0] <= t.tokens_per_s <= t.tokens_per_s_band[1]
    assert format_rate(t).startswith(f"{t.tokens_per_s:.0f} ±") and format_rate(t).endswith("%")


def test_a_failing_config_gets_an_error_others_are_timed(harness):
    calls: list[str] = []
    cfgs = [Config("A", _fake(harness, "A", calls)), Config("bad", _fake(harness, "bad", calls, fail=True)),
            Config("C", _fake(harness, "C", calls))]
    res = time_interleaved(harness, cfgs, min_rounds=2, max_rounds=2, warmup=1)
    assert res["bad"].error.startswith("RuntimeError: bad broke") and not res["bad"].step_times
    assert calls.count("bad") == 1  # failed in its warm-up, dropped from the rounds
    assert res["A"].error is None and len(res["A"].step_times) == 4
    assert res["C"].error is None and len(res["C"].step_times) == 4
    assert format_rate(res["bad"]) == "—"


def test_slow_config_is_dropped_with_a_note(harness):
    calls: list[str] = []
    cfgs = [Config("fast", _fake(harness, "fast", calls)),
            Config("slow", _fake(harness, "slow", calls, 0.03))]
    res = time_interleaved(harness, cfgs, min_rounds=3, max_rounds=3, warmup=2, max_step_s=0.02)
    assert "dropped" not in (res["slow"].note or "") and "timing stopped" in res["slow"].note
    assert len(res["slow"].step_times) == 1  # stopped in its warm-up: timed on that step only
    assert res["fast"].note is None and len(res["fast"].step_times) == 6
    assert calls.count("slow") == 2


def test_stop_rule_stops_early_when_bands_are_narrow(harness):
    cfgs = [Config(n, _fake(harness, n, [], 0.004)) for n in "AB"]
    res = time_interleaved(harness, cfgs, min_rounds=3, max_rounds=12, rel_band=10.0)
    assert all(t.rounds == 3 for t in res.values())
    res = time_interleaved(harness, cfgs, min_rounds=1, max_rounds=4, rel_band=0.0)  # never narrow enough
    assert all(t.rounds == 4 for t in res.values())
    res = time_interleaved(harness, cfgs, min_rounds=5, max_rounds=12, rel_band=10.0, time_cap_s=0.0)
    assert all(t.rounds == 0 and not t.step_times for t in res.values())  # the cap stops before round 1


def test_retired_configs_keep_their_times_and_are_timed_no_further(harness):
    """From min_rounds on, retire sees the Timings of the configurations still timed after each
    round; those it names stop, keep their step times and carry its reason as their note."""
    calls: list[str] = []
    seen: list[set[str]] = []

    def retire(timings):
        seen.append(set(timings))
        assert all(t.step_times and t.tokens_per_s > 0 for t in timings.values())
        return {"B": "out of the running"} if "B" in timings else {}

    cfgs = [Config(n, _fake(harness, n, calls)) for n in "ABC"]
    res = time_interleaved(harness, cfgs, min_rounds=2, max_rounds=4, steps_per_round=1, warmup=1,
                           rel_band=0.0, retire=retire)
    assert seen == [{"A", "B", "C"}, {"A", "C"}, {"A", "C"}]  # after rounds 2, 3 and 4
    assert res["B"].note == "out of the running" and res["B"].rounds == 2 and len(res["B"].step_times) == 2
    assert res["B"].retired and not res["A"].retired and not res["C"].retired
    assert res["A"].rounds == res["C"].rounds == 4 and res["A"].note is None
    assert calls == ["A", "B", "C"] + ["A", "B", "C"] * 2 + ["A", "C"] * 2


def test_settled_stops_the_rounds_before_the_band_does(harness):
    """``settled`` sees the Timings of those still timed after each round from min_rounds on;
    once it says True no further round starts, although no band is narrow (rel_band 0)."""
    seen: list[int] = []

    def settled(timings):
        seen.append(min(t.rounds for t in timings.values()))
        return len(seen) == 2

    cfgs = [Config(n, _fake(harness, n, [])) for n in "AB"]
    res = time_interleaved(harness, cfgs, min_rounds=2, max_rounds=8, steps_per_round=1, warmup=1,
                           rel_band=0.0, settled=settled)
    assert seen == [2, 3] and all(t.rounds == 3 and len(t.step_times) == 3 for t in res.values())


def test_bad_arguments(harness):
    with pytest.raises(ValueError, match="distinct"):
        time_interleaved(harness, [Config("A", harness.model), Config("A", harness.model)])
    with pytest.raises(ValueError, match="at least 1"):
        time_interleaved(harness, [Config("A", harness.model)], min_rounds=0)


def test_from_steps_band_is_seeded_and_sane():
    times = [0.10, 0.11, 0.09, 0.10, 0.12, 0.10, 0.095, 0.105]
    a, b = Timing.from_steps(times, 100.0), Timing.from_steps(times, 100.0)
    assert a.band_s == b.band_s  # seeded
    assert a.band_s[0] <= a.step_s <= a.band_s[1] and a.step_s == 0.10
    assert a.rel_half_width() == pytest.approx((a.band_s[1] - a.band_s[0]) / 2 / a.step_s)
    assert a.iqr_s == pytest.approx(0.10625 - 0.09875)
    assert Timing().rel_half_width() == math.inf and Timing.from_steps([], 1.0).step_s == math.inf
    one = Timing.from_steps([0.2], 10.0)
    assert one.band_s == (0.2, 0.2) and one.iqr_s == 0.0 and one.tokens_per_s == pytest.approx(50.0)


def test_compare_tie_and_winner():
    times = [0.10, 0.11, 0.09, 0.10, 0.12, 0.10, 0.095, 0.105]
    a = Timing.from_steps(times, 100.0)
    same = compare(a, Timing.from_steps(list(times), 100.0))
    assert same.tie and same.winner is None and same.ratio == pytest.approx(1.0)
    assert same.band[0] <= 1.0 <= same.band[1]
    slow = Timing.from_steps([2 * t for t in times], 100.0)
    c = compare(a, slow)
    assert c.ratio == pytest.approx(2.0) and not c.tie and c.winner == "a" and c.band[0] > 1.0
    assert compare(slow, a).winner == "b"
    with pytest.raises(ValueError):
        compare(a, Timing())


def _rounds(per_round, factor=1.0):
    """A Timing of rounds of two steps each, round r's steps ``per_round[r] * factor`` seconds."""
    rounds = [[x * factor, x * factor * 1.01] for x in per_round]
    return Timing.from_steps([x for r in rounds for x in r], 100.0, rounds=len(rounds), round_steps=rounds)


def test_compare_pairs_rounds_so_a_drifting_machine_cancels():
    """The machine's speed drifts 0.57-0.68 s between rounds; a is 4% faster in every round. Unpaired,
    the drift widens both bands into a tie; paired round by round, a wins."""
    drift = [0.57, 0.60, 0.59, 0.66, 0.68, 0.58, 0.63, 0.65]
    a, b = _rounds(drift, 1 / 1.04), _rounds(drift)
    c = compare(a, b)
    assert c.winner == "a" and c.ratio == pytest.approx(1.04) and c.band[0] > 1.0 and c.rounds == 8
    unpaired = compare(Timing.from_steps(a.step_times, 100.0), Timing.from_steps(b.step_times, 100.0))
    assert unpaired.tie and unpaired.rounds == 0
    # the rounds both ran, from the first: b retired after 3 rounds is paired on those
    assert compare(a, _rounds(drift[:3])).winner == "a" and compare(a, _rounds(drift[:3])).rounds == 3
    # under PAIRED_MIN_ROUNDS rounds in common: the two-sample rule
    two = compare(a, _rounds(drift[:2]))
    assert two.rounds == 0
    assert two.ratio == pytest.approx(compare(Timing.from_steps(a.step_times, 100.0),
                                              Timing.from_steps(_rounds(drift[:2]).step_times, 100.0)).ratio)
    # rounds whose ratio scatters around 1 stay a tie
    jitter = [1.03, 0.97, 1.02, 0.98, 1.01, 0.99, 1.0, 1.02]
    assert compare(_rounds([d * j for d, j in zip(drift, jitter)]), b).tie


def test_compare_sleep_based_fakes(harness):
    """Interleaved sleep-based fakes: a 2x slower step loses beyond the noise."""
    cfgs = [Config("fast", _fake(harness, "fast", [], 0.01)),
            Config("slow", _fake(harness, "slow", [], 0.03))]
    res = time_interleaved(harness, cfgs, min_rounds=3, max_rounds=3)
    c = compare(res["fast"], res["slow"])
    assert c.winner == "a" and c.ratio > 1.5


def test_config_slowing_down_in_the_rounds_is_dropped_from_later_rounds(harness):
    calls: list[str] = []

    def slowing(*args):
        calls.append("s")
        if len(calls) >= 3:  # warm-up and round 1's first step are fast, then every step is slow
            time.sleep(0.03)
        return harness.model(*args)

    res = time_interleaved(harness, [Config("s", slowing), Config("f", _fake(harness, "f", []))],
                           min_rounds=4, max_rounds=4, warmup=1, max_step_s=0.02, rel_band=10.0)
    s = res["s"]
    assert "dropped from later rounds" in s.note and len(calls) == 4
    # a user read "timed on that last step only" for rows whose earlier rounds were kept
    assert "its earlier rounds' steps kept" in s.note and "last step only" not in s.note
    assert s.too_slow and not res["f"].too_slow
    assert len(s.step_times) == 3 and s.rounds == 2  # round 1's two steps and round 2's first
    assert res["f"].rounds == 4 and res["f"].note is None


def test_warm_up_is_the_harness_rule_unless_given(monkeypatch):
    """By default each configuration warms up as ``Harness.measure`` would time it: the harness's
    warm-up for a compiled function, one step for an eager one (its first step only creates the
    optimizer's state); an explicit ``warmup`` applies to all."""
    from autoprec.measure import timing as timing_mod

    h = Harness(load_model_spec(SGD), torch.device("cpu"), warmup=3, steps=2)
    warm: dict[str, int] = {}
    real = timing_mod._TimedConfig.run

    def run(self, n, record):
        if not record:
            warm[self.cfg.name] = n
        return real(self, n, record)

    monkeypatch.setattr(timing_mod._TimedConfig, "run", run)
    cfgs = [Config("eager", h.model), Config("compiled", torch.compile(h.model, backend="eager"))]
    time_interleaved(h, cfgs, min_rounds=1, max_rounds=1)
    assert warm == {"eager": 1, "compiled": 3} and len(h.shapes) == 1
    time_interleaved(h, cfgs, min_rounds=1, max_rounds=1, warmup=2)
    assert warm == {"eager": 2, "compiled": 2}


def test_once_settled_only_what_narrow_names_goes_on_until_its_bands_are_narrow(harness):
    """``narrow`` is asked once, when ``settled`` first says True (round 2 here): B, which it does not
    name, stops there with its step times and the settled note; A and C go on (rel_band 0: to
    max_rounds); ``settled`` is not asked again."""
    from autoprec.measure.timing import SETTLED_NOTE

    asked: list[set[str]] = []
    looks: list[int] = []

    def settled(timings):
        looks.append(len(timings))
        return True

    def narrow(timings):
        asked.append(set(timings))
        return {"A", "C"}

    calls: list[str] = []
    cfgs = [Config(n, _fake(harness, n, calls)) for n in "ABC"]
    res = time_interleaved(harness, cfgs, min_rounds=2, max_rounds=5, steps_per_round=1, warmup=1,
                           rel_band=0.0, settled=settled, narrow=narrow)
    assert looks == [3] and asked == [{"A", "B", "C"}]
    assert res["B"].rounds == 2 and len(res["B"].step_times) == 2 and res["B"].note == SETTLED_NOTE
    assert not res["B"].retired and res["B"].error is None
    assert res["A"].rounds == res["C"].rounds == 5 and res["A"].note is None
    assert calls == ["A", "B", "C"] + ["A", "B", "C"] * 2 + ["A", "C"] * 3
    wide = time_interleaved(harness, cfgs, min_rounds=2, max_rounds=5, steps_per_round=1, warmup=1,
                            rel_band=10.0, settled=settled, narrow=narrow)  # bands narrow at once
    assert wide["A"].rounds == wide["C"].rounds == wide["B"].rounds == 2


def test_an_unguarded_reference_is_never_dropped_by_the_slow_step_limit(harness):
    """A loaded machine: fp32 eager, the reference the slow-step limit is derived from, was dropped
    after a step or two and every ratio against it rested on those. ``Config.guarded=False`` keeps
    it timed in every round; a guarded configuration as slow is still dropped."""
    def slow(*args):
        time.sleep(0.03)
        return harness.model(*args)

    res = time_interleaved(harness, [Config("ref", slow, guarded=False), Config("other", slow)],
                           min_rounds=3, max_rounds=3, warmup=1, max_step_s=0.02, rel_band=10.0)
    assert not res["ref"].too_slow and res["ref"].rounds == 3 and res["ref"].note is None
    assert res["other"].too_slow
