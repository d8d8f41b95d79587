"""``autoprec bench``: a policy side by side with the standard baselines (docs/architecture.md#measurements).

In one process, on the same weights and batches, every configuration below runs full training
steps (forward, loss, backward, optimizer step, loss scaler) through the one measurement
:class:`~autoprec.search.measure.Harness` that ``autoprec tune`` uses:

=====================  ===========================================================================
``fp32_eager``         the user's ``nn.Module`` in fp32
``fp32_compiled``      the captured fp32 graph compiled with Inductor
``autocast_eager``     ``torch.autocast`` around the ``nn.Module``, in the low dtype of
                       :func:`autoprec.device.autocast_dtype` (the one ``tune`` compares with)
``autocast_compiled``  ``torch.autocast`` around the compiled fp32 graph
``pure_low_eager``     a copy of the model cast to the low dtype (``model.to(dtype)``): no master
                       weights, optimizer state in the low dtype
``pure_low_compiled``  that copy captured and compiled
``policy_eager``       the policy-lowered graph (fp32 master weights)
``policy_compiled``    the policy-lowered graph compiled (what ``autoprec train`` runs)
=====================  ===========================================================================

Compiled configurations all use :data:`autoprec.runtime.apply.INDUCTOR_OPTIONS`, so compiled
rows differ only in their dtypes. A configuration whose steps are too slow against the limit
``max(max_step_ratio x fp32_eager's step, 1 s)`` (two steps in a row over it, or one step over
4x it: :func:`autoprec.runtime.steps.slow_step_guard`; e.g. bf16 on a CPU without native bf16
arithmetic) is timed on that last step only, and its row says so (``capped``).

MFU counts model FLOPs per step as ``6 · N · tokens`` (N: trainable parameters except embedding
tables, whose forward is a gather, not a matmul; Kaplan et al. 2020, PaLM appendix B) plus
attention ``12 · layers · seq · hidden · tokens`` (QKᵀ and AV, forward + backward, full
non-causal count as in PaLM), read from ``model.config`` when the model has one; it divides
FLOP/s by the device's matmul peak measured in the same run with a large square matmul in the
policy's main dtype (the dtype most of its matmuls run in), before and again after the
configurations (the higher of the two counts: a busy moment on a shared machine understates it).
"""

from __future__ import annotations

import copy
import datetime
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoprec._io import json_safe, write_json
from autoprec.capture import capture
from autoprec.device import autocast_dtype, describe_machine, resolve_device, time_matmul
from autoprec.dtypes import NAMES, to_torch
from autoprec.modelspec import load_model_spec
from autoprec.passes import run_pipeline
from autoprec.policy import Policy
from autoprec.runtime.apply import compile_graph
from autoprec.runtime.scaler import DynamicLossScaler
from autoprec.runtime.train import autocast_scaler, make_scaler
from autoprec.search.measure import Harness, Measurement

__all__ = [
    "CONFIGS",
    "describe_machine",
    "format_bench_table",
    "matmul_peak_flops",
    "model_flops",
    "run_bench",
    "write_bench_json",
]

#: Every configuration ``autoprec bench`` knows, in table order.
CONFIGS: tuple[str, ...] = (
    "fp32_eager", "fp32_compiled", "autocast_eager", "autocast_compiled",
    "pure_low_eager", "pure_low_compiled", "policy_eager", "policy_compiled",
)


def matmul_peak_flops(dtype: torch.dtype, device: torch.device, max_n: int | None = None,
                      target_s: float = 0.25, reps: int = 3) -> tuple[float, int]:
    """Measured matmul peak: the best FLOP/s of square ``n×n @ n×n`` matmuls, growing ``n``.

    ``n`` doubles from 512 until one matmul takes ``target_s`` or ``n`` reaches ``max_n``
    (default 8192 on CUDA, 2048 on CPU), so a dtype the device emulates slowly costs little.

    Args:
        dtype: Element dtype of both operands (the output is the same dtype).
        device: Where to run.
        max_n: Largest matrix size tried.
        target_s: Stop growing once one matmul takes at least this many seconds.
        reps: Timed repetitions per size after one warm-up; the fastest counts.

    Returns:
        ``(flops_per_s, n)``: the best rate (2·n³ FLOPs per matmul) and the size that reached it.
    """
    max_n = max_n or (8192 if device.type == "cuda" else 2048)
    best, best_n, n = 0.0, 0, 512
    while n <= max_n:
        dt = min(time_matmul(dtype, device, n, reps, 4 * target_s))  # emulated dtype: stops early
        if 2 * n**3 / dt > best:
            best, best_n = 2 * n**3 / dt, n
        if dt >= target_s:
            break
        n *= 2
    return best, best_n


def model_flops(model: nn.Module, batch: Any, tokens: int) -> dict[str, Any]:
    """Training FLOPs per step: ``6·N·tokens`` plus attention ``12·layers·seq·hidden·tokens``.

    Args:
        model: The fp32 model (``model.config`` with ``num_hidden_layers`` and ``hidden_size``
            enables the attention term).
        batch: One batch (``input_ids`` or the first tensor gives the sequence length, last dim).
        tokens: Tokens per batch.

    Returns:
        ``{"flops_per_step", "params_matmul", "params_embedding", "layers", "seq", "hidden",
        "formula"}`` (FLOPs, counts).
    """
    emb = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    params = [p for p in model.parameters() if p.requires_grad]
    n_emb = sum(p.numel() for p in params if id(p) in emb)
    n_mm = sum(p.numel() for p in params) - n_emb
    cfg = getattr(model, "config", None)
    layers = int(getattr(cfg, "num_hidden_layers", 0) or 0)
    hidden = int(getattr(cfg, "hidden_size", 0) or 0)
    x = batch.get("input_ids") if isinstance(batch, dict) else batch[0] if isinstance(batch, (tuple, list)) else batch
    seq = int(x.shape[-1]) if isinstance(x, torch.Tensor) and x.dim() >= 1 else 0
    flops = 6 * n_mm * tokens + 12 * layers * seq * hidden * tokens
    return {"flops_per_step": float(flops), "params_matmul": n_mm, "params_embedding": n_emb,
            "layers": layers, "seq": seq, "hidden": hidden,
            "formula": "6*params_matmul*tokens + 12*layers*seq*hidden*tokens"}


def _main_dtype(lowered: torch.fx.GraphModule, policy: Policy) -> str:
    """Most common dtype among the lowered graph's ``matmul``-class nodes (else the default)."""
    seen = Counter(n.meta["autoprec"]["dtype"] for n in lowered.graph.nodes
                   if n.meta.get("autoprec", {}).get("op_class") == "matmul" and n.meta["autoprec"].get("dtype"))
    return seen.most_common(1)[0][0] if seen else policy.default_dtype


@dataclass
class _Config:
    """How to run one configuration: module, scaler, autocast dtype and harness (weights)."""

    fn: Callable[[], Any]
    harness: Harness
    scaler: Callable[[], DynamicLossScaler | None]
    autocast: torch.dtype | None
    dtype: str
    compiled: bool


def _pure_low(h: Harness, dtype: torch.dtype) -> Harness:
    """A shallow copy of ``h`` whose model, parameters and initial weights are ``dtype`` copies
    (same values rounded; no fp32 master weights); batches and FP32 reference are shared."""
    low = copy.copy(h)
    low.model = copy.deepcopy(h.model).to(dtype)
    low.params = [p for p in low.model.parameters() if p.requires_grad]
    low.initial = [p.detach().clone() for p in low.params]
    return low


def _build_configs(h: Harness, policy: Policy, low: torch.dtype, names: Sequence[str]) -> dict[str, _Config]:
    lowered = run_pipeline(h.graph_module, policy).graph_module
    pol_scaler = lambda: make_scaler(policy)
    low_scaler = autocast_scaler(low)
    lname, pdt = NAMES[low], _main_dtype(lowered, policy)
    plow = _pure_low(h, low) if any(n.startswith("pure_low") for n in names) else None
    table = {
        "fp32_eager": lambda: _Config(lambda: h.model, h, lambda: None, None, "fp32", False),
        "fp32_compiled": lambda: _Config(lambda: compile_graph(h.graph_module), h, lambda: None, None, "fp32", True),
        "autocast_eager": lambda: _Config(lambda: h.model, h, low_scaler, low, lname, False),
        "autocast_compiled": lambda: _Config(lambda: compile_graph(h.model), h, low_scaler, low, lname, True),
        "pure_low_eager": lambda: _Config(lambda: plow.model, plow, low_scaler, None, lname, False),
        "pure_low_compiled": lambda: _Config(lambda: compile_graph(capture(plow.model, plow.batches[0])), plow,
                                             low_scaler, None, lname, True),
        "policy_eager": lambda: _Config(lambda: lowered, h, pol_scaler, None, pdt, False),
        "policy_compiled": lambda: _Config(lambda: compile_graph(lowered, policy.activation_memory_budget), h,
                                           pol_scaler, None, pdt, True),
    }
    return {n: table[n]() for n in names}


def _row(m: Measurement, cfg: _Config, flops: float, peak: float, ratio: float) -> dict[str, Any]:
    too_slow = bool(m.note)  # the Harness marks a capped timing in ``note``
    step = m.step_s if m.step_times else math.inf
    return json_safe({  # the row as bench.json holds it: non-finite floats as "inf"/"-inf"/"nan"
        "dtype": cfg.dtype, "compiled": cfg.compiled,
        "step_s": step if m.step_times else None, "tokens_per_s": m.tokens_per_s if m.step_times else 0.0,
        **{k: (getattr(m, k) if m.error is None else None) for k in ("grad_rel_l2", "loss_rel", "grad_sqnr_db_min")},
        "peak_bytes": int(m.peak_bytes),
        "mfu": (flops / step / peak) if (m.step_times and peak > 0) else None,
        "steps_timed": len(m.step_times), "step_times": list(m.step_times),
        "capped": too_slow,
        "note": (f"timed on 1 step: timing stopped at a {step:.1f} s step (limit {ratio:g}x fp32 eager's step; "
                 "two steps over it, or one over 4x)" if too_slow else None),
        "error": m.error,
    })


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[autoprec bench] {msg}", flush=True)


def run_bench(model_path: str | os.PathLike, policy: Policy | str | os.PathLike, steps: int = 5, warmup: int = 2,
              device: str = "auto", configs: Sequence[str] | None = None, max_step_ratio: float = 10.0,
              skip_slow: bool = False, quiet: bool = False,
              json_path: str | os.PathLike | None = None) -> dict[str, Any]:
    """Measure ``policy`` and the baselines (:data:`CONFIGS`) on ``model_path`` in this process.

    Args:
        model_path: Model file (docs/architecture.md#modelpy-contract).
        policy: A :class:`Policy` or a policy JSON file.
        steps: Timed training steps per configuration (median reported).
        warmup: Untimed steps before timing.
        device: ``auto``, ``cpu``, ``cuda``.
        configs: Subset of :data:`CONFIGS`, measured in the order given (``fp32_eager`` is always
            measured, first: it is the reference and sets the slow-step limit).
        max_step_ratio: Timing stops after two steps in a row over this multiple of
            ``fp32_eager``'s step (floor 1 s), or one over 4x that: ``capped``, last step reported.
        skip_slow: Skip (not run) low-precision baselines when the low dtype's measured matmul
            peak is more than ``max_step_ratio`` times below fp32's; for CPUs that emulate bf16.
        json_path: Also write the result here after every configuration (``"partial": true``
            until the last), so a run cut short by a time limit keeps what it measured.

    Returns:
        ``{"device", "machine", "torch", "autoprec", "date", "model", "policy", "steps", "warmup",
        "tokens_per_batch", "flops", "matmul_peak", "low_dtype", "configs": {name: row}}`` where a
        row holds ``step_s`` (s), ``tokens_per_s``, ``ratio_vs_fp32_eager``,
        ``ratio_vs_autocast_compiled`` (throughput ratios; > 1 is faster), ``grad_rel_l2``,
        ``peak_bytes`` (bytes), ``mfu`` (0..1), ``steps_timed``, ``capped``, ``note``, ``error``.
        ``None``: not measured (skipped, failed, no baseline); a measured non-finite number is
        ``"inf"``/``"-inf"``/``"nan"`` (``autoprec._io.json_safe``), here as in ``bench.json``.

    Raises:
        ModelSpecError, CaptureError, PolicyError: bad model or policy file.
        ValueError: unknown configuration name or device.
    """
    from autoprec._version import __version__

    names = list(configs) if configs else list(CONFIGS)
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        raise ValueError(f"unknown bench config(s) {', '.join(bad)}; valid: {', '.join(CONFIGS)}")
    names = ["fp32_eager"] + [n for n in dict.fromkeys(names) if n != "fp32_eager"]
    pol = policy if isinstance(policy, Policy) else Policy.load(policy)
    spec = load_model_spec(model_path)
    dev = resolve_device(device)
    low = autocast_dtype(dev)  # the autocast and pure-low baselines' dtype: the same rule as tune's
    h = Harness(spec, dev, warmup=warmup, steps=steps)
    flops = model_flops(h.model, h.batches[0], h.tokens)
    cfgs = _build_configs(h, pol, low, names)
    main = cfgs["policy_eager"].dtype if "policy_eager" in cfgs else _main_dtype(
        run_pipeline(h.graph_module, pol).graph_module, pol)
    peaks = _measure_peaks([main, "fp32", NAMES[low]], dev, quiet)
    slow_low = peaks[NAMES[low]] * max_step_ratio < peaks["fp32"]
    rows: dict[str, dict[str, Any]] = {}
    limit: float | None = None
    machine = describe_machine(dev)
    result = {
        "device": machine["device"], "machine": machine, "torch": torch.__version__, "autoprec": __version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": str(spec.path), "policy": pol.to_dict(), "policy_main_dtype": main, "low_dtype": NAMES[low],
        "steps": steps, "warmup": warmup, "max_step_ratio": max_step_ratio, "tokens_per_batch": h.tokens,
        "flops": flops, "matmul_peak": {"dtype": main, "flops_per_s": peaks[main], "by_dtype": peaks},
        "partial": True, "configs": rows,
    }
    for name in names:
        cfg = cfgs[name]
        if skip_slow and slow_low and cfg.dtype == NAMES[low] and not name.startswith("policy"):
            rows[name] = _skipped(cfg, f"skipped: {NAMES[low]} matmul measured "
                                       f"{peaks['fp32'] / peaks[NAMES[low]]:.0f}x slower than fp32 here")
            _log(f"{name}: {rows[name]['note']}", quiet)
            _checkpoint(result, json_path)
            continue
        m, rows[name] = _measure_config(name, cfg, flops["flops_per_step"], peaks[main], max_step_ratio,
                                        limit, quiet)
        if name == "fp32_eager" and m.step_times:
            limit = max(max_step_ratio * m.step_s, 1.0)
        _checkpoint(result, json_path)
    _remeasure_peaks(result, dev, quiet)
    result["partial"] = False
    _checkpoint(result, json_path)
    return result


def _measure_peaks(dtypes: Sequence[str], dev: torch.device, quiet: bool) -> dict[str, float]:
    """The matmul peak (FLOP/s, :func:`matmul_peak_flops`) of each distinct dtype name, logged."""
    peaks = {}
    for dn in dict.fromkeys(dtypes):
        peaks[dn], n = matmul_peak_flops(to_torch(dn), dev)
        _log(f"matmul peak {dn}: {peaks[dn] / 1e12:.3f} TFLOP/s (n={n})", quiet)
    return peaks


def _measure_config(name: str, cfg: _Config, flops: float, peak: float, ratio: float, limit: float | None,
                    quiet: bool) -> tuple[Measurement, dict[str, Any]]:
    """Measure one configuration through its harness (a failure becomes the row's ``error``, not
    an exception); returns the measurement and its row (with ``wall_s``, seconds)."""
    _log(f"{name}: measuring ({cfg.dtype}{', compiling' if cfg.compiled else ''})", quiet)
    t0 = time.perf_counter()
    try:
        m = cfg.harness.measure(cfg.fn(), cfg.scaler, cfg.autocast, max_step_s=limit)
    except Exception as e:  # noqa: BLE001 - a configuration that cannot run is reported, not fatal
        m = Measurement(error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    finally:
        cfg.harness.restore()
    row = _row(m, cfg, flops, peak, ratio)
    row["wall_s"] = time.perf_counter() - t0
    _log(f"{name}: {row['tokens_per_s']:.0f} tok/s, grad_rel_l2 {row['grad_rel_l2']}, {row['wall_s']:.0f} s"
         + (f" ({row['note'] or row['error']})" if row['note'] or row['error'] else ""), quiet)
    return m, row


def _remeasure_peaks(result: dict[str, Any], dev: torch.device, quiet: bool) -> None:
    """Measure the matmul peaks again after the configurations and keep the higher value.

    On a shared machine one measurement can catch a busy moment and understate the peak (MFU
    then overstates); the best of two, before and after, is the better estimate of the peak.
    MFU of every row is recomputed against it.
    """
    mp = result["matmul_peak"]
    mp["before_run"] = dict(mp["by_dtype"])
    mp["after_run"] = {dn: matmul_peak_flops(to_torch(dn), dev)[0] for dn in mp["by_dtype"]}
    mp["by_dtype"] = {dn: max(mp["before_run"][dn], mp["after_run"][dn]) for dn in mp["by_dtype"]}
    old, mp["flops_per_s"] = mp["flops_per_s"], mp["by_dtype"][mp["dtype"]]
    _log(f"matmul peak {mp['dtype']} re-measured: {mp['after_run'][mp['dtype']] / 1e12:.3f} TFLOP/s "
         f"(before {old / 1e12:.3f}); MFU uses the higher", quiet)
    for r in result["configs"].values():
        if r.get("mfu") is not None and mp["flops_per_s"] > 0:
            r["mfu"] = r["mfu"] * old / mp["flops_per_s"]


def _checkpoint(result: dict[str, Any], json_path: str | os.PathLike | None) -> None:
    _ratios(result["configs"])
    if json_path is not None:
        write_bench_json(result, json_path)


def _skipped(cfg: _Config, note: str) -> dict[str, Any]:
    return {"dtype": cfg.dtype, "compiled": cfg.compiled, "step_s": None, "tokens_per_s": 0.0,
            "grad_rel_l2": None, "loss_rel": None, "grad_sqnr_db_min": None, "peak_bytes": 0, "mfu": None,
            "steps_timed": 0, "step_times": [], "capped": False, "skipped": True, "note": note, "error": None}


def _ratios(rows: dict[str, dict[str, Any]]) -> None:
    base = rows["fp32_eager"]["tokens_per_s"]
    ac = rows.get("autocast_compiled", {}).get("tokens_per_s") or 0.0
    for r in rows.values():
        t = r["tokens_per_s"]
        r["ratio_vs_fp32_eager"] = t / base if (base and t) else None
        r["ratio_vs_autocast_compiled"] = t / ac if (ac and t) else None


def format_bench_table(result: dict[str, Any]) -> str:
    """Markdown table of a :func:`run_bench` result (one row per configuration)."""
    def num(x: float | None, fmt: str) -> str:
        return "—" if x is None else x if isinstance(x, str) else format(x, fmt)

    lines = [("| config | dtype | step s | tokens/s | vs fp32 eager | vs autocast+compile | grad_rel_l2 "
             "| peak MiB | MFU | steps | note |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, r in result["configs"].items():
        lines.append(
            f"| {name} | {r['dtype']} | {num(r['step_s'], '.3f')} | {num(r['tokens_per_s'] or None, '.0f')} | "
            f"{num(r['ratio_vs_fp32_eager'], '.2f')} | {num(r['ratio_vs_autocast_compiled'], '.2f')} | "
            f"{num(r['grad_rel_l2'], '.2e')} | {num(r['peak_bytes'] / 2**20 if r['peak_bytes'] else None, '.1f')} | "
            f"{num(r['mfu'] * 100 if r['mfu'] is not None else None, '.2f')}% | {r['steps_timed']} | "
            f"{r.get('note') or r.get('error') or ''} |")
    mp = result["matmul_peak"]
    lines.append("")
    lines.append(f"{result['device']}; torch {result['torch']}; {result['date']}; "
                 f"{result['tokens_per_batch']} tokens/step; model {result['flops']['flops_per_step'] / 1e9:.1f} "
                 f"GFLOP/step; MFU vs measured {mp['dtype']} matmul peak {mp['flops_per_s'] / 1e12:.3f} TFLOP/s")
    return "\n".join(lines)


def write_bench_json(result: dict[str, Any], path: str | os.PathLike) -> None:
    """Write ``result`` as indented JSON to ``path`` with the package's atomic writer
    (:func:`autoprec._io.write_json`): an existing file is replaced whole or not at all, and
    non-finite floats are written by the package's one rule (:func:`autoprec._io.json_safe`).

    Raises:
        OSError: the file system refused the write (an existing ``path`` is left untouched).
    """
    write_json(path, result, indent=2)
