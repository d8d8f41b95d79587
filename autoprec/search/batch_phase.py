"""``tune --global-batch``'s phase after the finalists' contest: the contest's policy, its memory
levers and the baselines, each at its largest micro-batch within the memory budget
(:class:`autoprec.search.micro_batch.BatchSearch`), and what the policy file and report record of it
(docs/architecture.md#micro-batch-and-memory-budget)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from autoprec.errors import ModelSpecError, SearchError
from autoprec.modelspec import ModelSpec
from autoprec.modelspec.micro_batches import MicroBatches
from autoprec.nodekeys import graph_fingerprint
from autoprec.policy import Policy
from autoprec.search.budgets import format_bytes
from autoprec.search.contest import Contest
from autoprec.search.micro_batch import BatchPoint, BatchSearch, faster
from autoprec.search.phases import accounted
from autoprec.search.progress import log
from autoprec.search.tune_state import TuneState

__all__ = ["CHECKED_STEPS", "BatchChoice", "check_global_batch", "micro_batch_phase"]

#: Optimizer steps whose global batches :func:`check_global_batch` builds before any capture, so a
#: model file whose batches change size (a DataLoader's last, shorter batch) is refused then, not
#: after the search (a user's 18 examples in batches of 4 failed at the end of a whole tune, at
#: step 2 of global batch 8). A later short batch is still refused where it is read.
CHECKED_STEPS = 8


@dataclass(frozen=True)
class BatchChoice:
    """What the micro-batch phase chose.

    Attributes:
        policy: The policy to write, with its ``batching`` (and memory lever).
        best: Its point (micro-batch, peak, accumulated drift, global tokens/s).
        bar: The baseline to beat's point at its own largest fitting micro-batch (None: none fits).
        points: Every point measured (the report's table and plot).
        memory_budget: Bytes, or None.
        graph_fingerprint: The captured graph at the chosen micro-batch (``train`` captures there:
            the policy's ``provenance.graph_fingerprint``).
    """

    policy: Policy
    best: BatchPoint
    bar: BatchPoint | None
    points: tuple[BatchPoint, ...]
    memory_budget: float | None
    graph_fingerprint: str = ""

    @property
    def verdict(self) -> str:
        """``"faster"``, ``"slower"`` (beyond the noise: :func:`~autoprec.search.micro_batch.faster`),
        ``"tie"``, or ``"no baseline"``."""
        if self.bar is None:
            return "no baseline"
        if self.bar is self.best:
            return "tie"
        return "faster" if faster(self.best, self.bar) else "slower" if faster(self.bar, self.best) else "tie"

    @property
    def ratio(self) -> float:
        """The policy's global tokens/s over the baseline to beat's (nan without one)."""
        return self.best.tokens_per_s / self.bar.tokens_per_s if self.bar is not None else float("nan")

    def measured(self) -> dict[str, float]:
        """The policy file's ``measured`` entries (finite numbers): ``global_batch``,
        ``micro_batch_tokens_per_s`` (tokens/s per global step, the formula of
        :func:`~autoprec.search.micro_batch.global_step_seconds`), ``micro_batch_peak_bytes``,
        ``micro_batch_grad_rel_l2`` (accumulated, mean over the global batches) and, with a
        baseline, ``baseline_micro_batch``, ``baseline_micro_batch_tokens_per_s`` and
        ``speedup_vs_baseline_at_global_batch``."""
        b = self.best
        out = {"global_batch": float(b.micro_batch * b.accumulation),
               "micro_batch_tokens_per_s": b.tokens_per_s,
               "micro_batch_peak_bytes": float(b.peak_bytes),
               "micro_batch_grad_rel_l2": sum(b.drift) / len(b.drift)}
        if self.memory_budget is not None:
            out["memory_budget_bytes"] = float(self.memory_budget)
        if self.bar is not None:
            out |= {"baseline_micro_batch": float(self.bar.micro_batch),
                    "baseline_micro_batch_tokens_per_s": self.bar.tokens_per_s,
                    "speedup_vs_baseline_at_global_batch": self.ratio}
            (lo, hi), (blo, bhi) = self.best.tokens_per_s_band, self.bar.tokens_per_s_band
            if lo > 0 and bhi > 0:  # the ratio's band from the two bands' ends
                out |= {"speedup_vs_baseline_at_global_batch_lo": lo / bhi,
                        "speedup_vs_baseline_at_global_batch_hi": hi / blo}
        return out

    def report(self) -> dict[str, Any]:
        """The report's block: the budget, the points' rows, the chosen and the baseline's labels."""
        return {"memory_budget": self.memory_budget, "rows": [p.row() for p in self.points],
                "chosen": self.best.label, "baseline": self.bar.label if self.bar is not None else None}


def check_global_batch(spec: ModelSpec, global_batch: int, device: torch.device) -> None:
    """Refuse, before any capture, a ``--global-batch`` the model file cannot give.

    Raises:
        SearchError: ``global_batch`` < 1, or the model file's batches cannot be resized to it
            (:class:`~autoprec.modelspec.micro_batches.MicroBatches`'s message, naming the entry), or
            one of the first :data:`CHECKED_STEPS` global batches has another size (naming the step
            and each ``get_batch`` call)."""
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise SearchError(f"--global-batch: expected an integer >= 1, got {global_batch!r}")
    try:  # the global batches of the steps the phase measures on: a short one is refused now
        MicroBatches(spec, global_batch, 1, device).check_steps(CHECKED_STEPS, device)
    except ModelSpecError as e:
        raise SearchError(f"--global-batch {global_batch}: {e}") from None


def micro_batch_phase(run: TuneState, contest: Contest, chosen: Policy, global_batch: int,
                      compile: bool, budget: float | None) -> BatchChoice:
    """Search the micro-batch of ``chosen``, its memory levers and the baselines within ``budget``
    (bytes per micro-step, or None) and the contest's drift rule, and log the choice against the
    baseline to beat.

    Raises:
        SearchError: no policy configuration fits (:meth:`BatchSearch.run`)."""
    log(f"micro-batch: global batch {global_batch}"
        + (f", memory budget {format_bytes(budget)}" if budget else ""), run.quiet)
    search = BatchSearch(run.spec, run.dev, global_batch, budget, compile, run.baseline,
                         contest.budget, None, run.quiet, file_harness=run.harness)
    search.slow = run.slow * global_batch / search.file_batch  # tune's limit, per example
    with accounted(run.clock, "micro_batch_s"):
        policy, best, bar = search.run(chosen)
    fingerprint = graph_fingerprint(search.harness(best.micro_batch).graph_module)
    choice = BatchChoice(policy, best, bar, tuple(search.points), budget, fingerprint)
    words = {"tie": "a tie within the noise", "faster": "faster beyond the noise",
             "slower": "slower beyond the noise"}
    vs = (f"; the baseline to beat, {bar.label}: {bar.tokens_per_s:.0f} tok/s -> {choice.ratio:.2f}x, "
          f"{words[choice.verdict]}" if bar is not None else "; no baseline fits the budget")
    log(f"micro-batch: {best.label} {best.tokens_per_s:.0f} tok/s, peak {format_bytes(best.peak_bytes)}{vs}",
        run.quiet)
    if choice.verdict == "slower":
        log(f"warning: at global batch {global_batch} the policy is slower than {bar.config.name} at its own "
            "largest micro-batch, beyond the noise", run.quiet)
    return choice
