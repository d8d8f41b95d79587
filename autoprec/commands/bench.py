"""``autoprec bench``: a policy side by side with the standard baselines (docs/architecture.md#measurements).

In one process, on the same weights and batches, every configuration below runs full training
steps (forward, loss, backward, optimizer step, loss scaler) through the one measurement
:class:`~autoprec.measure.harness.Harness` that ``autoprec tune`` uses:

=====================  ===========================================================================
``fp32_eager``         the user's ``nn.Module`` in fp32
``fp32_compiled``      the captured fp32 graph compiled with Inductor
``autocast_eager``     ``torch.autocast`` around the ``nn.Module``, in the low dtype of
                       :func:`autoprec.device.autocast_dtype` (the one ``tune`` compares with)
``autocast_compiled``  ``torch.autocast`` around the ``nn.Module`` compiled (``torch.compile``)
``pure_low_eager``     a copy of the model cast to the low dtype (``model.to(dtype)``): no master
                       weights, optimizer state in the low dtype
``pure_low_compiled``  that copy compiled (``torch.compile`` of the ``nn.Module``)
``policy_eager``       the policy-lowered graph (fp32 master weights), its ``saved`` activation
                       dtypes honoured, as ``train --no-compile`` runs it
``policy_compiled``    the policy-lowered graph compiled (what ``autoprec train`` runs)
=====================  ===========================================================================

Compiled configurations all use :data:`autoprec.applied.compile.INDUCTOR_OPTIONS`, so compiled
rows differ only in their dtypes. First each configuration's drift and memory are measured in turn
(``Harness.measure(timing=False)``; compiling happens there), ``fp32_eager`` also timed back to
back to set the slow-step limit ``max(max_step_ratio x fp32_eager's step, 1 s)``. Then every
configuration that did not fail is timed in one :func:`autoprec.measure.timing.time_interleaved`
call (rounds A B C ... A B C, :data:`STEPS_PER_ROUND` steps each), so every row's tokens/s comes
from the same rounds and carries a bootstrap 95% band of its median, and the ``vs
autocast+compile`` column says ``tie`` where :func:`autoprec.measure.noise.compare` finds the
difference within the noise. A configuration whose steps are too slow against the limit (two
steps in a row over it, or one step over 4x it: :func:`autoprec.training.steps.slow_step_guard`;
e.g. bf16 on a CPU without native bf16 arithmetic) is dropped from later rounds, and its row
says so (``capped``). Rows and table: :mod:`autoprec.commands.bench_table`. Every row runs batches of
every shape with no compile timed (:mod:`autoprec.commands.bench_shapes`); ``autoprec bench`` exits 1
if a row failed.

MFU: :mod:`autoprec.commands.bench_mfu`.
"""

from __future__ import annotations

import datetime
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from autoprec._io import write_json
from autoprec._torch_compat import compile_cache_counts
from autoprec._version import __version__
from autoprec.applied.compile import cache_report
from autoprec.applied.policy_match import check_policy_file
from autoprec.capture import warmup_steps
from autoprec.commands import bench_shapes as shapes
from autoprec.commands.bench_configs import BenchConfig, build_configs, main_dtype
from autoprec.commands.bench_mfu import (
    measure_peaks,
    model_flops,
    remeasure_peaks,
    row_peak,
)
from autoprec.commands.bench_table import add_ratios, format_bench_table, make_row, skipped_row
from autoprec.device import autocast_dtype, describe_machine, resolve_device
from autoprec.dtypes import NAMES
from autoprec.measure import Config, Harness, Measurement, Outcome, format_rate, time_interleaved
from autoprec.measure.load import LoadMonitor
from autoprec.modelspec import load_model_spec
from autoprec.passes import run_pipeline
from autoprec.policy import Policy

__all__ = [
    "CONFIGS",
    "MAX_ROUNDS",
    "MIN_ROUNDS",
    "STEPS_PER_ROUND",
    "describe_machine",
    "format_bench_table",
    "run_bench",
    "write_bench_json",
]

#: Interleaved timing (:func:`autoprec.measure.timing.time_interleaved`): timed steps of each
#: configuration per round, and the rounds at least (raised to cover ``--steps``) and at most.
STEPS_PER_ROUND, MIN_ROUNDS, MAX_ROUNDS = 2, 3, 12

#: Every configuration ``autoprec bench`` knows, in table order.
CONFIGS: tuple[str, ...] = (
    "fp32_eager", "fp32_compiled", "autocast_eager", "autocast_compiled",
    "pure_low_eager", "pure_low_compiled", "policy_eager", "policy_compiled",
)


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[autoprec bench] {msg}", flush=True)


def run_bench(model_path: str | os.PathLike, policy: Policy | str | os.PathLike, steps: int = 5,
              warmup: int = 2, device: str = "auto", configs: Sequence[str] | None = None,
              max_step_ratio: float = 10.0, skip_slow: bool = False, quiet: bool = False,
              json_path: str | os.PathLike | None = None, rel_band: float = 0.03, time_cap_s: float = 120.0,
              strict_timing: bool = False, force: bool = False) -> dict[str, Any]:
    """Measure ``policy`` and the baselines (:data:`CONFIGS`) on ``model_path`` in this process.

    Args:
        model_path: Model file (docs/architecture.md#modelpy-contract).
        policy: A :class:`Policy` or a policy JSON file.
        steps: Timed training steps per configuration at least (median reported): the
            interleaved timing runs ``max(MIN_ROUNDS, ceil(steps / STEPS_PER_ROUND))`` rounds at
            least and ``MAX_ROUNDS`` (12) at most.
        warmup: Untimed steps per configuration before the rounds (up to every batch shape's first batch).
        device: ``auto``, ``cpu``, ``cuda``.
        configs: Subset of :data:`CONFIGS`, measured in the order given (``fp32_eager`` is always
            measured, first: it is the reference and sets the slow-step limit).
        max_step_ratio: A configuration is dropped from later rounds after two steps in a row
            over this multiple of ``fp32_eager``'s step (floor 1 s), or one over 4x that: ``capped``.
        skip_slow: Skip (not run) low-precision baselines whose matmul peak is over ``max_step_ratio``
            x below fp32's (CPUs that emulate bf16); without it they are timed last, one step each.
        json_path: Also write the result here after every configuration's drift pass and the
            timing (``"partial": true`` until the end): a run cut short keeps what it measured.
        rel_band: Timing stops (after the minimum rounds) once every band's relative half-width is ≤ this.
        time_cap_s: No timing round starts after this many seconds of timing.
        strict_timing: Raise ``BusyMachineError`` (exit 2) on a busy machine (:mod:`autoprec.measure.load`).
        force: Measure a policy none of whose module or node rules matches a node of this model
            (:func:`autoprec.applied.policy_match.check_policy_matches`, as ``train --force``).

    Returns:
        ``{"device", "machine", "torch", "autoprec", "date", "model", "policy", "steps", "warmup",
        "tokens_per_batch", "flops", "matmul_peak", "low_dtype", "timing", "compile_cache",
        "configs": {name: row}}`` (``timing``: the interleaving's settings, ``max_step_s`` and
        ``wall_s`` in seconds; ``compile_cache``: :func:`_drift_all`) where a row holds ``step_s``
        (s, median), ``step_s_band`` (s), ``iqr_s`` (s), ``tokens_per_s``, ``tokens_per_s_band``
        (bootstrap 95% interval, tokens/s), ``rel_half_width``, ``rounds``,
        ``ratio_vs_fp32_eager``, ``ratio_vs_autocast_compiled`` (throughput ratios; > 1 is faster),
        ``vs_autocast_compiled`` (:func:`autoprec.commands.bench_table.add_ratios`: ratio, band, tie,
        winner), ``grad_rel_l2``, ``peak_bytes`` (bytes), ``mfu`` (0..1), ``steps_timed``,
        ``capped``, ``note``, ``error``, ``compile_cache`` (:func:`_drift_all`).
        ``None``: not measured (skipped, failed, no baseline); a measured non-finite number is
        ``"inf"``/``"-inf"``/``"nan"`` (``autoprec._io.json_safe``), here as in ``bench.json``.

    Raises:
        ModelSpecError, CaptureError, PolicyError: bad model or policy file (or policy for this model).
        ValueError: unknown configuration name or device.
    """
    names = _config_names(configs)
    pol = policy if isinstance(policy, Policy) else Policy.load(policy)
    spec = load_model_spec(model_path)
    dev = resolve_device(device)
    load = LoadMonitor.start(dev, strict_timing)  # the machine's load; again before and after the timing
    low = autocast_dtype(dev)  # the autocast and pure-low baselines' dtype: the same rule as tune's
    h = Harness(spec, dev, warmup=warmup, steps=steps)
    source = _check_policy(pol, policy, h.graph_module, str(spec.path), force, quiet)
    flops = model_flops(h.model, h.batches[0], h.tokens)
    cfgs = build_configs(h, pol, low, names, source=source)
    main = cfgs["policy_eager"].dtype if "policy_eager" in cfgs else main_dtype(
        run_pipeline(h.graph_module, pol).graph_module, pol)
    peaks = measure_peaks([main, "fp32", NAMES[low]], dev, lambda m: _log(m, quiet))
    slow = _too_slow(cfgs, peaks, max_step_ratio)  # timed after the rounds (_time_all)
    machine = describe_machine(dev)
    result = {
        "device": machine["device"], "machine": machine, "torch": torch.__version__, "autoprec": __version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": str(spec.path), "policy": pol.to_dict(), "policy_main_dtype": main, "low_dtype": NAMES[low],
        "steps": steps, "warmup": warmup, "max_step_ratio": max_step_ratio, "tokens_per_batch": h.tokens,
        "flops": flops, "matmul_peak": {"dtype": main, "flops_per_s": peaks[main], "by_dtype": peaks},
        "timing": {"interleaved": True, "steps_per_round": STEPS_PER_ROUND, "max_step_s": None},
        "partial": True, "configs": {}, "load": load.records,
    }
    skip = {n: why for n, why in slow.items() if cfgs[n].dtype == NAMES[low]} if skip_slow else {}
    drift = _drift_all(names, cfgs, result, skip, json_path, quiet)
    _time_all(h, cfgs, drift, result, min_rounds=max(MIN_ROUNDS, math.ceil(steps / STEPS_PER_ROUND)),
              rel_band=rel_band, time_cap_s=time_cap_s, quiet=quiet, load=load, after=slow)
    _checkpoint(result, json_path)
    remeasure_peaks(result, dev, lambda m: _log(m, quiet))
    result["partial"] = False
    _checkpoint(result, json_path)
    return result


def _config_names(configs: Sequence[str] | None) -> list[str]:
    """The configurations to run, ``fp32_eager`` first (the others' slow-step limit), each once.

    Raises:
        ValueError: a name not in :data:`CONFIGS`.
    """
    names = list(configs) if configs else list(CONFIGS)
    if bad := [n for n in names if n not in CONFIGS]:
        raise ValueError(f"unknown bench config(s) {', '.join(bad)}; valid: {', '.join(CONFIGS)}")
    return ["fp32_eager"] + [n for n in dict.fromkeys(names) if n != "fp32_eager"]


def _check_policy(pol: Policy, policy: Policy | str | os.PathLike, gm: Any, model_path: str, force: bool,
                  quiet: bool) -> str | os.PathLike | None:
    """Refuse the policy of another model as ``train`` does (unless ``force``), and warn when the
    policy file was tuned on another graph (:mod:`autoprec.applied.policy_match`); returns the
    policy file (None: ``policy`` is a :class:`Policy`), which messages name.

    Raises:
        PolicyError: none of its module or node rules matches a node of ``gm``.
    """
    source = None if isinstance(policy, Policy) else policy
    if why := check_policy_file(pol, source, gm, model_path, force, at_batching=False):  # the file's batch
        _log(f"warning: {why}", quiet)
    return source


def _too_slow(cfgs: dict[str, BenchConfig], peaks: dict[str, float], ratio: float) -> dict[str, str]:
    """Configurations whose dtype's matmul peak is more than ``ratio`` x below fp32's -> why
    (``"bf16 matmul measured 81x slower than fp32 here"``): :func:`_time_all` times them last."""
    return {n: f"{c.dtype} matmul measured {peaks['fp32'] / peaks[c.dtype]:.0f}x slower than fp32 here"
            for n, c in cfgs.items() if c.dtype in peaks and peaks[c.dtype] * ratio < peaks["fp32"]}


def _drift_all(names: Sequence[str], cfgs: dict[str, BenchConfig], result: dict[str, Any],
               skip: dict[str, str], json_path: str | os.PathLike | None,
               quiet: bool) -> dict[str, tuple[Measurement, Any]]:
    """Drift and memory of each configuration in turn (``fp32_eager`` timed too, back to back, for
    the slow-step limit ``result["timing"]["max_step_s"]``); rows without timing, checkpointed.

    A compiled configuration's row says what Inductor's caches served its compile
    (``compile_cache``, :func:`autoprec.applied.compile.cache_report`; None for an eager one;
    after ``tune`` on the same model and policy, ``policy_compiled`` is an AOTAutograd hit), and
    ``result["compile_cache"]`` what they served all of them.
    Configurations in ``skip`` (name -> why, :func:`_too_slow`; never the policy's) get a skipped row. Returns
    ``{name: (drift measurement, the module it ran)}`` of those run (failed ones included).
    """
    rows, out, start = result["configs"], {}, compile_cache_counts()
    for name in names:
        cfg = cfgs[name]
        if name in skip and not name.startswith("policy"):
            rows[name] = skipped_row(cfg.dtype, cfg.compiled, f"skipped: {skip[name]}")
            _log(f"{name}: {rows[name]['note']}", quiet)
        else:
            _log(f"{name}: measuring drift ({cfg.dtype}{', compiling' if cfg.compiled else ''})", quiet)
            t0, fn, caches = time.perf_counter(), None, compile_cache_counts()
            try:
                fn = cfg.fn()
                m = cfg.harness.measure(fn, cfg.scaler, cfg.autocast, timing=name == "fp32_eager")
            except Exception as e:  # noqa: BLE001 - a configuration that cannot run is reported, not fatal
                m = Measurement(outcome=Outcome.failed(
                    f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
            finally:
                cfg.harness.restore()
            out[name] = (m, fn)
            rows[name] = {**make_row(m, cfg.dtype, cfg.compiled), "wall_s": time.perf_counter() - t0,
                          "compile_cache": cache_report(caches) if cfg.compiled else None}
            _log(f"{name}: grad_rel_l2 {m.grad_rel_l2:.3g}, {rows[name]['wall_s']:.0f} s"
                 + (f"; {rows[name]['compile_cache']}" if cfg.compiled else "")
                 + (f" ({rows[name]['error']})" if rows[name]["error"] else ""), quiet)
            if name == "fp32_eager" and m.step_times:
                result["timing"]["max_step_s"] = max(result["max_step_ratio"] * m.step_s, 1.0)
        _checkpoint(result, json_path)
    result["compile_cache"] = cache_report(start)  # the drift passes compiled every compiled row
    _log(result["compile_cache"], quiet)
    return out


def _time_all(h: Harness, cfgs: dict[str, BenchConfig], drift: dict[str, tuple[Measurement, Any]],
              result: dict[str, Any], min_rounds: int, rel_band: float, time_cap_s: float,
              quiet: bool, load: LoadMonitor, after: dict[str, str]) -> None:
    """Time every configuration whose drift pass ran in one :func:`time_interleaved` call (same
    rounds for all rows) and fill in their rows' timing, MFU and ratios; ``load`` checks the
    machine before and after (``BusyMachineError`` under ``strict_timing``).

    The configurations in ``after`` (name -> why: their dtype's matmul peak is over
    ``max_step_ratio`` x slower than fp32's, e.g. bf16 on a CPU without native bf16) are timed
    after those rounds, in one round of one step (the slow-step rule applies): timed among the
    others, their warm-up and steps would use up the time cap before the first round and leave
    every row untimed. ``result["timing"]["timed_after"]`` lists them; their note says so."""
    load.check("before timing")
    todo = [n for n, (m, _fn) in drift.items() if m.error is None]
    tm, watch = result["timing"], {n: shapes.CompileWatch(drift[n][1]) for n in todo}
    tm.update(min_rounds=min_rounds, max_rounds=max(MAX_ROUNDS, min_rounds), rel_band=rel_band,
              time_cap_s=time_cap_s, warmup_steps=warmup_steps(h.batches, result["warmup"]),
              timed_after=[n for n in todo if n in after])
    rounds = [n for n in todo if n not in after]
    _log(f"timing {', '.join(rounds)} interleaved ({tm['steps_per_round']} steps each per round, "
         f"{min_rounds}-{tm['max_rounds']} rounds, until ±{100 * rel_band:g}% or {time_cap_s:g} s)"
         + (f"; then {', '.join(tm['timed_after'])}, one step each" if tm["timed_after"] else ""), quiet)
    t0 = time.perf_counter()

    def timed(names: list[str], min_r: int, max_r: int, per_round: int) -> dict[str, Any]:
        return time_interleaved(
            h, [Config(n, watch[n], cfgs[n].scaler, cfgs[n].autocast,
                       cfgs[n].harness if cfgs[n].harness is not h else None) for n in names],
            min_rounds=min_r, max_rounds=max_r, steps_per_round=per_round, warmup=tm["warmup_steps"],
            rel_band=rel_band, time_cap_s=time_cap_s, max_step_s=tm["max_step_s"]) if names else {}

    timings = timed(rounds, min_rounds, tm["max_rounds"], tm["steps_per_round"])
    for n, t in timed(tm["timed_after"], 1, 1, 1).items():
        why = f"timed after the interleaved rounds, one step: {after[n]}"
        t.note = f"{why}; {t.note}" if t.note else why
        timings[n] = t
    tm["wall_s"] = time.perf_counter() - t0
    load.check("after timing")
    flops, mp = result["flops"]["flops_per_step"], result["matmul_peak"]
    rows = result["configs"]
    for n in timings:  # a timed step that compiled (a shape the warm-up missed) is left out
        t, late = shapes.drop_compiled_steps(timings[n], watch[n], tm["warmup_steps"], cfgs[n].harness.tokens)
        timings[n] = t
        peak = row_peak(mp, cfgs[n].dtype)
        rows[n] = {**make_row(drift[n][0], cfgs[n].dtype, cfgs[n].compiled, t, flops, peak,
                              result["max_step_ratio"], late),
                   "wall_s": rows[n]["wall_s"], "compile_cache": rows[n]["compile_cache"]}
        why = rows[n]["note"] or rows[n]["error"]
        _log(f"{n}: {format_rate(t)} tok/s over {t.rounds} rounds" + (f" ({why})" if why else ""), quiet)
    add_ratios(rows, timings)


def _checkpoint(result: dict[str, Any], json_path: str | os.PathLike | None) -> None:
    add_ratios(result["configs"])
    if json_path is not None:
        write_bench_json(result, json_path)


def write_bench_json(result: dict[str, Any], path: str | os.PathLike) -> None:
    """Write ``result`` as indented JSON to ``path`` with the package's atomic writer
    (:func:`autoprec._io.write_json`): an existing file is replaced whole or not at all, and
    non-finite floats are written by the package's one rule (:func:`autoprec._io.json_safe`).

    Raises:
        OSError: the file system refused the write (an existing ``path`` is left untouched).
    """
    write_json(path, result, indent=2)
