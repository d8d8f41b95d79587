"""Committed tunes replayed through the finalists' contest (autoprec/search/contest.py, issue 53).

Each committed ``tune`` log under benchmarks/results holds what its finalists' contest measured:
each finalist's compiled drift (``compiled: grad_rel_l2 ...``, or ``-> rejected: ...``), whether
torch.autocast + torch.compile ran (not where it cannot win), the head-to-head's tokens/s with
their noise bands (and which contenders the race retired), and the decision it wrote. The replay
feeds those measurements through today's contest: the drift gate on each finalist, then
:meth:`Contest.race` with torch.autocast measured as recorded and ``time_interleaved`` giving
back the recorded rates (step times whose bootstrap band is the recorded one). It must write the
same policy with the same verdict. Three kinds of machine: AVX2 only (torch.autocast cannot win
there), AVX512-BF16 and AMX (each file's ``machine.json``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from autoprec.measure import Measurement, Timing, TimingEnd
from autoprec.policy import Policy
from autoprec.search import contest as contest_mod
from autoprec.search.autocast_baseline import AutocastBaseline
from autoprec.search.contest import Contest
from autoprec.search.drift_budget import DriftBudget
from autoprec.search.gates import Candidate, DriftGate, Entry, Role
from autoprec.search.progress import Clock

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"

#: (log, machine kind): the committed tunes replayed.
LOGS = [
    ("depth_2026-12-06e_traj_backoff/run1/tune_l4.log", "AVX2"),
    ("depth_2026-12-06e_traj_backoff/run1/tune_l24.log", "AVX2"),
    ("depth_2026-12-06e_traj_backoff/run2/tune_l24.log", "AVX2"),
    ("attention_math_2026-12-02/qwen2_tiny_run1/tune.log", "AVX512-BF16"),
    ("attention_math_2026-12-02/qwen2_tiny_run2/tune.log", "AVX512-BF16"),
    ("attention_math_2026-12-02/qwen2_deep/tune.log", "AVX512-BF16"),
    ("depth_2026-12-02/tune_l4.log", "AMX"),
    ("depth_2026-12-02/tune_l24.log", "AMX"),
]
AUTOCAST = "torch.autocast + torch.compile"


@dataclass
class Recorded:
    """What one tune log says of its finalists' contest."""

    budget: DriftBudget
    cannot_win: str | None = None
    #: (label, policy summary, grad_rel_l2, why rejected or None) per finalist, in order
    finalists: list[tuple[str, str, float, str | None]] = field(default_factory=list)
    rates: dict[str, tuple[float, float, bool]] = field(default_factory=dict)  # tok/s, ±, retired
    autocast_shown: bool = False  # timed, but "over the drift or memory budget: not a bar"
    chosen: str = ""
    verdict: str = ""


def _lines(path: Path) -> list[str]:
    """The log's ``[autoprec]`` lines, progress bars' redraws included (they share physical lines
    with log lines, and a bar's redraw may have overwritten a finalist's line: the bar's step names
    the finalist then)."""
    return [m.group(0).rstrip() for m in re.finditer(r"\[autoprec\](?:[^\[]|\[\d\d:)*(?:[^\[]*\])?[^\[]*",
                                                    path.read_text())]


def _parse(path: Path) -> Recorded:
    rec: Recorded | None = None
    last_finalist: tuple[str, str] | None = None
    # the written policy's summary (its "chosen:" line, printed after the log): a finalist whose own
    # line a progress bar overwrote is named by the bar's step, its summary then this one's
    written = re.search(r"^chosen: (.+)$", path.read_text(), re.M)
    for line in _lines(path):
        text = line[len("[autoprec]"):]
        if "%|" in text:
            if (m := re.search(r"s/step, (.+?)\]", text)) and m.group(1) not in (AUTOCAST, "head-to-head") \
                    and (last_finalist is None or last_finalist[0] != m.group(1)):
                last_finalist = (m.group(1), written.group(1) if written else "")
            continue
        if m := re.search(r"drift budget: torch\.autocast's grad_rel_l2 \(mean ([0-9.e+-]+) over "
                          r"(\d+) batches\)", text):
            rec = Recorded(DriftBudget.auto([float(m.group(1))] * int(m.group(2))))
        elif m := re.search(r"drift budget: --max-drift ([0-9.e+-]+)", text):
            rec = Recorded(DriftBudget.fixed(float(m.group(1))))
        elif m := re.match(rf" {re.escape(AUTOCAST)}: not compiled, (.*): it cannot be the baseline to beat",
                           text):
            rec.cannot_win = m.group(1)
        elif m := re.match(r" finalist (.+?): (.+)$", text):
            last_finalist = (m.group(1), m.group(2))
        elif m := re.match(r"   (?:compiled|eager): grad_rel_l2 ([0-9.e+-]+|inf)(?:, traj_rel \S+)?"
                           r"(?: -> rejected: (.*))?$", text):
            rec.finalists.append((*last_finalist, float(m.group(1)), m.group(2)))
        elif m := re.match(r"   (.+?): (\d+) ±([0-9.]+)% tok/s(?: \((.*)\))?$", text):
            note = m.group(4) or ""
            rec.rates[m.group(1)] = (float(m.group(2)), float(m.group(3)) / 100, "out of the running" in note)
            rec.autocast_shown |= m.group(1) == AUTOCAST and "not a bar" in note
        elif text.startswith(" chosen: "):
            rec.chosen, rec.verdict = _decision(text[len(" chosen: "):])
    return rec


def _decision(line: str) -> tuple[str, str]:
    """The chosen name and verdict of a decision line (``Decision.describe``)."""
    if m := re.match(r"(.+), the fastest baseline: ", line):
        return m.group(1), "baseline"
    m = re.match(r"(.+), [0-9.]+x .+? \(band [^)]*\): (beats|tie|no policy was as fast)", line)
    return m.group(1), {"beats": "beats", "tie": "tie", "no policy was as fast": "slower"}[m.group(2)]


def _timing(tokens_per_s: float, half_width: float, retired: bool) -> Timing:
    """Twelve step times at ``1 / tokens_per_s`` seconds (one token a step) whose bootstrap band
    of the median is ``±half_width`` (within 10% of it), as the head-to-head recorded."""
    step = 1.0 / tokens_per_s
    offsets = [(i - 5.5) / 5.5 for i in range(12)]
    lo, hi = 0.0, 1.0
    for _ in range(40):  # the spread whose band is the recorded one (bisection: the band grows with it)
        mid = (lo + hi) / 2
        t = Timing.from_steps([step * (1 + mid * o) for o in offsets], 1.0)
        lo, hi = (mid, hi) if t.rel_half_width() < half_width else (lo, mid)
    t = Timing.from_steps([step * (1 + lo * o) for o in offsets], 1.0)
    assert t.rel_half_width() == pytest.approx(half_width, rel=0.1, abs=1e-3)
    t.end = TimingEnd.RETIRED if retired else TimingEnd.TIMED
    return t


def _policy(label: str, summary: str) -> Policy:
    """A stand-in policy with the race's view of the recorded one: all-fp32 or not, and its number
    of rules (the tie order's second key)."""
    fp32 = summary.split(";")[0].strip() == "default fp32" and not re.search(
        r"->(?!fp32)|\+\d+ more|node rule|attention math", summary)
    base = Policy.fp32() if fp32 else Policy.default("bf16")
    n = summary.count("->") + sum(int(x) for x in re.findall(r"\+(\d+) more rules", summary))
    return base if n == len(base.rules) else _with_rules(base, n)


def _with_rules(base: Policy, n: int) -> Policy:
    import dataclasses

    from autoprec.policy import Rule

    rules = tuple(Rule(node=f"replay/node#{i}", dtype=base.default_dtype) for i in range(n))
    return dataclasses.replace(base, rules=rules)


class _ReplayHarness:
    """The contest's harness in a replay: torch.autocast's measurement as recorded; nothing runs."""

    random = False
    device = torch.device("cpu")
    batches: list = []

    def __init__(self, autocast: Measurement):
        self.graph_module, self.model, self.autocast = object(), object(), autocast

    def measure(self, fn, scaler_factory=None, autocast_dtype=None, **kw):
        return self.autocast


@pytest.mark.parametrize("log, kind", LOGS, ids=[f"{k}:{p}" for p, k in LOGS])
def test_a_committed_tune_replayed_through_the_contest_writes_what_it_wrote(log, kind, monkeypatch):
    rec = _parse(RESULTS / log)
    machine = (RESULTS / log.split("/")[0] / "machine.json").read_text()
    assert {"AVX2": "avx2", "AVX512-BF16": "avx512_bf16", "AMX": "amx_bf16"}[kind] in machine
    if kind == "AVX2":
        assert rec.cannot_win, "torch.autocast cannot win on an AVX2-only CPU"

    # the drift gate gives each finalist the verdict it had (the log's mean drift on every batch;
    # close calls, within 5% of the budget's margin, are not judged from means)
    gate = DriftGate(rec.budget)
    survivors = []
    for label, summary, g, why in rec.finalists:
        pol = _policy(label, summary)
        role = Role.BASELINE if label.startswith("fp32 + torch.compile") else Role.POLICY
        entry = Entry(Candidate(label, role, pol), object(),
                      Measurement(grad_rel_l2=g, grad_rel_l2_batches=[g] * len(rec.budget.reference or [g])))
        ratio = rec.budget.ratio(entry.measurement) / (1 + rec.budget.margin)
        if not 0.95 < ratio < 1.05:
            assert gate.judge(entry).going_on == (why is None or "drift" not in why), (label, g, why)
        if why is None:
            survivors.append(entry)

    timings = {name: _timing(*r) for name, r in rec.rates.items()}
    monkeypatch.setattr(contest_mod, "time_interleaved", lambda h, configs, **kw: {
        c.name: timings[c.name] for c in configs})
    monkeypatch.setattr(contest_mod, "compile_graph", lambda gm, budget=1.0, dynamic=None, **kw: gm)
    mean = rec.budget.value
    ac = Measurement(grad_rel_l2=mean, grad_rel_l2_batches=list(rec.budget.reference) or [mean])
    baseline = AutocastBaseline(torch.bfloat16, emulated="replayed" if rec.cannot_win else None,
                                cannot_win=rec.cannot_win)
    contest = Contest(_ReplayHarness(ac), rec.budget, True, baseline, math.inf, 0, Clock(), True)
    contest.measure_autocast()
    chosen, _m = contest.race(survivors)

    d = contest.decision
    assert d.chosen.name == rec.chosen, (d.describe(), rec.chosen)
    if rec.verdict == "baseline":
        assert d.chosen is d.best_baseline
    else:
        assert d.verdict == rec.verdict, d.describe()
    assert (AUTOCAST in contest.timings) == (rec.cannot_win is None)  # not timed where it cannot win
    assert d.best_baseline.name != AUTOCAST or not rec.autocast_shown
