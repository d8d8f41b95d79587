"""How a measurement or a candidate ended: one typed outcome (docs/architecture.md#how-a-policy-is-chosen).

A search trial's drift passes, a finalist's measurement and every gate of the finalists' contest
(drift, memory, trajectory) end in one :class:`Outcome`: go on, cut, accepted, or failed, each
with its reason in words. Control flow reads :attr:`Outcome.stage`, never which optional string
is set (the reason is words for the log and the report; the one reader of a failure's words is the
diagnosis that names the first non-finite node of a ``non-finite`` failure). The model is Optuna's
``TrialState`` (an enum of how a trial ended) with the reason the log and the report print beside
it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Outcome", "Stage"]


class Stage(enum.Enum):
    """How a measurement or a candidate ended.

    ``CONTINUE``: nothing stopped it (a drift pass goes on to the next batch; a gate passes it).
    ``CUT``: stopped because it cannot win (the screening cut: too slow, or drift far over the
    budget); what ran so far is kept, and it is never a finalist.
    ``ACCEPTED``: stopped early because what ran already shows it within the budget beyond noise
    (the screening's early acceptance); it stands for the whole measurement.
    ``FAILED``: it cannot be used: non-finite values, a compile or runtime error, out of memory, or
    a gate's rejection (over the drift, memory or trajectory budget).
    """

    CONTINUE = "continue"
    CUT = "cut"
    ACCEPTED = "accepted"
    FAILED = "failed"


@dataclass(frozen=True)
class Outcome:
    """A :class:`Stage` with its reason, e.g. ``Outcome(Stage.CUT, "1.31x the step time of trial 4
    ...")``. Build it with :meth:`go_on`, :meth:`cut`, :meth:`accepted` or :meth:`failed`.

    Attributes:
        stage: How it ended.
        reason: Why, in words for the log and the report ("" for ``CONTINUE``).
    """

    stage: Stage = Stage.CONTINUE
    reason: str = ""

    def __post_init__(self) -> None:
        if self.stage is not Stage.CONTINUE and not self.reason:
            raise ValueError(f"an outcome {self.stage.value!r} needs a reason")

    @classmethod
    def go_on(cls) -> Outcome:
        """Nothing stopped it."""
        return _GO_ON

    @classmethod
    def cut(cls, reason: str) -> Outcome:
        """Stopped because it cannot win (``reason``: why)."""
        return cls(Stage.CUT, reason)

    @classmethod
    def accepted(cls, reason: str) -> Outcome:
        """Stopped early, within the budget beyond noise (``reason``: on which batches, by how much)."""
        return cls(Stage.ACCEPTED, reason)

    @classmethod
    def failed(cls, reason: str) -> Outcome:
        """Cannot be used (``reason``: the error or the budget it is over)."""
        return cls(Stage.FAILED, reason)

    @property
    def going_on(self) -> bool:
        """Whether nothing stopped it (:attr:`Stage.CONTINUE`)."""
        return self.stage is Stage.CONTINUE

    def reason_if(self, stage: Stage) -> str | None:
        """The reason when the stage is ``stage``, else None: what the storage's
        ``autoprec:cut`` / ``autoprec:accepted`` attributes and the measurement's ``error`` hold."""
        return self.reason if self.stage is stage else None


_GO_ON = Outcome()
