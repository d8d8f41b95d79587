"""The finalists' rows of the report (:class:`FinalistRows`): every finalist measurement of the
contest (:mod:`autoprec.search.contest`), memory-lever tries and compile variants included, keyed by
the policy's content; the report's "Finalists, with memory levers" table reads them."""

from __future__ import annotations

from typing import Any

from autoprec.measure import Measurement
from autoprec.policy import Policy
from autoprec.search.memory_fit import lever

__all__ = ["FinalistRows"]


class FinalistRows:
    """Every finalist measurement (compiled unless ``--no-compile``), memory-lever tries included:
    the report's lever table. A row is keyed by the policy's content (:meth:`Policy.training_key`),
    never by object identity: a rejected policy can be freed and its ``id`` reused by another.

    Attributes:
        rows: ``{"policy", "key", "lever", "tokens_per_s", "step_times", "grad_rel_l2",
            "peak_bytes", "error", "note", "retired"}`` per measurement, and ``rejected`` (why a
            finalist was not kept, when not its ``error``).
    """

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self._index: dict[str, int] = {}  # Policy.training_key() -> its last row

    def add(self, pol: Policy, m: Measurement, timed: bool = True) -> None:
        """A new row for ``pol``'s measurement (``timed``: its speed is known)."""
        self.rows.append(self._row(pol, m, timed))
        self._index[pol.training_key()] = len(self.rows) - 1  # the head-to-head fills its speed in

    def timed(self, pol: Policy, m: Measurement, retired: bool) -> None:
        """``pol``'s row with the head-to-head's speed (``retired``: timed no further, its ``note``
        says at what ratio over which rounds)."""
        row = self._row(pol, m, True, retired)
        i = self._index.get(pol.training_key())
        if i is None:
            self.rows.append(row)
        else:
            self.rows[i] = row

    def reject(self, pol: Policy, why: str) -> None:
        """Record why a finalist was rejected (the report's note: drift, memory, traj_rel)."""
        if (i := self._index.get(pol.training_key())) is not None:
            self.rows[i]["rejected"] = why

    @staticmethod
    def _row(pol: Policy, m: Measurement, timed: bool = True, retired: bool = False) -> dict[str, Any]:
        return {"policy": pol.summary(), "key": pol.training_key(), "lever": lever(pol),
                "tokens_per_s": m.tokens_per_s if timed else None,
                "step_times": list(m.step_times) if timed else [],  # the report's noise band
                "grad_rel_l2": m.grad_rel_l2, "peak_bytes": m.peak_bytes, "error": m.error,
                "note": m.note, "retired": retired}
