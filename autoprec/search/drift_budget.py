"""The drift decision rule (docs/architecture.md#measurements, "Drift budget"): is a measured
policy within the drift budget?

:class:`DriftBudget` is the one rule the Optuna constraint (:meth:`DriftBudget.excess`), the
finalist selection (:meth:`DriftBudget.feasible`, :meth:`DriftBudget.explain`) and the policy
file (:attr:`DriftBudget.value`) use. Two kinds:

* ``auto`` (``--max-drift auto``, the default): not worse than torch.autocast beyond noise, by a
  paired one-sided Student's t-test over the K drift batches (both measured on the same batches,
  weights and RNG state, so the comparison is paired);
* ``fixed`` (``--max-drift X``): a hard number on the mean ``grad_rel_l2`` over the K batches.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from autoprec.metrics import t95
from autoprec.search import attrs

__all__ = ["FLOOR", "MARGIN", "MAX_AUTO_REFERENCE", "DriftBudget"]

#: Relative margin over torch.autocast that is not counted as worse: 2% (a policy computing what
#: torch.autocast computes measured 0.7% over it on one batch, from summation order alone).
MARGIN = 0.02
#: torch.autocast's mean ``grad_rel_l2`` from which ``--max-drift auto`` is refused: an error half
#: the gradient's norm is no rounding (bf16's drift is ~1e-2 — 7.3e-3 on qwen2_tiny —, fp16's
#: ~1e-3) but an overflow or underflow, as case C04's RMSNorm under fp16 autocast (0.989), and
#: a budget relative to it would pass policies as broken.
MAX_AUTO_REFERENCE = 0.5
#: Absolute floor of a ``grad_rel_l2`` before its logarithm is taken (a reference or candidate
#: batch with exactly zero drift, e.g. all-fp32 against FP32).
FLOOR = 1e-12

def _values(m: Any) -> list[float]:
    """Per-batch ``grad_rel_l2`` of a Measurement (its ``grad_rel_l2_batches``; a measurement
    without them, e.g. a scripted one, gives its ``grad_rel_l2`` as one value) or of a sequence."""
    if isinstance(m, Sequence):
        return [float(x) for x in m]
    return [float(x) for x in (getattr(m, "grad_rel_l2_batches", None) or [m.grad_rel_l2])]


@dataclass(frozen=True)
class DriftBudget:
    """The drift budget and its decision rule.

    Build it with :meth:`auto` or :meth:`fixed`. ``m`` in the methods is a
    :class:`autoprec.measure.measurement.Measurement` (its ``grad_rel_l2_batches``) or a list of
    per-batch ``grad_rel_l2`` values (dimensionless), in the reference's batch order.

    **Rule for auto.** With g_k the candidate's and a_k torch.autocast's ``grad_rel_l2`` on drift
    batch k (k = 1..K, both floored at :data:`FLOOR`), r_k = ln(g_k / a_k). The candidate is worse
    than torch.autocast beyond noise — infeasible — iff the lower one-sided 95% confidence bound of
    the mean log ratio, L = mean(r) − t_{0.95,K−1} · sd(r) / √K (sd with K − 1 in the denominator),
    exceeds ln(1 + :data:`MARGIN`): Student's paired t-test (one-sided, α = 0.05) of
    H₀: E[r] ≤ ln(1 + MARGIN) on log ratios, which makes the comparison scale-free and the
    ratios' noise about symmetric. With K = 1 there is no sd: feasible iff r ≤ ln(1 + MARGIN).
    :meth:`excess` is L − ln(1 + MARGIN). When the candidate has not K values (a measurement without
    per-batch values), the two means are compared as one pair (the K = 1 rule).

    **Rule for fixed.** Feasible iff mean(g) ≤ X; :meth:`excess` is mean(g) − X.

    Either way a non-finite candidate value gives :data:`autoprec.search.attrs.INFEASIBLE`.

    Attributes:
        rule: ``"auto"`` or ``"fixed"``.
        reference: torch.autocast's per-batch ``grad_rel_l2`` (auto; empty for fixed).
        margin: The relative margin over torch.autocast (auto).
        max_drift: X (fixed; inf for auto).
    """

    rule: str
    reference: tuple[float, ...] = ()
    margin: float = MARGIN
    max_drift: float = math.inf

    @classmethod
    def auto(cls, reference_batches: Sequence[float], margin: float = MARGIN) -> DriftBudget:
        """Not worse than torch.autocast, whose per-batch ``grad_rel_l2`` are ``reference_batches``.

        Raises:
            ValueError: ``reference_batches`` is empty or holds a non-finite or negative value, or
                ``margin`` is negative or non-finite.
        """
        ref = tuple(float(x) for x in reference_batches)
        if not ref or not all(math.isfinite(x) and x >= 0 for x in ref):
            raise ValueError(f"torch.autocast's per-batch drift must be finite and >= 0, got {list(ref)}")
        if not (math.isfinite(margin) and margin >= 0):
            raise ValueError(f"margin must be finite and >= 0, got {margin}")
        return cls("auto", ref, float(margin))

    @classmethod
    def fixed(cls, x: float) -> DriftBudget:
        """``--max-drift X``: the mean ``grad_rel_l2`` over the drift batches must be ≤ ``x``.

        Raises:
            ValueError: ``x`` is not finite and > 0.
        """
        if not (math.isfinite(x) and x > 0):
            raise ValueError(f"a fixed drift budget must be finite and > 0, got {x}")
        return cls("fixed", (), MARGIN, float(x))

    @property
    def value(self) -> float:
        """The budget as one number (the policy file's ``measured.drift_budget``): the mean of
        torch.autocast's per-batch ``grad_rel_l2`` for auto, X for fixed."""
        return statistics.fmean(self.reference) if self.rule == "auto" else self.max_drift

    def on_batches(self, n: int) -> DriftBudget:
        """This budget judged on the first ``n`` drift batches only (auto: torch.autocast's first
        ``n`` values; fixed: unchanged): how a measurement that ran ``n`` batches (a screening
        cut, :mod:`autoprec.search.screen_cut`) is compared batch for batch."""
        if self.rule == "auto" and 0 < n < len(self.reference):
            return replace(self, reference=self.reference[:n])
        return self

    def ratio(self, m: Any) -> float:
        """The candidate's drift as a multiple of the budget: auto, the geometric mean of g_k / a_k
        over the paired batches (the rule's statistic, ``exp`` of the mean log ratio); fixed,
        mean(g) / X. inf when any value is non-finite or there is none."""
        values = _values(m)
        if not values or not all(math.isfinite(g) for g in values):
            return math.inf
        if self.rule == "fixed":
            return statistics.fmean(values) / self.max_drift
        return math.exp(self._stats(values)[0])

    def _stats(self, values: list[float]) -> tuple[float, float, int]:
        """(mean log ratio, its lower 95% bound, pairs) of ``values`` against the reference (auto)."""
        ref = list(self.reference)
        if len(values) != len(ref):
            values, ref = [statistics.fmean(values)], [statistics.fmean(ref)]
        r = [math.log(max(g, FLOOR) / max(a, FLOOR)) for g, a in zip(values, ref, strict=True)]
        mean = statistics.fmean(r)
        if len(r) == 1:
            return mean, mean, 1
        return mean, mean - t95(len(r) - 1) * statistics.stdev(r) / math.sqrt(len(r)), len(r)

    def excess(self, m: Any) -> float:
        """The constraint value (Optuna's ``set_constraint``): ≤ 0 means feasible.

        auto: lower bound − ln(1 + margin) (a log ratio); fixed: mean − X (a ``grad_rel_l2``);
        :data:`autoprec.search.attrs.INFEASIBLE` (1e30) when any value is non-finite or there is none.
        """
        values = _values(m)
        if not values or not all(math.isfinite(g) for g in values):
            return attrs.INFEASIBLE
        if self.rule == "fixed":
            return statistics.fmean(values) - self.max_drift
        return self._stats(values)[1] - math.log1p(self.margin)

    def feasible(self, m: Any) -> bool:
        """``excess(m) <= 0``."""
        return self.excess(m) <= 0

    def upper(self, m: Any) -> float:
        """The upper one-sided 95% bound of the rule's statistic, as a multiple of the budget (≤ 1:
        within it beyond noise; the mirror of the test :meth:`feasible` applies): auto,
        exp(mean(r) + t_{0.95,n−1} · sd(r) / √n) / (1 + margin) on the n paired batches; fixed,
        (mean(g) + t_{0.95,n−1} · sd(g) / √n) / X. inf with fewer than 2 values (no sd), a
        non-finite one, or values not paired with the reference's batches (auto).

        The screening's early acceptance (:mod:`autoprec.search.screen_cut`) stops a trial's drift
        passes once this is ≤ 1 on its first batches: more batches could still move the estimate,
        but past the budget only against a 95% bound."""
        values = _values(m)
        n = len(values)
        if n < 2 or not all(math.isfinite(g) for g in values) or (
                self.rule == "auto" and n != len(self.reference)):
            return math.inf
        if self.rule == "fixed":
            half = t95(n - 1) * statistics.stdev(values) / math.sqrt(n)
            return (statistics.fmean(values) + half) / self.max_drift
        mean, lower, _n = self._stats(values)
        return math.exp(2 * mean - lower) / (1 + self.margin)  # mean + t·sd/√n: the lower bound mirrored

    def explain(self, m: Any) -> str:
        """The comparison behind :meth:`feasible`, in words, for log and rejection messages: e.g.
        ``"grad_rel_l2 1.2e-02 vs torch.autocast's 9.5e-03 on the same 4 batches: ratio 1.26 (95%
        lower bound 1.22) > 1.02"`` (ratio: the geometric mean of g_k / a_k)."""
        values = _values(m)
        if not values or not all(math.isfinite(g) for g in values):
            bad = next((k for k, g in enumerate(values) if not math.isfinite(g)), None)
            return "grad_rel_l2 is not finite" + (f" (drift batch {bad})" if bad is not None else "")
        mean = statistics.fmean(values)
        op = "<=" if self.feasible(values) else ">"
        if self.rule == "fixed":
            return (f"grad_rel_l2 {mean:.2e} (mean over {len(values)} batches) {op} "
                    f"--max-drift {self.max_drift:.2e}")
        r, lower, n = self._stats(values)
        if len(values) == len(self.reference):
            where = f"the same {n} batches" if n > 1 else "the same batch"
        else:
            where = f"average ({len(values)} vs {len(self.reference)} batches)"
        bound = f" (95% lower bound {math.exp(lower):.3g})" if n > 1 else ""
        return (f"grad_rel_l2 {mean:.2e} vs torch.autocast's {self.value:.2e} on {where}: "
                f"ratio {math.exp(r):.3g}{bound} {op} {1 + self.margin:.3g}")

    def describe(self) -> str:
        """The rule in one line, for the log: ``"torch.autocast's grad_rel_l2 (mean 7.1e-03 over 4
        batches) + 2%, paired t-test"`` or ``"--max-drift 1.0e-02 on the mean"``."""
        if self.rule == "fixed":
            return f"--max-drift {self.max_drift:.2e} on the mean over the drift batches"
        return (f"torch.autocast's grad_rel_l2 (mean {self.value:.2e} over {len(self.reference)} batches) "
                f"+ {100 * self.margin:g}%, one-sided paired t-test at 95%")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the study's ``autoprec:drift_rule`` user attribute)."""
        if self.rule == "fixed":
            return {"rule": "fixed", "max_drift": self.max_drift}
        return {"rule": "auto", "reference": list(self.reference), "margin": self.margin}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DriftBudget:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: an unknown ``rule``, or values :meth:`auto` / :meth:`fixed` refuse.
            KeyError: a field is missing.
        """
        if d.get("rule") == "fixed":
            return cls.fixed(float(d["max_drift"]))
        if d.get("rule") == "auto":
            return cls.auto(d["reference"], float(d.get("margin", MARGIN)))
        raise ValueError(f"unknown drift budget rule {d.get('rule')!r}")
