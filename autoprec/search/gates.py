"""The finalists' contest's candidates and gates (docs/architecture.md#how-a-policy-is-chosen):
what a candidate is (:class:`Candidate`, its :class:`Role`), a candidate as measured
(:class:`Entry`), and the one protocol that turns an entry into an
:class:`~autoprec.measure.outcome.Outcome` (:class:`Gate`): drift, memory, trajectory.
:mod:`autoprec.search.contest` builds the candidates and runs the gates and the race."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

from autoprec.measure import Measurement, Outcome
from autoprec.policy import Policy
from autoprec.search.budgets import format_bytes, over_memory
from autoprec.search.drift_budget import DriftBudget
from autoprec.search.trajectory import TrajectoryCheck

__all__ = ["Candidate", "DriftGate", "Entry", "Gate", "MemoryGate", "Role", "TrajectoryGate", "first_failure"]


class Role(enum.Enum):
    """What a candidate is in the contest.

    ``POLICY``: a policy that may be written (a trial, the autocast twin and its variants).
    ``BASELINE``: a baseline to beat, what a user gets without autoprec; fp32 + torch.compile (the
    all-fp32 policy compiled) is one that may also be written, since it has a policy.
    ``SHOWN``: timed beside them for the table only (torch.autocast over the drift or memory budget).
    """

    POLICY = "policy"
    BASELINE = "baseline"
    SHOWN = "shown"


@dataclass(frozen=True)
class Candidate:
    """One finalist or baseline of the contest.

    Attributes:
        name: Its label in the log and the report (``"trial 6 (eager 5281 tok/s)"``,
            ``"autocast twin"``, ``"fp32 + torch.compile, trial 0 (eager 867 tok/s)"``).
        role: Its :class:`Role`.
        policy: The policy to write if it wins; None for torch.autocast and fp32 eager (not policies).
    """

    name: str
    role: Role
    policy: Policy | None = None


@dataclass
class Entry:
    """A candidate as measured: its module, its measurement and the gates' outcome.

    Attributes:
        candidate: The candidate (after a memory fit, the fitted one: another policy and label).
        fn: Its module as trained (compiled unless ``--no-compile``).
        measurement: Drift, memory (and, once timed, speed) of ``fn``.
        outcome: The first gate's outcome that is not ``CONTINUE``, else ``CONTINUE``.
        tie_drift: The drift a tie in the race judges it by, where not its own ``grad_rel_l2``: a
            compile variant's is at least the choice's as first compiled, so a tie keeps that
            (:meth:`autoprec.search.contest.Contest._vary`). None: its own.
    """

    candidate: Candidate
    fn: Any
    measurement: Measurement
    outcome: Outcome = field(default_factory=Outcome.go_on)
    tie_drift: float | None = None

    @property
    def name(self) -> str:
        """The candidate's name."""
        return self.candidate.name


class Gate(Protocol):
    """A check of an :class:`Entry`: ``CONTINUE`` passes it; ``FAILED`` (with the reason the log and
    the report print) rejects it."""

    def judge(self, entry: Entry) -> Outcome:
        """The entry's outcome at this gate."""
        ...


@dataclass(frozen=True)
class DriftGate:
    """Within the drift budget (:class:`~autoprec.search.drift_budget.DriftBudget`); a failed
    measurement fails here with its own error."""

    budget: DriftBudget

    def judge(self, entry: Entry) -> Outcome:
        """``FAILED`` with the measurement's error or the budget's explanation, else ``CONTINUE``."""
        m = entry.measurement
        if m.failed:
            return m.outcome
        return Outcome.go_on() if self.budget.feasible(m) else Outcome.failed(self.budget.explain(m))


@dataclass(frozen=True)
class MemoryGate:
    """Within the memory budget (bytes; None: no budget). ``compile`` and ``random`` choose the hint
    the rejection gives (recomputation is a compiled lever, and not on a graph that draws random
    numbers: :func:`autoprec.search.budgets.over_memory`)."""

    budget: float | None
    compile: bool = True
    random: bool = False

    def fits(self, m: Measurement) -> bool:
        """Whether ``m``'s peak is within the budget (always, without one)."""
        return self.budget is None or m.peak_bytes <= self.budget

    def judge(self, entry: Entry) -> Outcome:
        """``FAILED`` with the peak against the budget, else ``CONTINUE``."""
        m = entry.measurement
        if self.fits(m):
            return Outcome.go_on()
        return Outcome.failed(
            f"peak {format_bytes(m.peak_bytes)} > memory budget {format_bytes(self.budget)}"
            + (over_memory(self.random) if self.compile else
               " (without --no-compile, recomputation in backward can lower the peak)"))


@dataclass(frozen=True)
class TrajectoryGate:
    """The choice's trajectory: ``traj_rel`` over K optimizer steps at most
    :data:`~autoprec.search.trajectory.TRAJ_FACTOR` x torch.autocast's
    (:class:`~autoprec.search.trajectory.TrajectoryCheck`). Asked of the policy the race would
    write only (its K steps cost a training run)."""

    check: TrajectoryCheck

    def judge(self, entry: Entry) -> Outcome:
        """``FAILED`` with ``traj_rel`` against the budget, else ``CONTINUE``; a candidate without a
        policy passes."""
        pol = entry.candidate.policy
        if pol is None or self.check.ok(pol, entry.fn):
            return Outcome.go_on()
        return Outcome.failed(self.check.reason(pol))


def first_failure(entry: Entry, gates: list[Gate]) -> Outcome:
    """The first gate's outcome that is not ``CONTINUE`` (``CONTINUE`` when all pass)."""
    for gate in gates:
        if not (outcome := gate.judge(entry)).going_on:
            return outcome
    return Outcome.go_on()
