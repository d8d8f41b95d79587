"""``tune``'s note that an eager run beat the written policy (search/results.note_if_eager_was_faster)
rests on the head-to-head's timings, which ran side by side, and never contradicts them."""

from __future__ import annotations

from types import SimpleNamespace

from autoprec.measure import Measurement, Timing
from autoprec.policy import Policy
from autoprec.search.contest import FP32_EAGER
from autoprec.search.results import note_if_eager_was_faster


def _note(capsys, chosen, screening, h2h_fp32, compiled=7583.0):
    sel = SimpleNamespace(eager_tokens_per_s={chosen.training_key(): screening},
                          timings={FP32_EAGER: Timing(tokens_per_s=h2h_fp32)} if h2h_fp32 else {})
    run = SimpleNamespace(fp32=Measurement(tokens_per_s=7000.0), quiet=False)
    note_if_eager_was_faster(run, sel, chosen, Measurement(tokens_per_s=compiled), compile=True)
    return [ln for ln in capsys.readouterr().out.splitlines() if "note:" in ln]


def test_an_all_fp32_policy_is_judged_by_the_head_to_heads_fp32_eager(capsys):
    """A fresh user's GPT-2: the all-fp32 policy's screening said 8725 tok/s eager, the head-to-head
    7151 for fp32 eager beside 7583 compiled; the note must not say eager was faster."""
    assert _note(capsys, Policy.fp32(), screening=8725.0, h2h_fp32=7151.0) == []
    (line,) = _note(capsys, Policy.fp32(), screening=1.0, h2h_fp32=9000.0)
    assert "fp32 eager ran faster (9000 tok/s) than this policy compiled (7583)" in line


def test_a_lowering_policys_own_eager_speed_still_counts(capsys):
    (line,) = _note(capsys, Policy.default("bf16"), screening=9000.0, h2h_fp32=7151.0)
    assert "this policy eager ran faster (9000 tok/s)" in line
    assert _note(capsys, Policy.default("bf16"), screening=8000.0, h2h_fp32=None) == []  # 1.05x: noise


def test_without_compile_a_policy_slower_than_the_model_as_it_is_says_so(capsys):
    """``tune --no-compile`` on a Mixtral wrote an all-fp32 policy the head-to-head timed at 0.86x
    fp32 eager (band 0.78-0.98) and said only that no policy was as fast; now a note tells the user
    to train the model as it is. A tie says nothing."""
    from autoprec.search.contest import FP32_GRAPH
    from autoprec.search.race import Contender, decide

    def timing(step_s):
        return Timing.from_steps([step_s * (1 + i / 100) for i in range(8)], 1000.0)

    def decision(policy_step_s):
        return decide([Contender(FP32_GRAPH, Policy.fp32(), timing(policy_step_s), 0.0, baseline=True),
                       Contender(FP32_EAGER, None, timing(0.10), 0.0, baseline=True)])

    run = SimpleNamespace(fp32=Measurement(tokens_per_s=10000.0), quiet=False)
    for step_s, says in ((0.116, True), (0.1005, False)):
        sel = SimpleNamespace(eager_tokens_per_s={}, timings={}, decision=decision(step_s))
        m = Measurement(tokens_per_s=1000 / step_s)
        note_if_eager_was_faster(run, sel, Policy.fp32(), m, compile=False)
        lines = [ln for ln in capsys.readouterr().out.splitlines() if "note:" in ln]
        assert bool(lines) == says, (step_s, lines)
        if says:
            assert ("the model as it is (fp32 eager, without autoprec) trained faster than this policy "
                    "eager (0.86x") in lines[0]
