"""``autoprec bench``'s rows and table (docs/architecture.md#measurements): one JSON row per
configuration from its drift :class:`~autoprec.measure.measurement.Measurement` and its interleaved
:class:`~autoprec.measure.noise.Timing`, the throughput ratios between rows, and the Markdown table.
"""

from __future__ import annotations

from typing import Any

from autoprec._io import json_safe
from autoprec.measure import Measurement, Timing, compare, format_rate

__all__ = ["add_ratios", "failed_rows", "format_bench_table", "make_row", "skipped_row"]

_DRIFT = ("grad_rel_l2", "loss_rel", "grad_sqnr_db_min")


def make_row(m: Measurement, dtype: str, compiled: bool, t: Timing | None = None, flops: float = 0.0,
             peak: float = 0.0, ratio: float = 10.0, compiles_timed: int = 0) -> dict[str, Any]:
    """The row of one configuration as ``bench.json`` holds it (non-finite floats as ``"inf"``,
    ``"-inf"``, ``"nan"``: :func:`autoprec._io.json_safe`).

    Args:
        m: Its drift measurement (``grad_rel_l2``, ``peak_bytes`` in bytes, ``error``).
        dtype: Its low dtype's name (``"fp32"``, ``"bf16"``, ...).
        compiled: Whether it runs through ``torch.compile``.
        t: Its interleaved timing (None: not timed yet, or failed before timing).
        flops: Model FLOPs per step (:func:`autoprec.commands.bench_mfu.model_flops`).
        peak: The matmul peak, FLOP/s, that MFU divides by (0: no MFU).
        ratio: ``max_step_ratio``, named in the note of a configuration the slow-step rule stopped.
        compiles_timed: Timed steps whose forward compiled (a shape the warm-up did not meet),
            left out of ``t`` already (:func:`autoprec.commands.bench_shapes.drop_compiled_steps`).

    Returns:
        ``step_s`` (s, median), ``step_s_band`` (s), ``iqr_s`` (s), ``tokens_per_s``,
        ``tokens_per_s_band`` (tokens/s, bootstrap 95% interval), ``rel_half_width``, ``rounds``,
        the drift metrics, ``peak_bytes`` (CUDA: the timing's estimate), ``mfu`` (0..1),
        ``steps_timed``, ``step_times`` (s), ``capped``, ``compiles_timed``, ``note``, ``error``.
    """
    timed = t is not None and bool(t.step_times)
    error = m.error or (t.error if t is not None else None)
    note = m.note
    if t is not None and t.note:
        note = (f"{t.note} (limit {ratio:g}x fp32 eager's step)" if t.too_slow else t.note) + \
            (f"; {note}" if note else "")
    if compiles_timed:
        note = (f"{compiles_timed} timed step{'s' if compiles_timed > 1 else ''} compiled (a new shape) and "
                "left out of the timing") + (f"; {note}" if note else "")
    return json_safe({
        "dtype": dtype, "compiled": compiled,
        "step_s": t.step_s if timed else None, "step_s_band": list(t.band_s) if timed else None,
        "iqr_s": t.iqr_s if timed else None,
        "tokens_per_s": t.tokens_per_s if timed else 0.0,
        "tokens_per_s_band": list(t.tokens_per_s_band) if timed else None,
        "rel_half_width": t.rel_half_width() if timed else None, "rounds": t.rounds if t is not None else 0,
        **{k: (getattr(m, k) if m.error is None else None) for k in _DRIFT},
        "peak_bytes": int(t.peak_bytes if t is not None and t.peak_bytes is not None else m.peak_bytes),
        "mfu": (flops / t.step_s / peak) if (timed and peak > 0) else None,
        "steps_timed": len(t.step_times) if t is not None else 0,
        "step_times": list(t.step_times) if t is not None else [],
        "capped": bool(t is not None and t.too_slow), "compiles_timed": int(compiles_timed), "note": note,
        "error": error,
    })


def skipped_row(dtype: str, compiled: bool, note: str) -> dict[str, Any]:
    """The row of a configuration ``bench`` did not run (``skipped: true``, ``note`` says why)."""
    return {"dtype": dtype, "compiled": compiled, "step_s": None, "step_s_band": None, "iqr_s": None,
            "tokens_per_s": 0.0, "tokens_per_s_band": None, "rel_half_width": None, "rounds": 0,
            "grad_rel_l2": None, "loss_rel": None, "grad_sqnr_db_min": None, "peak_bytes": 0, "mfu": None,
            "steps_timed": 0, "step_times": [], "capped": False, "compiles_timed": 0, "skipped": True,
            "note": note, "error": None, "compile_cache": None}


def failed_rows(result: dict[str, Any]) -> dict[str, str]:
    """``{name: error}`` of the configurations of a :func:`autoprec.commands.bench.run_bench` result that
    failed (an ``error``: capture, compile, a step raised, non-finite gradients); skipped and
    capped rows are not failures. ``autoprec bench`` exits 1 when this is not empty."""
    return {name: r["error"] for name, r in result["configs"].items() if r.get("error")}


def add_ratios(rows: dict[str, dict[str, Any]], timings: dict[str, Timing] | None = None) -> None:
    """Set each row's ``ratio_vs_fp32_eager`` and ``ratio_vs_autocast_compiled`` (its tokens/s over
    theirs; None where either is not timed) and, given the timings and an ``autocast_compiled``
    timing, ``vs_autocast_compiled``: :func:`autoprec.measure.noise.compare`'s ``{"ratio",
    "band", "tie", "winner"}`` (winner ``"row"``, ``"autocast_compiled"`` or None on a tie)."""
    base = rows["fp32_eager"]["tokens_per_s"]
    ac = rows.get("autocast_compiled", {}).get("tokens_per_s") or 0.0
    ref = (timings or {}).get("autocast_compiled")
    for name, r in rows.items():
        t = r["tokens_per_s"]
        r["ratio_vs_fp32_eager"] = t / base if (base and t) else None
        r["ratio_vs_autocast_compiled"] = t / ac if (ac and t) else None
        mine = (timings or {}).get(name)
        if ref is not None and ref.step_times and mine is not None and mine.step_times:
            c = compare(mine, ref)
            r["vs_autocast_compiled"] = json_safe({
                "ratio": c.ratio, "band": list(c.band), "tie": c.tie,
                "winner": {"a": "row", "b": "autocast_compiled"}.get(c.winner)})
        else:
            r.setdefault("vs_autocast_compiled", None)


def _rate(r: dict[str, Any], tokens_per_step: float) -> str:
    """``"6947 ±2.1%"`` (:func:`autoprec.measure.noise.format_rate`) from a row's step times."""
    if not r.get("tokens_per_s") or not r.get("step_times"):
        return "—"
    return format_rate(Timing.from_steps(r["step_times"], tokens_per_step))


def _vs_ac(name: str, r: dict[str, Any]) -> str:
    """The ``vs autocast+compile`` cell: the ratio, with ``(tie)`` where its noise band contains 1."""
    c = r.get("vs_autocast_compiled")
    if r.get("ratio_vs_autocast_compiled") is None:
        return "—"
    ratio = format(r["ratio_vs_autocast_compiled"], ".2f")
    return ratio + " (tie)" if c is not None and c["tie"] and name != "autocast_compiled" else ratio


def format_bench_table(result: dict[str, Any]) -> str:
    """Markdown table of a :func:`autoprec.commands.bench.run_bench` result (one row per configuration):
    tokens/s with the relative half-width of its 95% band (``6947 ±2.1%``), and ``tie`` in the
    ``vs autocast+compile`` column where :func:`autoprec.measure.noise.compare` finds no difference."""
    def num(x: float | None, fmt: str) -> str:
        return "—" if x is None else x if isinstance(x, str) else format(x, fmt)

    lines = [("| config | dtype | step s | tokens/s | vs fp32 eager | vs autocast+compile | grad_rel_l2 "
             "| peak MiB | MFU | steps | note |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, r in result["configs"].items():
        lines.append(
            f"| {name} | {r['dtype']} | {num(r['step_s'], '.3f')} | {_rate(r, result['tokens_per_batch'])} | "
            f"{num(r['ratio_vs_fp32_eager'], '.2f')} | {_vs_ac(name, r)} | "
            f"{num(r['grad_rel_l2'], '.2e')} | "
            f"{num(r['peak_bytes'] / 2**20 if r['peak_bytes'] else None, '.1f')} | "
            f"{num(r['mfu'] * 100 if r['mfu'] is not None else None, '.2f')}% | {r['steps_timed']} | "
            f"{r.get('note') or r.get('error') or ''} |")
    mp = result["matmul_peak"]
    by_dtype = mp.get("by_dtype", {mp["dtype"]: mp["flops_per_s"]})
    peaks = ", ".join(f"{dn} {f / 1e12:.3f}" for dn, f in by_dtype.items())
    lines.append("")
    timing = result.get("timing") or {}
    gflop = result["flops"]["flops_per_step"] / 1e9
    lines.append(f"{result['device']}; torch {result['torch']}; {result['date']}; "
                 f"{result['tokens_per_batch']} tokens/step; model {gflop:.1f} GFLOP/step; "
                 f"MFU vs the measured matmul peak of the row's dtype, at least fp32's ({peaks} TFLOP/s)"
                 + ("; tokens/s: median of interleaved rounds ± half-width of its bootstrap 95% interval"
                    if timing.get("interleaved") else ""))
    return "\n".join(lines)
