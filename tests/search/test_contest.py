"""The finalists' contest (autoprec/search/contest.py), scripted: what it remembers about a policy is
keyed by the policy's content, never by object identity; candidates and their roles; the race
run again without a choice its trajectory rejects; torch.autocast as a bar or only shown."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from autoprec.errors import SearchError
from autoprec.measure import Measurement, Timing, TimingEnd
from autoprec.policy import Policy
from autoprec.search import contest as contest_mod
from autoprec.search import trajectory as trajectory_mod
from autoprec.search.autocast_baseline import AutocastBaseline
from autoprec.search.contest import Contest
from autoprec.search.drift_budget import DriftBudget
from autoprec.search.gates import Candidate, Entry, Role
from autoprec.search.progress import Clock
from autoprec.search.race import all_fp32
from autoprec.search.trajectory import TrajectoryCheck

AUTOCAST = "torch.autocast + torch.compile"
#: torch.autocast(bf16) running natively (no emulation, it can win).
AC = AutocastBaseline(torch.bfloat16)


class _TrajHarness:
    """Scripted trajectories: FP32 reference 1.0, torch.autocast 1.01 (budget 0.01), and each
    candidate function the loss its ``loss`` attribute says."""

    random = True  # timed steps are never a trajectory here (TrajectoryCheck.share gives no run)
    device = torch.device("cpu")
    batches: list = []

    def __init__(self, autocast: Measurement | None = None):
        self.graph_module, self.model = object(), object()
        self.autocast = autocast  # what measuring torch.autocast gives (Contest.measure_autocast)

    def measure(self, fn, scaler_factory=None, autocast_dtype=None, **kw):
        assert autocast_dtype is not None and self.autocast is not None, "only torch.autocast is measured"
        return self.autocast

    def reference_fn(self, fn):
        return self.graph_module

    def trajectory(self, fn, scaler_factory=None, autocast_dtype=None, steps=3, fp32_gemms=False, after=()):
        if fn is self.graph_module:
            return _steps([1.0] * steps, after)
        if autocast_dtype is not None:
            return _steps([1.01] * steps, after)
        return _steps([fn.loss] * steps, after)


def _steps(losses, after):
    """``losses`` as run_steps gives them: each step's hooks run after it (and may stop the run)."""
    for k, loss in enumerate(losses):
        for hook in after:
            hook(k, None, SimpleNamespace(loss=loss), 0.0)
    return losses


class _Fn:
    def __init__(self, loss):
        self.loss = loss


def _entry(name, pol, fn, grad_rel_l2):
    """A gated finalist: a baseline when it computes in fp32 (fp32 + torch.compile), else a policy."""
    role = Role.BASELINE if all_fp32(pol) else Role.POLICY
    return Entry(Candidate(name, role, pol), fn, Measurement(grad_rel_l2=grad_rel_l2))


def test_traj_rel_is_kept_per_policy_content_even_when_ids_collide(monkeypatch):
    """Bookkeeping keyed by ``id(Policy)`` reported another trial's ``traj_rel`` when a rejected
    policy was freed and its id reused (e.g. by ``Policy.fp32()``). With every ``id()`` in the
    module made equal, each policy still gets its own number, and an equal-content copy finds it."""
    monkeypatch.setattr(trajectory_mod, "id", lambda _obj: 7, raising=False)  # every object "reuses" one id
    check = TrajectoryCheck(_TrajHarness(), AutocastBaseline(torch.bfloat16), 3, lambda: None)
    rejected = Policy.default("bf16")
    assert not check.ok(rejected, _Fn(1.5))  # traj_rel 0.5 > torch.autocast's 0.01
    assert abs(check.of(rejected) - 0.5) < 1e-12
    assert check.reason(rejected) == "traj_rel 0.5 > 2x torch.autocast's 0.01"
    fp16 = Policy.default("fp16")
    assert check.ok(fp16, _Fn(1.001))
    assert abs(check.of(fp16) - 1e-3) < 1e-12
    assert abs(check.of(Policy.default("bf16")) - 0.5) < 1e-12  # another object, same content
    assert check.of(Policy.fp32()) == 0.0  # never checked: not the rejected policy's 0.5


def test_a_compiled_policys_trajectory_is_judged_against_compiled_fp32_and_autocast(monkeypatch):
    """A compiled candidate's reference trajectory runs on the fp32 + torch.compile graph and its
    budget on torch.autocast + torch.compile (both compiled, as the candidate); an eager one, or a
    compiled one with no compiled fp32 graph, on the eager FP32 graph and torch.autocast eager."""
    monkeypatch.setattr(trajectory_mod, "is_compiled", lambda fn: getattr(fn, "compiled", False))
    ran = []

    class H(_TrajHarness):
        def trajectory(self, fn, scaler_factory=None, autocast_dtype=None, steps=3, fp32_gemms=False,
                       after=()):
            ran.append(fn)
            if fn is fp32_c:
                return _steps([1.0] * steps, after)
            if fn is ac_c:
                return _steps([1.02] * steps, after)
            return super().trajectory(fn, scaler_factory, autocast_dtype, steps, after=after)

    h = H()
    fp32_c, ac_c = _Fn(1.0), _Fn(1.0)
    cand = _Fn(1.01)
    cand.compiled = True
    check = TrajectoryCheck(h, AutocastBaseline(torch.bfloat16), 3, lambda: ac_c, lambda: fp32_c)
    assert check.ok(Policy.default("bf16"), cand) and check.budget == pytest.approx(0.02)
    assert ran == [fp32_c, cand, ac_c]
    ran.clear()
    eager = _Fn(1.01)
    assert check.ok(Policy.default("fp16"), eager) and check.budget == pytest.approx(0.01)
    assert ran == [h.graph_module, eager, h.model]
    ran.clear()
    none = TrajectoryCheck(h, AutocastBaseline(torch.bfloat16), 3, lambda: ac_c)  # no compiled fp32 graph
    assert none.ok(Policy.default("bf16"), cand) and ran == [h.graph_module, cand, h.model]


def test_training_key_ignores_measurements_and_provenance():
    """Two policies that train identically share a key; another rule gives another key."""
    p = Policy.default("bf16")
    q = p.with_measured({"tokens_per_s": 1.0}).with_provenance(model="m.py")
    assert p.training_key() == q.training_key()
    assert p.training_key() != Policy.default("fp16").training_key()


def test_candidates_always_include_twin_also_and_fp32_once():
    """The twin, the ``also`` policies (the twin with math attention, whose gain eager screening
    cannot see) and all-fp32 are compiled finalists whatever the trials, each once."""
    import dataclasses

    import optuna

    from autoprec.search import attrs

    twin = Policy.autocast("bf16")
    math = dataclasses.replace(twin, attention="math")
    sel = Contest(_TrajHarness(), DriftBudget.fixed(1.0), True, AC, None, 0, Clock(), True,
                   twin=twin, also=[(math, "autocast twin, math attention")])
    trial = optuna.trial.create_trial(values=[100.0, 1e-3, 1.0], user_attrs={attrs.POLICY: math.to_dict()},
                                      distributions={}, params={})
    for feasible, expect in (([], ["autocast twin", "autocast twin, math attention"]),
                             # the trial is the math twin
                             ([trial], ["trial -1 (eager 100 tok/s)", "autocast twin"])):
        labels = [c.name for c in sel.candidates(feasible, 2)]
        assert labels == [*expect, "fp32 + torch.compile"]
        keys = [c.policy.training_key() for c in sel.candidates(feasible, 2)]
        assert len(keys) == len(set(keys)) and Policy.fp32().training_key() in keys


def test_where_autocast_cannot_win_the_twin_is_a_finalist_only_as_a_trial():
    """With the bar not run (``cannot_win`` on a graph without random numbers) the twin and its math
    attention variant are not forced: the finalists are the fastest trials (the math twin among
    them here, by its eager speed) and all-fp32; on a graph that draws random numbers the bar runs
    and the twin is forced again."""
    import dataclasses

    import optuna

    from autoprec.search import attrs

    twin = Policy.autocast("bf16")
    math = dataclasses.replace(twin, attention="math")
    h = _TrajHarness()
    h.random = False
    cannot = AutocastBaseline(torch.bfloat16, cannot_win="too slow")
    sel = Contest(h, DriftBudget.fixed(1.0), True, cannot, None, 0, Clock(), True, twin=twin,
                  also=[(math, "autocast twin, math attention")])
    trial = optuna.trial.create_trial(values=[100.0, 1e-3, 1.0], user_attrs={attrs.POLICY: math.to_dict()},
                                      distributions={}, params={})
    assert [c.name for c in sel.candidates([], 2)] == ["fp32 + torch.compile"]
    assert [c.name for c in sel.candidates([trial], 2)] == ["trial -1 (eager 100 tok/s)",
                                                                   "fp32 + torch.compile"]
    h.random = True
    labels = [c.name for c in sel.candidates([], 2)]
    assert labels == ["autocast twin", "autocast twin, math attention", "fp32 + torch.compile"]


def test_only_the_choice_pays_its_trajectory_and_a_rejected_choice_gives_way(monkeypatch, capsys):
    """The head-to-head (scripted: A fastest, B next, the twin C slower, then all-fp32) chooses A;
    A's trajectory fails (traj_rel 0.5 > 2x torch.autocast's 0.01), so A is rejected with the
    reason in its point, and the others are timed again without A (retire and stop rules that
    never saw A) and the decision taken again: B, whose trajectory passes. C's trajectory is never
    run, nor all-fp32's (it lowers nothing)."""
    speeds = {"A": 0.050, "B": 0.060, "C": 0.080, "fp32 + torch.compile": 0.100, "fp32 eager": 0.200}
    timed: list[list[str]] = []

    def scripted(h, configs, retire, settled, **kw):
        timed.append([c.name for c in configs])
        assert callable(retire) and callable(settled)
        return {c.name: Timing.from_steps([speeds[c.name] * (1 + 0.01 * i) for i in range(6)], 100.0,
                                          rounds=3) for c in configs}

    monkeypatch.setattr(contest_mod, "time_interleaved", scripted)
    h = _TrajHarness()
    ran: list[object] = []
    trajectory = h.trajectory
    h.trajectory = lambda fn, *a, **kw: ran.append(fn) or trajectory(fn, *a, **kw)
    sel = Contest(h, DriftBudget.fixed(1.0), True, AC, None, 3, Clock(), False)
    a, b, c = Policy.default("bf16"), Policy.default("fp16"), Policy.autocast("bf16")
    fns = {"A": _Fn(1.5), "B": _Fn(1.001), "C": _Fn(9.0)}
    for pol in (a, b, c, Policy.fp32()):
        sel.finalists.add(pol, Measurement(grad_rel_l2=1e-3))
    survivors = [_entry(name, pol, fns[name], 1e-3) for name, pol in (("A", a), ("B", b), ("C", c))]
    survivors.append(_entry("fp32 + torch.compile", Policy.fp32(), _Fn(1.0), 0.0))
    chosen, _m = sel.race(survivors)
    assert chosen is b and sel.decision.chosen.name == "B" and sel.decision.rejected == ["A"]
    assert "after A failed the trajectory check" in sel.decision.describe()
    assert timed == [["A", "B", "C", "fp32 + torch.compile", "fp32 eager"],
                     ["B", "C", "fp32 + torch.compile", "fp32 eager"]]
    # reference, A, torch.autocast (all K steps: A fails), B (torch.autocast's steps are kept)
    assert ran == [h.graph_module, fns["A"], h.model, fns["B"]]
    assert sel.trajectory.of(c) == 0.0 and abs(sel.trajectory.of(b) - 1e-3) < 1e-12
    out = capsys.readouterr().out
    assert "A -> rejected: traj_rel 0.5 > 2x torch.autocast's 0.01; the others timed again" in out
    assert "B: traj_rel 0.001 over 3 steps (torch.autocast's 0.01)" in out  # all 3 steps ran for A
    point = next(p for p in sel.finalists.rows if p["key"] == a.training_key())
    assert point["rejected"] == "traj_rel 0.5 > 2x torch.autocast's 0.01"


def test_a_head_to_head_whose_every_policy_fails_the_trajectory_is_a_search_error(monkeypatch):
    """Every lowered contender fails and the all-fp32 one errored: a SearchError that names the
    rejected, and no decision is left behind."""
    monkeypatch.setattr(contest_mod, "time_interleaved", lambda h, configs, **kw: {
        c.name: Timing.from_steps([0.1] * 6, 100.0) for c in configs})
    sel = Contest(_TrajHarness(), DriftBudget.fixed(1.0), True, AC, None, 3, Clock(), True)
    survivors = [_entry("A", Policy.default("bf16"), _Fn(1.5), 1e-3)]
    with pytest.raises(SearchError, match="after A failed the trajectory check"):
        sel.race(survivors)
    assert sel.decision is None


def test_without_compile_the_bar_is_torch_autocast_eager(monkeypatch):
    """A --no-compile tune times its eager finalists against torch.autocast eager and fp32 eager
    (an H200 wrote an fp16 twin at 0.83x torch.autocast eager and said nothing): scripted, torch.autocast
    eager is fastest and no policy ties with it, so the fastest policy (the twin) is written and the
    decision line says by how much it trails torch.autocast eager; the all-fp32 policy is
    ``all-fp32``, not ``fp32 + torch.compile``."""
    speeds = {"twin": 0.060, "all-fp32": 0.100, "torch.autocast eager": 0.050, "fp32 eager": 0.100}
    timed: list[list[str]] = []

    def scripted(h, configs, retire, settled, **kw):
        timed.append([c.name for c in configs])
        return {c.name: Timing.from_steps([speeds[c.name] * (1 + 0.01 * i) for i in range(6)], 100.0,
                                          rounds=3) for c in configs}

    monkeypatch.setattr(contest_mod, "time_interleaved", scripted)
    h = _TrajHarness(autocast=Measurement(grad_rel_l2=1e-3))
    sel = Contest(h, DriftBudget.fixed(1.0), False, AC, None, 0, Clock(), True)
    assert sel.ac_label == "torch.autocast eager"
    sel.measure_autocast()
    assert sel.autocast_eager is h.autocast and sel.autocast_compiled is None
    twin = Policy.autocast("bf16")
    survivors = [_entry("twin", twin, _Fn(1.0), 1e-3), _entry("all-fp32", Policy.fp32(), _Fn(1.0), 0.0)]
    chosen, _m = sel.race(survivors)
    assert timed == [["twin", "all-fp32", "torch.autocast eager", "fp32 eager"]]
    assert chosen is twin and sel.decision.verdict == "slower"
    assert sel.decision.best_baseline.name == "torch.autocast eager"
    line = sel.decision.describe()
    assert line.startswith("chosen: twin, 0.83x torch.autocast eager (band 0.8")
    assert line.endswith("no policy was as fast as torch.autocast eager within the noise")
    assert sel.autocast_eager.tokens_per_s == sel.timings["torch.autocast eager"].tokens_per_s  # its speed
    labels = [c.name for c in sel.candidates([], 2)]
    assert labels == ["all-fp32"]


def test_without_compile_the_also_policies_are_left_out():
    """The ``also`` policies (the twin with math attention) only pay compiled: an eager tune does
    not re-measure them."""
    import dataclasses

    twin = Policy.autocast("bf16")
    math = dataclasses.replace(twin, attention="math")
    sel = Contest(_TrajHarness(), DriftBudget.fixed(1.0), False, AC, None, 0, Clock(), True,
                   twin=twin, also=[(math, "autocast twin, math attention")])
    assert [c.name for c in sel.candidates([], 2)] == ["autocast twin", "all-fp32"]


def test_torch_autocast_over_the_memory_budget_is_no_bar(monkeypatch):
    """Under --max-memory a baseline the budget excludes is not what the user could run: torch.autocast,
    fastest but over the budget, is timed (the table reports it) but not decided against, so the
    twin is written as beating the best admissible baseline (fp32 eager), not as a tie with it."""
    speeds = {"twin": 0.060, "torch.autocast eager": 0.050, "fp32 eager": 0.100}
    monkeypatch.setattr(contest_mod, "time_interleaved", lambda h, configs, **kw: {
        c.name: Timing.from_steps([speeds[c.name] * (1 + 0.01 * i) for i in range(6)], 100.0, rounds=3)
        for c in configs})
    h = _TrajHarness(autocast=Measurement(grad_rel_l2=1e-3, peak_bytes=300 * 2**20))
    sel = Contest(h, DriftBudget.fixed(1.0), False, AC, None, 0, Clock(), True)
    sel.measure_autocast()
    sel.memory_budget = 200 * 2**20
    twin = Policy.autocast("bf16")
    chosen, _m = sel.race([_entry("twin", twin, _Fn(1.0), 1e-3)])
    assert chosen is twin and "torch.autocast eager" in sel.timings
    assert sel.decision.best_baseline.name == "fp32 eager" and sel.decision.verdict == "beats"


def test_with_slow_native_gemms_autocasts_trajectory_runs_eagerly_with_its_gemms_in_fp32(monkeypatch):
    """An emulated baseline (the drift's rule: native GEMMs slow): torch.autocast's trajectory, the budget,
    runs eagerly under Fp32ComputeGemms even against the compiled fp32 graph, never compiling it
    (K native steps cost ~9.5 s each on a 24-layer Qwen2 on an AVX2-only CPU); on a graph that draws
    random numbers the compiled bar runs as before (its masks are Inductor's)."""
    monkeypatch.setattr(trajectory_mod, "is_compiled", lambda fn: getattr(fn, "compiled", False))
    ran = []

    class H(_TrajHarness):
        random = False

        def trajectory(self, fn, scaler_factory=None, autocast_dtype=None, steps=3, fp32_gemms=False,
                       after=()):
            ran.append((fn, fp32_gemms))
            if fn is fp32_c:
                return _steps([1.0] * steps, after)
            return super().trajectory(fn, scaler_factory, autocast_dtype, steps, after=after)

    h = H()
    fp32_c, cand = _Fn(1.0), _Fn(1.01)
    cand.compiled = True
    emulated = AutocastBaseline(torch.bfloat16, emulated="native bf16 GEMMs slow")
    check = TrajectoryCheck(h, emulated, 3, lambda: pytest.fail("compiled torch.autocast"), lambda: fp32_c)
    assert check.ok(Policy.default("bf16"), cand) and check.budget == pytest.approx(0.01)
    assert ran == [(fp32_c, False), (cand, False), (h.model, True)]
    ran.clear()
    H.random = True
    ac_c = _Fn(1.02)
    check = TrajectoryCheck(h, emulated, 3, lambda: ac_c, lambda: fp32_c)
    check.ok(Policy.default("bf16"), cand)
    assert ran[2] == (ac_c, False)


def test_autocasts_trajectory_with_gemms_in_fp32_is_its_native_one(monkeypatch):
    """On a real model (micro_lm, 3 AdamW steps) torch.autocast(bf16)'s losses with its GEMMs
    computed in fp32 (rounded as native ones round; every step's GEMMs go through the mode) match
    its native losses to within bf16's summation-order noise, far closer than either is to fp32's."""
    from autoprec.measure import Harness
    from autoprec.measure import harness as harness_mod
    from autoprec.metrics import traj_rel
    from autoprec.modelspec import load_model_spec
    from tests.conftest import MODELS, spy_fp32_gemms

    modes, _ = spy_fp32_gemms(monkeypatch, harness_mod)
    h = Harness(load_model_spec(MODELS / "micro_lm.py"), torch.device("cpu"), warmup=1, steps=2)
    fp32 = h.trajectory(h.graph_module, steps=3)
    native = h.trajectory(h.model, autocast_dtype=torch.bfloat16, steps=3)
    assert not modes
    emulated = h.trajectory(h.model, autocast_dtype=torch.bfloat16, steps=3, fp32_gemms=True)
    assert len(modes) == 1 and modes[0].count >= 3 * 3  # forward and backward GEMMs of 3 steps
    assert traj_rel(native, fp32) > 1e-5
    assert traj_rel(emulated, fp32) == pytest.approx(traj_rel(native, fp32), rel=0.25)
    assert traj_rel(emulated, native) < 0.25 * traj_rel(native, fp32)


def test_torch_autocast_over_the_budget_gets_its_log_line_too(monkeypatch, capsys):
    """torch.autocast + torch.compile over the drift budget is timed beside the contenders for the
    table; the log announced it in the head-to-head but printed no line for it."""
    speeds = {"A": 0.050, "fp32 + torch.compile": 0.100, "torch.autocast + torch.compile": 0.060,
              "fp32 eager": 0.200}

    def scripted(h, configs, retire, settled, **kw):
        return {c.name: Timing.from_steps([speeds[c.name] * (1 + 0.01 * i) for i in range(6)], 100.0,
                                          rounds=3) for c in configs}

    monkeypatch.setattr(contest_mod, "time_interleaved", scripted)
    monkeypatch.setattr(contest_mod, "compile_graph", lambda gm, budget=1.0, dynamic=None, **kw: gm)
    over = Measurement(grad_rel_l2=5e-3, grad_rel_l2_batches=[5e-3] * 4)  # over 1e-3
    sel = Contest(_TrajHarness(autocast=over), DriftBudget.fixed(1e-3), True, AC,
                  None, 0, Clock(), False)
    sel.measure_autocast()
    survivors = [_entry("A", Policy.fp32(), _Fn(1.0), 0.0),
                 _entry("fp32 + torch.compile", Policy.fp32(), _Fn(1.0), 0.0)]
    sel.race(survivors)
    assert "torch.autocast + torch.compile" in sel.timings  # timed for the table ...
    assert sel.decision.best_baseline.name != "torch.autocast + torch.compile"  # ... no bar, no contender
    out = capsys.readouterr().out
    assert "[autoprec]   torch.autocast + torch.compile: 1" in out, out
    assert "(over the drift or memory budget: not a bar)" in out, out


def test_autocasts_trajectory_runs_only_the_steps_the_verdict_needs(monkeypatch, capsys):
    """torch.autocast's ``traj_rel`` over its first j steps bounds its K-step one from below, so its
    steps stop once 2x that bound reaches the candidate's ``traj_rel``; a later candidate that needs
    more runs them again, further; a failing one needs all K, and its verdict and budget are the
    K-step ones; the head-to-head's log line says over how many steps the budget was taken.
    Scripted: FP32 1.0 each step, torch.autocast 1.001, 1.002, 1.004, 1.008."""
    ac_losses = [1.001, 1.002, 1.004, 1.008]
    ran: list[int] = []

    class H(_TrajHarness):
        def trajectory(self, fn, scaler_factory=None, autocast_dtype=None, steps=3, fp32_gemms=False,
                       after=()):
            if autocast_dtype is None:
                return super().trajectory(fn, scaler_factory, autocast_dtype, steps, after=after)
            done: list[float] = []
            try:
                for loss in ac_losses[:steps]:
                    done.append(loss)
                    _steps([loss], after)
            finally:
                ran.append(len(done))
            return done

    check = TrajectoryCheck(H(), AutocastBaseline(torch.bfloat16), 4, lambda: None)
    assert check.ok(Policy.default("bf16"), _Fn(1.001))  # needs autocast's >= 0.0005: one step
    assert ran == [1] and check.budget_steps == 1 and check.budget == pytest.approx(0.001)
    assert check.ok(Policy.default("fp16"), _Fn(1.007))  # needs >= 0.0035: three steps
    assert ran == [1, 3] and check.budget_steps == 3 and check.budget == pytest.approx(0.004)
    sel = Contest(H(), DriftBudget.fixed(1.0), False, AC, None, 4, Clock(), False)
    sel.trajectory = check
    monkeypatch.setattr(contest_mod, "time_interleaved", lambda h, configs, **kw: {
        c.name: Timing.from_steps([0.1] * 6, 100.0, rounds=3) for c in configs})
    sel.race([_entry("B", Policy.default("fp16"), _Fn(1.007), 1e-3)])
    assert "B: traj_rel 0.007 over 4 steps (torch.autocast's 0.004 or more: 3 of its steps decided)" in \
        capsys.readouterr().out
    assert check.ok(Policy.default("fp16"), _Fn(1.0005))  # the steps kept decide: none run
    assert ran == [1, 3] and check.budget == pytest.approx(0.004)
    assert not check.ok(Policy.autocast("bf16"), _Fn(1.02))  # 0.02 > 2 x 0.008 after all four
    assert ran == [1, 3, 4] and check.budget_steps == 4 and check.budget == pytest.approx(0.008)
    assert check.reason(Policy.autocast("bf16")) == "traj_rel 0.02 > 2x torch.autocast's 0.008"
    assert check.ok(Policy.default("bf16"), _Fn(1.016)) and ran == [1, 3, 4]  # 0.016 <= 2 x 0.008


def _rates(speeds, retired=()):
    """A scripted ``time_interleaved``: each configuration's six steps at its step time (seconds),
    3 rounds; those named in ``retired`` stopped by the retire rule."""
    def scripted(h, configs, retire, settled, **kw):
        out = {}
        for c in configs:
            t = Timing.from_steps([speeds[c.name] * (1 + 0.01 * i) for i in range(6)], 100.0, rounds=3)
            t.end = TimingEnd.RETIRED if c.name in retired else TimingEnd.TIMED
            out[c.name] = t
        return out
    return scripted


def test_gates_give_one_typed_outcome_each_and_the_first_failure_wins():
    """The drift gate passes a failed measurement's own outcome on and explains a drift over the
    budget; the memory gate gives the peak against the budget with the lever to try; the first
    gate that fails decides."""
    from autoprec.measure import Outcome, Stage
    from autoprec.search.gates import DriftGate, MemoryGate, first_failure

    pol = Policy.default("bf16")
    def entry(name, **m):
        return Entry(Candidate(name, Role.POLICY, pol), None, Measurement(**m))

    ok = entry("A", grad_rel_l2=1e-3, peak_bytes=100 * 2**20)
    over = entry("B", grad_rel_l2=5e-2, peak_bytes=300 * 2**20)
    broken = entry("C", outcome=Outcome.failed("non-finite loss"))
    drift, memory = DriftGate(DriftBudget.fixed(1e-2)), MemoryGate(200 * 2**20, compile=True, random=False)
    assert drift.judge(ok).going_on and memory.judge(ok).going_on
    assert drift.judge(broken) == Outcome.failed("non-finite loss")
    assert drift.judge(over).stage is Stage.FAILED and "--max-drift 1.00e-02" in drift.judge(over).reason
    assert memory.judge(over).reason.startswith("peak 300.0 MiB > memory budget 200.0 MiB")
    assert "recomputation" in memory.judge(over).reason
    assert "--no-compile" in MemoryGate(200 * 2**20, compile=False).judge(over).reason
    assert first_failure(over, [drift, memory]) == drift.judge(over)  # drift first, as the log says
    assert first_failure(over, [memory, drift]) == memory.judge(over)
    assert first_failure(ok, [drift, memory]).going_on and MemoryGate(None).judge(over).going_on


def test_a_tie_goes_to_the_lower_drift_policy_and_says_tie(monkeypatch, capsys):
    """Two policies as fast as torch.autocast + torch.compile within the noise: the lower-drift one
    is written, and the decision says tie (with torch.autocast, which is no policy)."""
    speeds = {"searched": 0.1000, "twin": 0.1002, AUTOCAST: 0.1001, "fp32 + torch.compile": 0.2,
              "fp32 eager": 0.3}
    monkeypatch.setattr(contest_mod, "time_interleaved", _rates(speeds))
    monkeypatch.setattr(contest_mod, "compile_graph", lambda gm, budget=1.0, dynamic=None, **kw: gm)
    h = _TrajHarness(autocast=Measurement(grad_rel_l2=7e-3, grad_rel_l2_batches=[7e-3] * 4))
    h.random = False
    sel = Contest(h, DriftBudget.auto([7e-3] * 4), True, AC, None, 0, Clock(), True)
    sel.measure_autocast()
    survivors = [_entry("searched", Policy.default("bf16"), _Fn(1.0), 7.2e-3),
                 _entry("twin", Policy.autocast("bf16"), _Fn(1.0), 7.0e-3),
                 _entry("fp32 + torch.compile", Policy.fp32(), _Fn(1.0), 0.0)]
    chosen, _m = sel.race(survivors)
    d = sel.decision
    assert d.chosen.name == "twin" and chosen == Policy.autocast("bf16") and d.verdict == "tie"
    assert d.best_baseline.name == AUTOCAST
    assert "tie, the lower-drift, simpler of twin, searched" in d.describe()


def test_a_retired_contender_is_never_the_choice_even_if_its_rounds_were_faster(monkeypatch):
    """The race retired A after its rounds (on a machine whose speed drifts its rate may stand above
    the others' later ones): it takes no role in the decision; B is written."""
    speeds = {"A": 0.05, "B": 0.06, "fp32 + torch.compile": 0.2, "fp32 eager": 0.3}
    monkeypatch.setattr(contest_mod, "time_interleaved", _rates(speeds, retired={"A"}))
    sel = Contest(_TrajHarness(), DriftBudget.fixed(1.0), False, AC, None, 0, Clock(), True)
    survivors = [_entry("A", Policy.default("bf16"), _Fn(1.0), 1e-3),
                 _entry("B", Policy.default("fp16"), _Fn(1.0), 1e-3),
                 _entry("fp32 + torch.compile", Policy.fp32(), _Fn(1.0), 0.0)]
    sel.race(survivors)
    assert sel.decision.chosen.name == "B" and sel.decision.fastest.name == "B"
    assert sel.timings["A"].retired and "A" not in sel.decision.tied


def test_the_emulated_avx2_baseline_is_not_raced_and_fp32_compile_is_the_bar(monkeypatch):
    """An AVX2-only CPU: torch.autocast's native GEMMs cannot win (the probe's bound), so the
    contest neither compiles nor times it, its row says why, the twin is no forced finalist, and
    fp32 + torch.compile is the baseline to beat."""
    monkeypatch.setattr(contest_mod, "compile_graph", lambda *a, **kw: pytest.fail("compiled torch.autocast"))
    speeds = {"trial 3": 0.105, "fp32 + torch.compile": 0.100, "fp32 eager": 0.130}
    monkeypatch.setattr(contest_mod, "time_interleaved", _rates(speeds))
    why = "its native bf16 GEMMs alone take 7.07 s or more per step"
    avx2 = AutocastBaseline(torch.bfloat16, emulated="native bf16 GEMMs measured 33.4x fp32's time",
                            cannot_win=why)
    h = _TrajHarness()
    h.random = False
    sel = Contest(h, DriftBudget.auto([8e-3] * 4), True, avx2, None, 0, Clock(), True,
                  twin=Policy.autocast("bf16"))
    sel.measure_autocast()
    assert sel.autocast_compiled.note == f"not compiled: {why}"
    assert [c.name for c in sel.candidates([], 2)] == ["fp32 + torch.compile"]  # the twin is not forced
    sel.race([_entry("trial 3", Policy.default("bf16"), _Fn(1.0), 3e-4),
              _entry("fp32 + torch.compile", Policy.fp32(), _Fn(1.0), 0.0)])
    assert AUTOCAST not in sel.timings
    d = sel.decision
    assert d.chosen.name == "fp32 + torch.compile" and d.chosen is d.best_baseline


def test_compile_variants_race_the_choice_and_the_faster_variants_options_are_written(monkeypatch, capsys):
    """``compile_variants``: the choice, compiled in regions with emulated casts, against itself
    flat and with fp32 intermediates (each measured and gated), in a second head-to-head with the
    baselines; the fastest's options are the written policy's, and a tie keeps the choice."""
    import dataclasses

    from autoprec.policy import REGIONAL_EMULATED, CompileOptions

    built = []

    class Compiled(_Fn):
        def __init__(self, options):
            super().__init__(1.0)
            self.options, self.regions = options, SimpleNamespace(blocks=3)

    def compile_graph(gm, budget=1.0, dynamic=None, regional=True, emulate_precision_casts=True):
        built.append(CompileOptions(regional, emulate_precision_casts))
        return Compiled(built[-1])

    class H(_TrajHarness):
        random = False

        def measure(self, fn, scaler_factory=None, autocast_dtype=None, **kw):
            # the variants' drift a little below the choice's (the compile's summation order): a
            # tie still keeps the choice (it had gone to the variant by drift)
            return Measurement(grad_rel_l2=6.9e-3, grad_rel_l2_batches=[6.9e-3] * 4)

    monkeypatch.setattr(contest_mod, "compile_graph", compile_graph)
    monkeypatch.setattr(contest_mod, "run_pipeline", lambda gm, pol: SimpleNamespace(graph_module=gm))

    def tune(flat_s, which="all"):
        speeds = {"twin": 0.10, "twin, compiled flat": flat_s, "fp32 + torch.compile": 0.20,
                  "fp32 eager": 0.30, "twin, compiled regional, fp32 intermediates": 0.11}
        monkeypatch.setattr(contest_mod, "time_interleaved", _rates(speeds))
        built.clear()
        sel = Contest(H(), DriftBudget.fixed(1.0), True, AC, None, 0, Clock(), False, compile_variants=which)
        twin = Entry(Candidate("twin", Role.POLICY, Policy.autocast("bf16")), Compiled(REGIONAL_EMULATED),
                     Measurement(grad_rel_l2=7e-3))
        fp32 = _entry("fp32 + torch.compile", Policy.fp32(), _Fn(1.0), 0.0)
        return sel, sel.race([twin, fp32])

    sel, (chosen, _m) = tune(flat_s=0.08)
    assert built == [CompileOptions(False, True), CompileOptions(True, False)]  # one compile per variant
    assert chosen == dataclasses.replace(Policy.autocast("bf16"), compile_options=CompileOptions(False, True))
    assert sel.decision.chosen.name == "twin, compiled flat" and sel.decision.verdict == "beats"
    assert "compile variant twin, compiled flat: grad_rel_l2 0.0069" in capsys.readouterr().out
    assert sel.recorded_options(chosen) == CompileOptions(False, True)
    sel, (chosen, _m) = tune(flat_s=0.1001)  # a tie: the choice as first compiled
    assert chosen == Policy.autocast("bf16") and sel.decision.chosen.name == "twin"
    assert sel.recorded_options(chosen) == REGIONAL_EMULATED  # its compile outlined 3 blocks
    sel._chosen_fn.regions = None  # a model without repeated blocks: compiled flat, recorded flat
    assert sel.recorded_options(chosen) == CompileOptions(False, True)
    saved = dataclasses.replace(chosen, activation_memory_budget=0.5)  # kept flat by its budget
    sel._chosen_fn.regions = SimpleNamespace(blocks=3)
    assert sel.recorded_options(saved) == CompileOptions(False, True)
    assert [n for n, _p, _m in sel.variants] == ["twin", "twin, compiled flat",
                                                  "twin, compiled regional, fp32 intermediates"]
    flat = [CompileOptions(False, True)]
    assert contest_mod.variant_options(Policy.fp32(), Compiled(REGIONAL_EMULATED)) == flat  # no casts
    assert contest_mod.variant_options(Policy.autocast("bf16"), _Fn(1.0)) == [CompileOptions(True, False)]
    # the default: the flat variant only; "none": no variant is compiled
    _sel, (chosen, _m) = tune(flat_s=0.08, which="flat")
    assert built == [CompileOptions(False, True)] and chosen.compile_options == CompileOptions(False, True)
    _sel, (chosen, _m) = tune(flat_s=0.08, which="none")
    assert built == [] and chosen == Policy.autocast("bf16")
    assert Contest.__init__.__defaults__[-1] == "flat"
    arg = contest_mod.compile_variants_arg
    assert arg(True) == "all" and arg(False) == "none" and arg("flat") == "flat"
    with pytest.raises(ValueError, match="compile_variants: expected one of none, flat, all, got 'both'"):
        contest_mod.compile_variants_arg("both")
