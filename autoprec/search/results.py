"""What ``tune`` reports about its choice (docs/architecture.md#policy-file, #measurements): the
policy file's ``measured`` block, the side-by-side table (tokens/s with its noise band, vs fp32
eager and vs torch.autocast + torch.compile, or torch.autocast eager without compile) and the
note when an eager run was faster.

``run`` below is ``tune``'s phase state (:class:`~autoprec.search.tune_state.TuneState`: ``fp32``,
``autocast``, ``ac_dtype``, ``budget``, ``quiet``); ``contest`` its :class:`~autoprec.search.contest.Contest`.
"""

from __future__ import annotations

import math
from typing import Any

from autoprec.dtypes import NAMES
from autoprec.measure import Measurement, Timing, compare
from autoprec.policy import Policy
from autoprec.search.contest import AUTOCAST_EAGER, FP32_COMPILED, FP32_EAGER, FP32_GRAPH, Contest
from autoprec.search.progress import log
from autoprec.search.race import all_fp32
from autoprec.search.rate_bands import timing_of
from autoprec.search.tune_state import TuneState

__all__ = ["baseline_to_beat", "measured_block", "note_if_eager_was_faster", "side_by_side"]


def baseline_to_beat(contest: Contest, compile: bool) -> tuple[str, float] | None:
    """The fastest baseline of the final head-to-head and its tokens/s: what a user gets without
    autoprec, the faster of torch.autocast + torch.compile and fp32 + torch.compile (fp32 eager
    too, should it be faster; without compile torch.autocast eager and the all-fp32 graph), timed
    side by side with the choice (:func:`autoprec.search.race.decide`'s ``best_baseline``).
    The all-fp32 finalist is named what it is, ``"fp32 + torch.compile"``, whichever trial it
    was. None when no baseline was timed."""
    d = contest.decision
    if d is None or d.best_baseline is None or not d.best_baseline.timing.tokens_per_s:
        return None
    b = d.best_baseline
    fp32 = b.policy is not None and all_fp32(b.policy)
    name = (FP32_COMPILED if compile else FP32_GRAPH) if fp32 else b.name
    return name, b.timing.tokens_per_s


def measured_block(run: TuneState, contest: Contest, chosen: Policy, m: Measurement,
                   compile: bool) -> dict[str, float]:
    """The policy file's ``measured`` block (finite numbers only: docs/architecture.md#policy-file);
    ``speedup_vs_baseline`` is against :func:`baseline_to_beat` (whose name the provenance holds), the
    ratio of the two tokens/s (as every ratio of the table), with the decision's comparison: its 95%
    band (``speedup_vs_baseline_lo``/``_hi``; containing 1.0, a tie within the noise) and, when the
    rounds were paired, the ratio that band is of (``speedup_vs_baseline_paired``: the per-round
    ratios' geometric mean, which need not equal the medians' ratio)."""
    ref = contest.autocast_bar or run.autocast
    best = baseline_to_beat(contest, compile)
    d = contest.decision
    vs = d.vs_baseline if d is not None and d.chosen is not d.best_baseline else None  # not itself
    return {
        "tokens_per_s": m.tokens_per_s,
        **({"speedup_vs_baseline": m.tokens_per_s / best[1]} if best is not None else {}),
        # the decision's comparison (autoprec.measure.noise.compare): its band containing 1.0 is a tie;
        # paired, its ratio (the per-round ratios' geometric mean) is the one the band is of
        **({"speedup_vs_baseline_lo": vs.band[0], "speedup_vs_baseline_hi": vs.band[1]}
           | ({"speedup_vs_baseline_paired": vs.ratio} if vs.rounds else {})
           if best is not None and vs is not None and all(map(math.isfinite, vs.band)) else {}),
        "speedup_vs_fp32": m.tokens_per_s / run.fp32.tokens_per_s,
        # left out when torch.autocast was not timed (it cannot win: autocast_cannot_win)
        **({"speedup_vs_autocast": m.tokens_per_s / ref.tokens_per_s} if ref.tokens_per_s else {}),
        "grad_rel_l2": m.grad_rel_l2, "loss_rel": m.loss_rel,
        "peak_bytes": m.peak_bytes,
        # only when measured: 0.0 would read as a perfect trajectory (--traj-steps 0, or all-fp32)
        **({"traj_rel": contest.trajectory.of(chosen)}
           if chosen.training_key() in contest.trajectory.traj else {}),
        "drift_budget": contest.budget.value,  # what judged the finalists (compiled, with dropout)
        # left out when torch.autocast itself overflowed (a policy file holds finite numbers only)
        **({"autocast_grad_rel_l2": run.autocast.grad_rel_l2}
           if math.isfinite(run.autocast.grad_rel_l2) else {}),
        **({"memory_budget_bytes": contest.memory_budget} if contest.memory_budget is not None else {}),
    }


def side_by_side(run: TuneState, contest: Contest, chosen_m: Measurement,
                 compile: bool) -> list[dict[str, Any]]:
    """Rows of the side-by-side table: FP32 eager, torch.autocast eager (and compiled), fp32 +
    torch.compile (the all-fp32 finalist, compiled), the policy.
    Each row's ``bar`` names the column its ``vs_autocast`` ratio is against: torch.autocast +
    torch.compile, or torch.autocast eager without compile (the head-to-head's ``contest.ac_label``)."""
    ac = NAMES.get(run.ac_dtype, str(run.ac_dtype))
    t, ref = contest.timings, contest.timings.get(contest.ac_label)
    chosen_t = t.get(contest.decision.chosen.name) if contest.decision is not None else None
    fp32_t = t.get(FP32_EAGER)
    table = [_row("fp32 eager", run.fp32, run.fp32, fp32_t, ref),
             _row(f"autocast {ac} eager", contest.autocast_eager or run.autocast, run.fp32,
                  t.get(AUTOCAST_EAGER),
                  None if compile else ref, fp32_t)]
    if contest.autocast_compiled is not None:
        table.append(_row(f"autocast {ac} + compile", contest.autocast_compiled, run.fp32, ref, ref, fp32_t))
    fp32_name, fp32_m = _fp32_bar(contest)
    if fp32_m is not None:  # the other bar: the all-fp32 finalist compiled as the decision's baseline
        table.append(_row("fp32 + compile", fp32_m, run.fp32, t.get(fp32_name) if fp32_name else None, ref,
                          fp32_t))
    chosen_name = contest.decision.chosen.name if contest.decision is not None else None
    for vname, vpol, vm in contest.variants:  # the choice's compile variants that raced it, not written
        if vname not in (chosen_name, fp32_name):
            table.append(_row(f"{_variant_label(vpol)} + compile, {contest.compiled_as(vpol).describe()}", vm,
                              run.fp32, t.get(vname), ref, fp32_t))
    name = "autoprec policy" + (" + compile" if compile else " (eager)")
    if contest.variants and contest.decision is not None and contest.decision.chosen.policy is not None:
        name += f", {contest.compiled_as(contest.decision.chosen.policy).describe()}"
    table.append(_row(name, chosen_m, run.fp32, chosen_t, ref, fp32_t))
    bar = "autocast+compile" if compile else "autocast eager"
    return [r | {"bar": bar} for r in table]


def _fp32_bar(contest: Contest) -> tuple[str | None, Measurement | None]:
    """The table's "fp32 + compile" row: the all-fp32 compile the decision measured the choice against
    (its ``best_baseline``, a compile variant of the all-fp32 finalist where one raced: ``(name,
    measurement)``, so the row and the last line's "x fp32 + torch.compile" agree), else the all-fp32
    finalist as first compiled (``(None, contest.fp32_compiled)``; its row was the regional compile
    while the last line's bar was the flat one, 7269 against 8191 tokens/s)."""
    d = contest.decision
    best = d.best_baseline.name if d is not None and d.best_baseline is not None else None
    for vname, vpol, vm in contest.variants:
        if vname == best and all_fp32(vpol):
            return vname, vm
    return None, contest.fp32_compiled


def note_if_eager_was_faster(run: TuneState, contest: Contest, chosen: Policy, chosen_m: Measurement,
                             compile: bool) -> None:
    """Say so when an eager run beat the compiled policy by over 10% (not for a recomputing
    policy, which trades speed for memory on purpose). fp32 eager's speed is the head-to-head's
    (timed beside the policy) where it ran; the policy's own eager speed, a trial's screening
    (timed alone, and noisier), counts only for a policy that lowers something: an all-fp32
    policy eager is fp32 eager, and a screening number must not contradict the head-to-head.
    Without compile, say so when the head-to-head found the model as it is (fp32 eager, no
    autoprec) faster than the written policy beyond the noise (``contest.decision``'s verdict
    "slower"): applying it would only cost speed (a Mixtral's graph ran at 0.86x, band 0.78-0.98)."""
    d = getattr(contest, "decision", None)
    if (not compile and d is not None and d.verdict == "slower" and d.vs_baseline is not None
            and d.best_baseline is not None and d.best_baseline.name == FP32_EAGER):
        c = d.vs_baseline
        log(f"note: the model as it is (fp32 eager, without autoprec) trained faster than this policy eager "
            f"({c.ratio:.2f}x, band {c.band[0]:.2f}-{c.band[1]:.2f}); for this model train it without the "
            "policy, or tune and train with compile", run.quiet)
        return
    fp32_t = contest.timings.get(FP32_EAGER)
    own = 0.0 if all_fp32(chosen) else contest.eager_tokens_per_s.get(chosen.training_key()) or 0.0
    eager = max([(own, "this policy eager"),
                 (fp32_t.tokens_per_s if fp32_t is not None else run.fp32.tokens_per_s, "fp32 eager")])
    if compile and eager[0] > 1.1 * chosen_m.tokens_per_s and chosen.activation_memory_budget >= 1.0:
        log(f"note: {eager[1]} ran faster ({eager[0]:.0f} tok/s) than this policy compiled "
            f"({chosen_m.tokens_per_s:.0f}); for this model consider tuning and training without compile "
            "(autoprec tune/train --no-compile)", run.quiet)


def _variant_label(pol: Policy) -> str:
    """A compile variant's row name: ``"fp32"`` for an all-fp32 policy (fp32 + torch.compile compiled
    another way, a baseline), else ``"autoprec policy"``."""
    return "fp32" if all_fp32(pol) else "autoprec policy"


def _row(name: str, m: Measurement, fp32_m: Measurement, timing: Timing | None = None,
         autocast: Timing | None = None, fp32: Timing | None = None) -> dict[str, Any]:
    """One table row; a non-finite ``grad_rel_l2`` is None (printed as inf). Its tokens/s band
    comes from the final head-to-head's ``timing``, else from ``m``'s own step times
    (:func:`autoprec.search.rate_bands.timing_of`): ``band`` (the 95% band's relative half-width, with
    ``timed_steps``), ``vs_fp32_tie`` (its ratio to fp32 eager's, ``fp32``'s timing or
    ``fp32_m``'s steps, has a band containing 1). With the bar's torch.autocast timing
    (``autocast``) also ``vs_autocast`` (the ratio of the two tokens/s, as ``speedup_vs_fp32`` and
    the policy file's ratios are) and ``vs_autocast_tie`` (:func:`compare`'s band, paired by round
    where both were timed in the head-to-head's rounds, contains 1)."""
    row = {"config": name, "tokens_per_s": m.tokens_per_s,
           "speedup_vs_fp32": m.tokens_per_s / fp32_m.tokens_per_s if fp32_m.tokens_per_s else 0.0,
           "grad_rel_l2": m.grad_rel_l2 if math.isfinite(m.grad_rel_l2) else None,
           "peak_bytes": m.peak_bytes, "error": m.error or m.note}
    if m.error is None and not m.grad_rel_l2_batches and not m.step_times:
        row["not_run"] = True  # torch.autocast + torch.compile where it cannot win: its note says why
    if timing is None or not timing.step_times:
        timing = timing_of(m.step_times, m.tokens_per_s)
    if fp32 is None or not fp32.step_times:
        fp32 = timing_of(fp32_m.step_times, fp32_m.tokens_per_s)
    if timing.step_times:
        row["band"], row["timed_steps"] = timing.rel_half_width(), len(timing.step_times)
        if m is not fp32_m and len(timing.step_times) > 1 and len(fp32.step_times) > 1:
            row["vs_fp32_tie"] = compare(timing, fp32).tie
        if autocast is not None and autocast.step_times:  # the ratio of the tokens/s the table gives
            row["vs_autocast"] = m.tokens_per_s / autocast.tokens_per_s
            row["vs_autocast_tie"] = compare(timing, autocast).tie and timing is not autocast
    return row
