"""torch.autocast's bar in the finalists phase (docs/architecture.md#search, #measurements): torch.autocast
+ torch.compile (torch.autocast eager without compile) compiled and measured for drift and memory in
the same run as the finalists, its speed taken in their head-to-head; its drift cut after batch 0
where its native GEMMs are slow; not run at all where it cannot win; its compiled drift the budget
on a graph that draws random numbers.

``sel`` below is the run's :class:`autoprec.search.select.Selector` (its harness ``h``, ``compile``,
``ac_dtype``, ``ac_label``, ``slow``, ``slow_gemms``, ``cannot_win``, ``budget``, ``quiet``, ``_fn`` to
compile; it sets ``_autocast_fn``, ``autocast_compiled`` or ``autocast_eager`` and ``budget``).
"""

from __future__ import annotations

import math
from typing import Any

from autoprec.measure import Measurement
from autoprec.search.decide import DriftBudget
from autoprec.search.progress import log
from autoprec.training.train import autocast_scaler

__all__ = ["bar_on_batch_0", "judge_compiled_like_autocast", "measure_bar", "no_bar"]


def no_bar(sel: Any) -> bool:
    """Whether torch.autocast's bar is not run: it cannot win (``sel.cannot_win``,
    :func:`autoprec.search.kernel_choice.autocast_cannot_win`) and the graph draws no random numbers
    (whose compiled bar's drift is the budget, :func:`judge_compiled_like_autocast`)."""
    return bool(sel.cannot_win) and not sel.h.random


def measure_bar(sel: Any) -> None:
    """Compile torch.autocast + torch.compile (eager without compile), the comparison users care
    about, and measure its drift and memory: ``sel.autocast_compiled`` (or ``sel.autocast_eager``),
    its module ``sel._autocast_fn``; where :func:`no_bar`, nothing runs, ``_autocast_fn`` stays None
    and with compile ``autocast_compiled`` is an empty measurement whose note says why (its row)."""
    if no_bar(sel):
        log(f"{sel.ac_label}: not {'compiled' if sel.compile else 'timed'}, "
            f"{sel.cannot_win}: it cannot be the baseline to beat", sel.quiet)
        if sel.compile:
            sel.autocast_compiled = Measurement(note=f"not compiled: {sel.cannot_win}")
        return
    if sel.compile:
        log("compiling the torch.autocast baseline with Inductor", sel.quiet)
    sel._autocast_fn = sel._fn(sel.h.model) if sel.compile else sel.h.model
    # timed in the head-to-head's rounds (CUDA's peak is read after timed steps; the CPU's is not)
    timed = sel.h.device.type == "cuda"
    one = bar_on_batch_0(sel, timed)
    ac = sel.h.measure(sel._autocast_fn, autocast_scaler(sel.ac_dtype), autocast_dtype=sel.ac_dtype,
                       timing=timed, max_step_s=sel.slow, cut=(lambda _m: one) if one else None)
    ac.add_note(ac.cut)
    if sel.compile:
        sel.autocast_compiled = ac
        judge_compiled_like_autocast(sel)
    else:
        sel.autocast_eager = ac


def bar_on_batch_0(sel: Any, timed: bool) -> str | None:
    """Why torch.autocast + torch.compile's drift stops after batch 0 (``sel.slow_gemms``: its
    native GEMMs are slow; batch 0 compiles it and gives its peak), or None: all K batches
    run when it is not compiled, when ``timed`` (its timed steps would be skipped) and when
    the graph draws random numbers (its drift over every batch is then the compiled budget)."""
    if not (sel.compile and sel.slow_gemms) or timed or sel.h.random:
        return None
    return f"drift on batch 0 only ({sel.slow_gemms})"


def judge_compiled_like_autocast(sel: Any) -> None:
    """On a graph that draws random numbers (dropout), judge compiled finalists against torch.autocast
    as compiled (``sel.budget`` becomes its auto rule). Written when compiled graphs drew Inductor's
    own masks in measurements, whose noise the eager budget lacked (T5, dropout 0.1: compiled
    autocast 7.0e-2 against eager autocast's 3.3e-2); since the RNG rule of issue 19.2 both draw
    eager's masks (``Harness``), and the rule still compares compiled with compiled: both sides are
    measured compiled against the compiled FP32 graph (:meth:`Harness.reference_fn`), torch.autocast
    with Inductor's defaults as users compile it, the finalists with ``INDUCTOR_OPTIONS``
    (``emulate_precision_casts``: their casts round as eager's do). A ``--max-drift X`` budget stays
    the hard number."""
    ac = sel.autocast_compiled
    if not (sel.h.random and sel.budget.rule == "auto" and ac is not None and ac.error is None
            and ac.grad_rel_l2_batches and all(math.isfinite(g) for g in ac.grad_rel_l2_batches)):
        return
    sel.budget = DriftBudget.auto(ac.grad_rel_l2_batches, sel.budget.margin)
    log(f"the graph draws random numbers: compiled finalists are judged against torch.autocast + "
        f"torch.compile's drift (mean {ac.grad_rel_l2:.3g}), both compiled", sel.quiet)
