"""The one training-step loop (autoprec.training.steps) and the one RNG rule (autoprec.training.rng)."""

from __future__ import annotations

import pytest
import torch

from autoprec.measure import Harness
from autoprec.modelspec import load_model_spec
from autoprec.training.rng import MEASURE_SEED, StepRng, same_rng
from autoprec.training.steps import StepsTooSlow, every, run_steps, slow_step_guard, slow_steps
from autoprec.training.train import StepStats
from tests.conftest import MODELS


class ScriptedStep:
    """Stands in for a TrainStep: step k 'takes' seconds[k] and records a random draw."""

    device_type = "cpu"

    def __init__(self, seconds: list[float]) -> None:
        self.seconds, self.k, self.draws = seconds, 0, []

    def timed(self, batch):
        self.draws.append(float(torch.rand(())))
        dt, self.k = self.seconds[self.k], self.k + 1
        return StepStats(float(batch), False, 1.0, 0.0, 0), dt


def _run(seconds, limit, start=0):
    return run_steps(ScriptedStep(seconds), float, start, len(seconds), after=[slow_step_guard(limit)])


def test_run_steps_calls_hooks_in_order_with_each_steps_batch():
    calls = []
    done = run_steps(ScriptedStep([0.1] * 5), lambda k: 10 * k, 2, 5,
                     before=lambda k, b: calls.append(("before", k, b)),
                     after=[lambda k, b, st, s: calls.append(("after", k, st.loss, s))])
    assert [st.loss for st, _ in done] == [20.0, 30.0, 40.0] and [s for _, s in done] == [0.1] * 3
    assert calls[:2] == [("before", 2, 20), ("after", 2, 20.0, 0.1)] and len(calls) == 6


def test_slow_step_guard_two_in_a_row_or_one_four_times_over():
    """One noisy step over the limit does not stop the loop; two in a row do; one over 4x does."""
    assert len(_run([1.5, 0.5, 1.5, 0.5, 1.5], 1.0)) == 5
    with pytest.raises(StepsTooSlow, match=r"2 steps in a row took over the 1\.00 s limit") as e:
        _run([0.5, 1.5, 1.2, 0.5], 1.0)
    assert (e.value.step, e.value.seconds, e.value.limit) == (2, 1.2, 1.0)
    with pytest.raises(StepsTooSlow, match=r"a step took 4\.50 s, over 4 x the 1\.00 s limit") as e:
        _run([0.5, 4.5, 0.5], 1.0)
    assert e.value.step == 1 and str(e.value).startswith("timing stopped: ")
    assert len(_run([3.9, 0.5, 3.9], 1.0)) == 3


def test_slow_steps_is_the_guards_rule_on_a_list_of_step_times():
    """``slow_steps`` (the screening cut's form of the guard) judges the last step of a run so far."""
    assert slow_steps([], 1.0) is None and slow_steps([1.5], 1.0) is None
    assert slow_steps([1.5, 0.5, 1.5], 1.0) is None
    slow = slow_steps([0.5, 1.5, 1.2], 1.0)
    assert (slow.step, slow.seconds, slow.why) == (2, 1.2, "2 steps in a row took over the 1.00 s limit "
                                                           "(the last 1.20 s)")
    assert slow_steps([4.5], 1.0, step=7).step == 7
    assert slow_steps([3.9], 1.0) is None


def test_every_calls_at_multiples_but_not_at_stop():
    got = []
    run_steps(ScriptedStep([0.0] * 7), float, 0, 7, after=[every(3, got.append, stop=6)])
    assert got == [3]  # 6 == stop is left to the caller; 7 is no multiple
    run_steps(ScriptedStep([0.0] * 4), float, 0, 4, after=[every(0, got.append)])
    assert got == [3]


def test_step_rng_rules():
    """stream: draws continue the global state; seeded stream: seeded before step 0 only (not on
    resume); fixed per step: step k from seed + k, the caller's state given back."""
    torch.manual_seed(7)
    expected = [float(torch.rand(())) for _ in range(3)]
    torch.manual_seed(7)
    step = ScriptedStep([0.0] * 3)
    run_steps(step, float, 0, 3)
    assert step.draws == expected
    torch.manual_seed(99)
    step = ScriptedStep([0.0] * 3)
    run_steps(step, float, 0, 3, rng=StepRng(7))
    assert step.draws == expected
    torch.manual_seed(7)
    float(torch.rand(()))
    step = ScriptedStep([0.0] * 3)
    run_steps(step, float, 1, 3, rng=StepRng(12345))  # resumed at step 1: not reseeded
    assert step.draws == expected[1:]
    torch.manual_seed(1)
    before = torch.get_rng_state()
    step = ScriptedStep([0.0] * 3)
    run_steps(step, float, 0, 3, rng=StepRng(MEASURE_SEED, per_step=True))
    assert torch.equal(torch.get_rng_state(), before)
    for k in range(3):
        with same_rng(torch.device("cpu"), MEASURE_SEED + k):
            assert step.draws[k] == float(torch.rand(()))
    with pytest.raises(ValueError, match="needs a seed"):
        StepRng(per_step=True)


def test_harness_note_says_the_slow_step_rule():
    """A configuration stopped by the slow-step rule is timed on its last step and its note says
    why (it said "timed on one step" whatever stopped it)."""
    h = Harness(load_model_spec(MODELS / "sgd_mlp.py"), torch.device("cpu"), warmup=1, steps=3)
    m = h.measure(h.model, max_step_s=1e-9)
    assert m.error is None and len(m.step_times) == 1 and m.step_s == m.step_times[0]
    assert m.note.startswith("timing stopped: a step took") and "over 4 x the 0.00 s limit" in m.note
    assert len(h.measure(h.model).step_times) == 3


def test_slow_step_guard_does_not_judge_a_step_that_compiled(monkeypatch):
    """A warm-up step of a dynamic graph that recompiles (e.g. the first batch of size 1) takes the
    compile's time: the guard skips it, and judges the next steps as usual."""
    import autoprec.training.steps as steps_mod

    counts = iter([0, 1, 1, 1])  # guard made at 0; the first step compiled; then none
    monkeypatch.setattr(steps_mod, "compile_count", lambda: next(counts))
    guard = slow_step_guard(1.0)
    stats = StepStats(1.0, False, 1.0, 1.0, 0)
    guard(0, None, stats, 30.0)  # 30x the limit, but it compiled: not judged
    guard(1, None, stats, 0.5)
    with pytest.raises(StepsTooSlow):
        guard(2, None, stats, 5.0)  # over 4x the limit, no compile
