"""Reports: markdown table of trials, Pareto-front plot, per-layer dtype map, ``show`` listing.

Plots live in :mod:`autoprec.search.plots` (matplotlib's Agg backend, no display needed); every
tokens/s in the tables carries its noise band (:mod:`autoprec.search.rate_bands`).
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import optuna
from torch import fx

from autoprec.applied.compile import check_recompute
from autoprec.dtypes import kernel_name
from autoprec.errors import PolicyError
from autoprec.nodemeta import NodeMeta, read_meta
from autoprec.policy import Policy
from autoprec.search import attrs
from autoprec.search.finalist_pool import is_feasible
from autoprec.search.plots import dtype_map_figure, micro_batch_figure, pareto_figure, save_figure
from autoprec.search.rate_bands import rate_text, ties_with_fastest, timing_of

__all__ = ["baseline_own_ratio", "baseline_speed", "format_table", "report_study", "write_report",
           "trial_rows", "pareto_front", "show_nodes", "dtype_map", "node_label", "lever_section",
           "policy_summary"]

def format_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of result rows: config, tokens/s with ``±`` the 95% band's relative
    half-width (``(no band)`` / ``(1 step: no band)`` without one, ``—`` when not timed, its
    speedups too), speedup vs fp32 eager and vs torch.autocast + torch.compile, or the rows' ``bar``
    (``"autocast eager"`` for a tune without compile; each ``(tie)`` when within the noise),
    grad_rel_l2, peak MiB (both ``—`` on a row whose ``not_run`` is set), note; the ratio's column
    says ``(not timed)`` when no row has that ratio."""
    bar = rows[0].get("bar", "autocast+compile") if rows else "autocast+compile"
    if rows and not any(r.get("vs_autocast") is not None for r in rows):
        bar += " (not timed)"  # e.g. torch.autocast cannot win here: its rows say why
    head = (f"| config | tokens/s | speedup vs fp32 eager | vs {bar} | grad_rel_l2 | peak MiB "
            "| note |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        g = r.get("grad_rel_l2")
        tps = r["tokens_per_s"]
        if not tps or tps <= 0:
            rate = "—"
        elif r.get("band") is None:
            rate = f"{tps:.0f} (no band)"
        elif r.get("timed_steps") == 1:
            rate = f"{tps:.0f} (1 step: no band)"
        else:
            rate = f"{tps:.0f} ±{100 * r['band']:.1f}%"
        vs = r.get("vs_autocast")
        vs_text = "" if vs is None else f"{vs:.2f}x" + (" (tie)" if r.get("vs_autocast_tie") else "")
        speedup = f"{r['speedup_vs_fp32']:.2f}x" + (" (tie)" if r.get("vs_fp32_tie") else "")
        drift, peak = ('inf' if g is None else f'{g:.2e}'), f"{r.get('peak_bytes', 0) / 2**20:.1f}"
        if r.get("not_run"):
            drift = peak = "—"
        lines.append(f"| {r['config']} | {rate} | {speedup if rate != '—' else '—'} | {vs_text} | "
                     f"{drift} | {peak} | {r.get('error') or ''} |")
    return "\n".join(lines)


def trial_rows(study: optuna.Study) -> list[dict[str, Any]]:
    """One row per finished trial: number, state, tokens/s, step_times (its timed steps, seconds;
    None in a study written before they were recorded), grad_rel_l2, peak bytes, feasible, policy
    summary, key (:meth:`Policy.training_key`, None without a policy), error, reused_from, cut
    (why the screening cut stopped it, None if it did not; such a trial is never feasible)."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        if not t.state.is_finished():
            continue
        ua = t.user_attrs
        pol = ua.get(attrs.POLICY)
        rows.append({
            "number": t.number, "state": t.state.name,
            "tokens_per_s": ua.get(attrs.TOKENS_PER_S), "step_times": ua.get(attrs.STEP_TIMES),
            "grad_rel_l2": ua.get(attrs.GRAD_REL_L2),
            "peak_bytes": ua.get(attrs.PEAK_BYTES),
            "feasible": is_feasible(t),
            "policy": Policy.from_dict(pol).summary() if pol else "",
            "error": ua.get(attrs.ERROR) or (INTERRUPTED_NOTE if ua.get(attrs.INTERRUPTED) else None),
            "key": Policy.from_dict(pol).training_key() if pol else None,
            "reused_from": ua.get(attrs.REUSED_FROM), "cut": ua.get(attrs.CUT),
            "accepted": ua.get(attrs.ACCEPTED),
        })
    return rows


#: A trial row's error when Ctrl-C or a killed worker cut it short (``attrs.INTERRUPTED``): its
#: numbers are partial, and the next run of the same command measures its policy again.
INTERRUPTED_NOTE = "interrupted (Ctrl-C or a killed worker): not counted; measured again on resume"


def pareto_front(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows not dominated on (tokens/s ↑, grad_rel_l2 ↓, peak bytes ↓), completed trials only, not
    those the screening cut measured in part."""
    ok = [r for r in rows if r["state"] == "COMPLETE" and r["tokens_per_s"] and r["grad_rel_l2"] is not None
          and not r.get("cut")]

    def dominates(a, b) -> bool:
        ge = (a["tokens_per_s"] >= b["tokens_per_s"] and a["grad_rel_l2"] <= b["grad_rel_l2"]
              and (a["peak_bytes"] or 0) <= (b["peak_bytes"] or 0))
        gt = (a["tokens_per_s"] > b["tokens_per_s"] or a["grad_rel_l2"] < b["grad_rel_l2"]
              or (a["peak_bytes"] or 0) < (b["peak_bytes"] or 0))
        return ge and gt

    return [r for r in ok if not any(dominates(o, r) for o in ok if o is not r)]


def _markdown(rows, front, table, policy, timings, shapes=None, decision=None, rejected=None) -> str:
    lines = ["# autoprec tuning report", ""]
    if policy is not None:
        lines += [f"Chosen policy: `{policy.summary()}`", ""]
    if decision:
        lines += ["Final choice (finalists and baselines timed in interleaved rounds; a tie within "
                  f"the noise goes to the lower-drift, simpler policy): {decision}", ""]
    if shapes:
        lines += ["## Batches measured", "",
                  "Drift over the drift batches (mean); tokens/s over timed steps that run each batch once; "
                  "traj_rel over get_batch(0..K-1) (docs/architecture.md#measurements). Distinct "
                  "batch shapes:", ""]
        lines += [f"- `{s}`" for s in shapes] + [""]
    if table:
        lines += ["## Side by side (same weights and batches, one process)", "", format_table(table), ""]
    if timings:
        lines += ["## Where tuning time went", "", "| phase | seconds |", "|---|---:|"]
        lines += [f"| {k} | {v:.1f} |" for k, v in timings.items()] + [""]
    front_ids = {r["number"] for r in front}
    lines += ["## Trials", "", "Eager screening: tokens/s ± the 95% band of the median step over the trial's "
              "timed steps; a feasible trial within the noise of the fastest feasible one says tie.", "",
              "| # | state | tokens/s | grad_rel_l2 | peak MiB | feasible | Pareto | policy | note |",
              "|---:|---|---:|---:|---:|---|---|---|---|"]
    timings = [timing_of(r["step_times"], r["tokens_per_s"]) for r in rows]
    ties = ties_with_fastest([t if r["feasible"] and r["reused_from"] is None else None
                              for r, t in zip(rows, timings)], [f"#{r['number']}" for r in rows])
    for r, t, tie in zip(rows, timings, ties):
        tok = rate_text(r["tokens_per_s"], t) + (f" (tie with {tie})" if tie else "")
        g = f"{r['grad_rel_l2']:.2e}" if r["grad_rel_l2"] is not None else "inf"
        mem = f"{r['peak_bytes'] / 2**20:.1f}" if r["peak_bytes"] else ""
        note = r["error"] or (f"same graph as #{r['reused_from']}" if r["reused_from"] is not None else "")
        if r.get("cut"):
            note = "; ".join(x for x in (note, f"screening cut: {r['cut']}") if x)
        if r.get("accepted"):
            note = "; ".join(x for x in (note, f"accepted early: {r['accepted']}") if x)
        if (rejected or {}).get(r["key"]):
            note = "; ".join(x for x in (note, f"finalist rejected: {rejected[r['key']]}") if x)
        lines.append(f"| {r['number']} | {r['state']} | {tok} | {g} | {mem} | "
                     f"{'yes' if r['feasible'] else 'no'} | {'*' if r['number'] in front_ids else ''} | "
                     f"{r['policy']} | {note} |")
    return "\n".join(lines) + "\n"


def node_label(meta: NodeMeta) -> str:
    """How a lowered node stores, computes and saves, e.g. ``"bf16"``, ``"bf16:fp32"`` (storage bf16,
    compute fp32), ``"bf16:fp8_e4m3"`` or ``"fp32 saved bf16"`` (docs/architecture.md#policy-file)."""
    storage = meta.dtype if meta.storage is None else meta.storage
    label = kernel_name(storage, storage if meta.compute is None else meta.compute)
    return label + (f" saved {meta.saved}" if meta.saved else "")


def dtype_map(gm: fx.GraphModule, policy: Policy) -> dict[str, dict[str, str]]:
    """``{module: {op class: label}}`` for the lowered graph (majority :func:`node_label` per class)."""
    from autoprec.passes import run_pipeline

    lowered = run_pipeline(gm, policy).graph_module
    counts: dict[str, dict[str, dict[str, int]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(int)))
    for n in lowered.graph.nodes:
        meta = read_meta(n)
        if n.op == "call_function" and meta.dtype and not meta.inserted_cast:
            counts[meta.module or ""][meta.op_class or "?"][node_label(meta)] += 1
    return {m: {c: max(d, key=d.get) for c, d in cl.items()} for m, cl in counts.items()}


def baseline_speed(measured: Mapping[str, float], baseline: str) -> str:
    """How ``tune``'s last line and ``show`` give the speed against the baseline to beat, e.g.
    ``"1.00x fp32 + torch.compile (the baseline to beat; a tie within the noise: band 0.97-1.04,
    paired rounds)"``: the policy's ``speedup_vs_baseline`` named by ``baseline``, with the
    decision's 95% band where the policy file has it (``speedup_vs_baseline_lo``/``_hi``), and "a
    tie within the noise" where that band contains 1.0 (a ratio below 1.0 is then no loss). Where
    the rounds were paired, the ratio shown is the one that band is of
    (``speedup_vs_baseline_paired``, the per-round ratios' geometric mean,
    :func:`autoprec.measure.noise.compare`), and the medians' ratio follows only where it differs:
    a ``--no-compile`` tune printed "0.92x fp32 eager (...; paired 0.72x, band 0.63-0.83)", a ratio
    outside its own band."""
    ratio = measured["speedup_vs_baseline"]
    lo, hi = measured.get("speedup_vs_baseline_lo"), measured.get("speedup_vs_baseline_hi")
    if lo is None or hi is None:
        return f"{ratio:.2f}x {baseline} (the baseline to beat)"
    tie = "a tie within the noise: " if lo <= 1.0 <= hi else ""
    paired = measured.get("speedup_vs_baseline_paired")
    if paired is None:
        return f"{ratio:.2f}x {baseline} (the baseline to beat; {tie}band {lo:.2f}-{hi:.2f})"
    medians = f"; medians' ratio {ratio:.2f}x" if f"{ratio:.2f}" != f"{paired:.2f}" else ""
    return (f"{paired:.2f}x {baseline} (the baseline to beat; {tie}band {lo:.2f}-{hi:.2f}, paired "
            f"rounds{medians})")


def baseline_own_ratio(measured: Mapping[str, float], baseline: str | None) -> str | None:
    """The key of a policy file's ``measured`` ratio that ``speedup_vs_baseline`` already gives, so
    it is printed once (as the baseline's): ``speedup_vs_fp32`` when the baseline to beat
    (``provenance.baseline``) is fp32 eager, ``speedup_vs_autocast`` when it is torch.autocast
    (compiled, or eager without compile); None otherwise or without ``speedup_vs_baseline``."""
    if "speedup_vs_baseline" not in measured or baseline is None:
        return None
    if baseline == "fp32 eager":
        return "speedup_vs_fp32"
    return "speedup_vs_autocast" if baseline.startswith("torch.autocast") else None


def report_study(study: optuna.Study, stem: str | os.PathLike) -> list[Path]:
    """``autoprec report``: :func:`write_report` of ``study`` with what the last finished ``tune``
    kept in it (:data:`attrs.RESULT`: the decision, side-by-side table, phase times, levers; no
    dtype map, which needs the graph); a study no tune finished gets its trials only, and a note
    on stderr says so. Returns the paths written."""
    result = dict(study.user_attrs.get(attrs.RESULT) or {})
    if result.get("policy") is not None:
        result["policy"] = Policy.from_dict(result["policy"])
    else:
        print("note: no tune of this study has finished: the report lists its trials only", file=sys.stderr)
    return write_report(study, stem, **result)


def write_report(study: optuna.Study, stem: str | os.PathLike, table: list[dict[str, Any]] | None = None,
                 policy: Policy | None = None, gm: fx.GraphModule | None = None,
                 timings: dict[str, float] | None = None, shapes: list[str] | None = None,
                 levers: list[dict[str, Any]] | None = None, decision: str | None = None,
                 micro_batches: dict[str, Any] | None = None) -> list[Path]:
    """Write ``<stem>.report.md``, ``<stem>.pareto.png`` and (with ``gm`` and ``policy``)
    ``<stem>.dtype_map.png``; returns the paths written.

    ``shapes`` lists the distinct batch shapes the measurements ran on
    (:func:`autoprec.capture.batch_shapes`); the report names them. ``levers`` are the
    compiled finalist measurements (``Contest.finalists``), memory-lever tries included: the report
    lists them with the lever each used and marks their speed/memory Pareto front; a finalist's
    ``rejected`` reason is also the note of the trial it came from. The Pareto plot marks the
    trial whose policy was written (by training key) with its compiled speedup. ``decision``
    is the final head-to-head's verdict (:meth:`autoprec.search.race.Decision.describe`).
    ``micro_batches`` (``tune --global-batch``: :meth:`autoprec.search.batch_phase.BatchChoice.report`)
    adds a section and ``<stem>.micro_batch.png`` (tokens/s against peak memory)."""
    stem = Path(stem)
    rows = trial_rows(study)
    front = pareto_front(rows)
    fp32 = next((r["tokens_per_s"] for r in (table or []) if r["config"] == "fp32 eager"), None)
    md = stem.with_name(stem.name + ".report.md")
    rejected = {q["key"]: q["rejected"] for q in levers or [] if q.get("rejected") and q.get("key")}
    md.write_text(_markdown(rows, front, table, policy, timings, shapes, decision, rejected)
                  + lever_section(levers or []) + micro_batch_section(micro_batches))
    png = stem.with_name(stem.name + ".pareto.png")
    chosen = _chosen_row(rows, policy)
    compiled = (policy.measured or {}).get("speedup_vs_fp32") if policy is not None else None
    save_figure(pareto_figure(rows, front, fp32, study.user_attrs.get(attrs.DRIFT_BUDGET), chosen, compiled),
                png)
    paths = [md, png]
    if gm is not None and policy is not None:
        dm = stem.with_name(stem.name + ".dtype_map.png")
        save_figure(dtype_map_figure(dtype_map(gm, policy)), dm)
        paths.append(dm)
    if micro_batches:
        mb = stem.with_name(stem.name + ".micro_batch.png")
        save_figure(micro_batch_figure(micro_batches), mb)
        paths.append(mb)
    return paths


def micro_batch_section(block: dict[str, Any] | None) -> str:
    """Markdown: every configuration and micro-batch ``tune --global-batch`` measured (peak, fits,
    accumulated drift, tokens/s per global step; why it is not a candidate), the chosen one and the
    baseline to beat at its own largest fitting micro-batch."""
    if not block:
        return ""
    budget = block.get("memory_budget")
    lines = ["", "## Micro-batch and memory lever", "",
             f"Memory budget: {f'{budget / 2**20:.1f} MiB' if budget else 'none'}. "
             f"Chosen: {block['chosen']}; "
             f"baseline to beat: {block['baseline'] or 'none fits'}. Tokens/s per global step: A x the timed "
             "micro-step less (A - 1) updates.", "",
             "| configuration | micro-batch x accumulation | peak MiB | fits | grad_rel_l2 (accumulated) | "
             "tokens/s | note |", "|---|---|---:|---|---:|---:|---|"]
    for r in block["rows"]:
        drift = f"{r['grad_rel_l2']:.2e}" if r["grad_rel_l2"] is not None else ""
        tps = f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else ""
        note = "; ".join(x for x in (r["error"], r["note"]) if x)
        lines.append(f"| {r['config']} | {r['micro_batch']}x{r['accumulation']} | "
                     f"{r['peak_bytes'] / 2**20:.1f} | {'yes' if r['fits'] else 'no'} | {drift} | {tps} | "
                     f"{note} |")
    return "\n".join(lines) + "\n"


def _chosen_row(rows: list[dict[str, Any]], policy: Policy | None) -> dict[str, Any] | None:
    """The first COMPLETE trial row whose policy trains as ``policy`` does (same training key), or None."""
    if policy is None:
        return None
    key = policy.training_key()
    return next((r for r in rows if r["state"] == "COMPLETE" and r["key"] == key), None)


def lever_section(points: list[dict[str, Any]]) -> str:
    """Markdown: every compiled finalist measurement with its memory lever (``none``, ``saved
    <dtype>``, ``recompute <budget>``), tokens/s with its noise band (``step_times``) and a tie
    with the fastest kept point; ``*`` marks the Pareto front on (tokens/s ↑, peak ↓) among the
    timed points without an error (a point only counted for memory has no tokens/s); the note is
    the point's ``error``, why it was ``rejected`` (drift, memory, ``traj_rel``) and its
    measurement's ``note`` (a contender the head-to-head ``retired``: at what ratio, over which
    rounds; a retired point is never the fastest a tie is named against)."""
    if not points:
        return ""
    ok = [q for q in points if q["tokens_per_s"] and q["error"] is None]
    front = {id(q) for q in ok if not any(
        o["tokens_per_s"] >= q["tokens_per_s"] and o["peak_bytes"] <= q["peak_bytes"]
        and (o["tokens_per_s"], o["peak_bytes"]) != (q["tokens_per_s"], q["peak_bytes"]) for o in ok)}
    lines = ["", "## Finalists, with memory levers", "",
             "Tokens/s ± the 95% band of the median step (the head-to-head's rounds for the survivors); tie: "
             "within the noise of the fastest.", "",
             "| policy | lever | tokens/s | grad_rel_l2 | peak MiB | Pareto | note |",
             "|---|---|---:|---:|---:|---|---|"]
    timings = [timing_of(q.get("step_times"), q["tokens_per_s"]) for q in points]
    ranked = [t if q["error"] is None and not q.get("rejected") and not q.get("retired") else None
              for q, t in zip(points, timings)]
    ties = ties_with_fastest(ranked, [q["policy"] for q in points])
    for q, t, tie in zip(points, timings, ties):
        tps = (rate_text(q["tokens_per_s"], t) + (f" (tie with {tie})" if tie else "")) if q["tokens_per_s"] \
            else "(memory only)"
        note = "; ".join(x for x in (q["error"], q.get("rejected") and f"rejected: {q['rejected']}",
                                     q.get("note")) if x)
        lines.append(f"| {q['policy']} | {q['lever']} | {tps} | {q['grad_rel_l2']:.2e} | "
                     f"{q['peak_bytes'] / 2**20:.1f} | {'*' if id(q) in front else ''} | {note} |")
    return "\n".join(lines) + "\n"


def show_nodes(policy: Policy, model_path: str | os.PathLike) -> str:
    """Per-module dtypes of ``policy`` on the model of ``model_path``, and the nodes each rule
    matched (a rule matching nothing is flagged); last, why compiling it will be refused, if it will
    (:func:`autoprec.applied.compile.check_recompute`: a memory budget on a model with dropout).

    Raises:
        ModelSpecError, CaptureError, PassError: as loading, capturing and lowering do.
    """
    import torch

    from autoprec.capture import capture
    from autoprec.modelspec import load_model_spec
    from autoprec.ops import classify
    from autoprec.passes.assign import nearest_node_key

    spec = load_model_spec(model_path)
    model = spec.build_model()
    gm = capture(model, spec.get_batch(0, torch.device("cpu")))
    lines = ["", "module | op class -> dtype (storage:compute where they differ; saved)", "---"]
    for mod, classes in dtype_map(gm, policy).items():
        lines.append(f"{mod or '<root>'} | " + ", ".join(f"{c}->{d}" for c, d in sorted(classes.items())))
    lines += ["", "rule -> matched nodes", "---"]
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    for i, rule in enumerate(policy.rules):
        hits = [read_meta(n).key for n in nodes
                if rule.matches(read_meta(n).key, classify(n), read_meta(n).module)]
        shown = ", ".join(hits[:8]) + (f", … (+{len(hits) - 8})" if len(hits) > 8 else "")
        count = f"{len(hits)} node{'' if len(hits) == 1 else 's'}"
        near = nearest_node_key(rule.node, nodes) if rule.node is not None and not hits else None
        lines.append(f"rules[{i}] {rule.describe()}: {count}"
                     + (f": {shown}" if hits else "  (matches no node" + (f"; did you mean {near!r}?)" if near
                                                                         else ")")))
    try:
        check_recompute(gm, policy.activation_memory_budget)
    except PolicyError as e:
        lines += ["", f"compiled (apply, train, bench) this policy is refused on this model: {e}"]
    return "\n".join(lines)


#: ``measured`` keys of a ``tune --global-batch`` policy (``batch_phase.BatchDecision.measured``),
#: which :func:`global_batch_summary` writes.
GLOBAL_BATCH_KEYS = ("global_batch", "micro_batch_tokens_per_s", "micro_batch_grad_rel_l2",
                     "micro_batch_peak_bytes", "memory_budget_bytes", "baseline_micro_batch",
                     "baseline_micro_batch_tokens_per_s", "speedup_vs_baseline_at_global_batch",
                     "speedup_vs_baseline_at_global_batch_lo", "speedup_vs_baseline_at_global_batch_hi")


def global_batch_summary(policy: Policy) -> str:
    """A ``tune --global-batch`` policy's numbers at what it trains: ``"at global batch 16,
    micro-batch 8 x 2 accumulated: 13378 tokens/s, grad_rel_l2 ... (accumulated), peak 2.0 MiB
    (budget 2.1 MiB); 1.05x the baseline to beat at its own micro-batch 4 (... tokens/s; band ...)"``
    (from the policy's ``measured``, which holds :data:`GLOBAL_BATCH_KEYS`; ``tune``'s last line
    and ``show``)."""
    m = policy.measured
    line = (f"at global batch {m['global_batch']:.0f}, {policy.batching.describe()}: "
            f"{m['micro_batch_tokens_per_s']:.0f} tokens/s, grad_rel_l2 {m['micro_batch_grad_rel_l2']:.3g} "
            f"(accumulated), peak {m['micro_batch_peak_bytes'] / 2**20:.1f} MiB")
    if "memory_budget_bytes" in m:
        line += f" (budget {m['memory_budget_bytes'] / 2**20:.1f} MiB)"
    if "baseline_micro_batch" in m:
        band = (f"; band {m['speedup_vs_baseline_at_global_batch_lo']:.2f}-"
                f"{m['speedup_vs_baseline_at_global_batch_hi']:.2f}"
                if "speedup_vs_baseline_at_global_batch_lo" in m else "")
        line += (f"; {m['speedup_vs_baseline_at_global_batch']:.2f}x the baseline to beat at its own "
                 f"micro-batch {m['baseline_micro_batch']:.0f} ({m['baseline_micro_batch_tokens_per_s']:.0f} "
                 f"tokens/s{band})")
    return line


def policy_summary(policy: Policy, path: str | os.PathLike, rules: bool = True) -> str:
    """What ``autoprec show`` prints for a policy file, model or not: its one-line summary, where
    it was tuned (provenance), what was measured, and (``rules``) each rule in order (``show
    --model`` lists them with the nodes they match instead: :func:`show_nodes`).

    Args:
        policy: The loaded policy. path: Its file, named in the first line.
        rules: List the rules (``rules[i] <rule>``; the last rule that matches a node wins).

    Returns:
        Lines of text (no trailing newline).
    """
    lines = [f"{os.fspath(path)}: {policy.summary()}"]
    prov = dict(policy.provenance or {})
    if prov:
        scalars = [f"{k} {v}" for k, v in prov.items() if not isinstance(v, (dict, list))]
        lines.append("tuned: " + ", ".join(scalars))
    m, head = dict(policy.measured or {}), "measured: "
    if "micro_batch_tokens_per_s" in m and policy.batching is not None:  # first: what it trains at
        lines.append(f"measured {global_batch_summary(policy)}")
        m = {k: v for k, v in m.items() if k not in GLOBAL_BATCH_KEYS}
        head = "measured at the model file's batch, without accumulation (the contest of policies): "
    if m:
        shown = []
        if "tokens_per_s" in m:
            shown.append(f"{m.pop('tokens_per_s'):.0f} tokens/s")
        best = str(prov.get("baseline", "the fastest baseline"))
        same = baseline_own_ratio(m, best)
        from autoprec.search.contest import AUTOCAST_COMPILED, AUTOCAST_EAGER

        # the torch.autocast it was timed against: compiled or eager, as the policy was tuned
        autocast = {True: AUTOCAST_COMPILED, False: AUTOCAST_EAGER}.get(prov.get("compiled"),
                                                                         "torch.autocast")
        if "speedup_vs_baseline" in m:
            shown.append(baseline_speed(m, best))
        for key in ("speedup_vs_baseline", "speedup_vs_baseline_lo", "speedup_vs_baseline_hi",
                    "speedup_vs_baseline_paired"):
            m.pop(key, None)
        for key, label in (("speedup_vs_fp32", "fp32 eager"), ("speedup_vs_autocast", autocast)):
            if key in m and key != same:
                shown.append(f"{m.pop(key):.2f}x {label}")
        m.pop(same, None)
        if "peak_bytes" in m:
            shown.append(f"peak {m.pop('peak_bytes') / 2**20:.1f} MiB")
        if "memory_budget_bytes" in m:
            shown.append(f"memory budget {m.pop('memory_budget_bytes') / 2**20:.1f} MiB")
        shown += [f"{k} {v:.3g}" if isinstance(v, (int, float)) else f"{k} {v}" for k, v in m.items()]
        lines.append(head + ", ".join(shown))
    if rules:
        lines += ["", f"rules ({len(policy.rules)}; for a node, the last matching one that sets dtype "
                      "decides it, the last that sets saved decides saved, node rules first; default "
                      f"{policy.default_dtype}):"]
        lines += [f"rules[{i}] {r.describe()}" for i, r in enumerate(policy.rules)] or ["(none)"]
        lines += ["", "(--model model.py also shows the dtype of each module's nodes and the nodes each rule "
                      "matches; --json prints the file)"]
    return "\n".join(lines)
