"""``autoprec bench --global-batch N [--max-memory M]``: a policy against the baselines at a global
batch, each side at its own micro-batch (docs/architecture.md#micro-batch-and-memory-budget).

The policy runs at its ``batching``'s micro-batch (a policy without one: the largest that fits);
fp32 + torch.compile and torch.autocast + torch.compile each run at the largest micro-batch dividing
``N`` whose measured peak fits the budget, as a user who raises the batch until out of memory gets
(:class:`autoprec.search.micro_batch.BatchSearch`, the same measurements as ``tune --global-batch``).
All are timed in one interleaved run in this process; tokens/s per global step combine a timed
micro-step with the update (:func:`~autoprec.search.micro_batch.global_step_seconds`). Each side's
accumulated drift at the global batch is measured against the FP32 reference's, with ``tune``'s
rule against torch.autocast's.

torch.autocast's matmul speed is read off the measured matmul peaks
(:func:`autoprec.commands.bench_mfu.measure_peaks`): where its dtype's peak is ``max_step_ratio``
or more times below fp32's (an AVX2-only CPU), it cannot be the baseline to beat and is not run; its
drift passes compute its GEMMs in fp32 where the peak is
:data:`~autoprec.search.autocast_baseline.EMULATE_AT` or more times below.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any

import torch

from autoprec._io import write_json
from autoprec._version import __version__
from autoprec.applied.policy_match import check_policy_file
from autoprec.commands.bench_mfu import measure_peaks
from autoprec.device import autocast_dtype, describe_machine, resolve_device
from autoprec.dtypes import NAMES
from autoprec.errors import AutoprecError
from autoprec.measure import Harness, Measurement
from autoprec.measure.load import LoadMonitor
from autoprec.modelspec import load_model_spec
from autoprec.policy import Policy
from autoprec.search.autocast_baseline import EMULATE_AT, AutocastBaseline
from autoprec.search.budgets import check_memory_floor, memory_budget, parse_max_memory
from autoprec.search.drift_budget import DriftBudget
from autoprec.search.gates import Role
from autoprec.search.micro_batch import BatchConfig, BatchPoint, BatchSearch

__all__ = ["format_batch_table", "run_batch_bench"]


def _autocast(dev: torch.device, max_step_ratio: float, log: Any) -> AutocastBaseline:
    """torch.autocast here, from the measured matmul peaks (module docstring)."""
    low = autocast_dtype(dev)
    peaks = measure_peaks(["fp32", NAMES[low]], dev, log)
    slower = peaks["fp32"] / peaks[NAMES[low]]
    why = f"{NAMES[low]} matmul measured {slower:.0f}x slower than fp32 here"
    return AutocastBaseline(low, why if slower >= EMULATE_AT else None,
                            why if slower >= max_step_ratio else None)


def _budget(arg: tuple[str, float] | None, h: Harness, autocast: AutocastBaseline) -> float | None:
    """The byte budget of the parsed ``--max-memory`` (:func:`memory_budget`), measuring fp32 and
    torch.autocast eager at the model file's batch only when it refers to their peaks."""
    if arg is None:
        return None
    fp32 = ac = Measurement()
    if arg[0] in ("fp32", "autocast"):
        fp32 = h.measure(h.model, timing=False)
        ac = h.measure(h.model, autocast.scaler_factory(), autocast_dtype=autocast.dtype, timing=False,
                       fp32_gemms=bool(autocast.emulated))
    return memory_budget(arg, fp32, ac, h.state_bytes, h.optimizer_name, h.device)


def _at_micro_batch(why: str, pol: Policy, source: str | None, search: BatchSearch) -> str | None:
    """``why``, the policy file's warning against the graph at the model file's batch, checked again
    against the graph at the policy's micro-batch, where ``tune --global-batch`` recorded its
    ``graph_fingerprint`` (:func:`check_policy_file`; None: that graph is the tuned one)."""
    if pol.batching is None:
        return why
    gm = search.harness(pol.batching.micro_batch).graph_module
    return check_policy_file(pol, source, gm, str(search.spec.path), force=True)


def _check_global_batch(pol: Policy, source: str, global_batch: int) -> None:
    """Raise AutoprecError when ``pol``'s ``batching`` is for another global batch (names both)."""
    if pol.batching is not None and pol.batching.global_batch != global_batch:
        raise AutoprecError(f"{source}: trains at {pol.batching.describe()}, not at --global-batch "
                            f"{global_batch}; bench it at --global-batch {pol.batching.global_batch}")


def run_batch_bench(model_path: str | os.PathLike, policy: Policy | str | os.PathLike, global_batch: int,
                    max_memory: str | None = None, device: str = "auto", max_step_ratio: float = 10.0,
                    quiet: bool = False, json_path: str | os.PathLike | None = None,
                    compile: bool = True, strict_timing: bool = False, force: bool = False) -> dict[str, Any]:
    """Measure ``policy`` and the baselines at ``global_batch`` (the module docstring).

    Args:
        model_path: Model file. policy: A :class:`Policy` or a policy JSON file.
        global_batch: N, examples per optimizer step (the model file's batch unit).
        max_memory: ``--max-memory`` (bytes, ``"90%"`` of the device; ``"0.8x"``/``"auto"`` refer to
            fp32/torch.autocast eager at the model file's batch); None: no budget (each at micro-batch N).
        device: ``auto``, ``cpu``, ``cuda``. max_step_ratio: torch.autocast is not run where its
            matmul peak is this many times below fp32's. quiet: No log lines.
        json_path: Write the result here.
        compile: Compile every side (the baselines as ``torch.compile(model)``); False: every side
            eager (``bench --global-batch N --no-compile``, a quick check).
        strict_timing: Raise on a busy machine (start, before and after the timing), else warn.
        force: Measure the policy of another model (as ``bench --force`` and ``train --force``).

    Returns:
        ``{"device", "machine", "torch", "autoprec", "date", "model", "policy", "global_batch",
        "memory_budget" (bytes or None), "rows": [BatchPoint.row() ...], "policy_row", "baseline_row"
        (the baseline to beat's label), "speedup_vs_baseline" (policy tokens/s over the baseline to
        beat's, both per global step), "within_drift_rule" (bool), "drift_rule" (description),
        "compiled" (bool), "autocast_left_out" (why torch.autocast was not run, else None),
        "load" (the load checks, :class:`~autoprec.measure.load.LoadMonitor`)}``.

    Raises:
        AutoprecError: the policy's ``batching`` is for another global batch, or it does not fit the
            budget; ModelSpecError / SearchError: the model file cannot give the micro-batches, or a
            bad budget (names the numbers); PolicyError: another model's policy (unless ``force``);
            BusyMachineError: a busy machine (``strict_timing``, :mod:`autoprec.measure.load`).
    """
    def log(msg: str) -> None:
        if not quiet:
            print(f"[autoprec bench] {msg}", flush=True)

    pol = policy if isinstance(policy, Policy) else Policy.load(policy)
    source = str(policy) if not isinstance(policy, Policy) else "the policy"
    _check_global_batch(pol, source, global_batch)
    spec, dev = load_model_spec(model_path), resolve_device(device)
    check_memory_floor(arg := parse_max_memory(max_memory), spec.build_model(), spec.make_optimizer)
    load = LoadMonitor.start(dev, strict_timing)
    autocast = _autocast(dev, max_step_ratio, log)
    h = Harness(spec, dev, drift_batches=1)  # the file's batch: what "0.8x" and "auto" refer to
    file_source = None if isinstance(policy, Policy) else source  # another model's policy: refused
    why = check_policy_file(pol, file_source, h.graph_module, str(spec.path), force)
    budget, fp32_step = _budget(arg, h, autocast), h.measure(h.model).step_s
    # the auto rule, re-based on torch.autocast's accumulated drift by search.rule
    search = BatchSearch(spec, dev, global_batch, budget, compile, autocast, DriftBudget(rule="auto"),
                         slow=None, quiet=quiet, file_harness=h)
    if why := why and _at_micro_batch(why, pol, file_source, search):
        log(f"warning: {why}")
    bar_cfgs = [c for c in search.configs(Policy.fp32(), h.random) if c.role is Role.BASELINE]
    mine = BatchConfig("policy", Role.POLICY, dataclasses.replace(pol, batching=None))
    pts = [p for c in bar_cfgs if (p := search.fit(c)) is not None]
    own = _own_point(search, mine, pol, source)
    rule = search.rule(search.base)
    for p in [*pts, own]:
        search.drift(p)
    search.slow = max_step_ratio * fp32_step * global_batch / search.file_batch
    load.check("before timing")
    search.time([p for p in [own, *pts] if p.error is None])
    load.check("after timing")
    bars = [p for p in pts if p.tokens_per_s > 0]
    bar = max(bars, key=lambda p: p.tokens_per_s) if bars else None
    result = {
        **_header(spec.path, pol, dev), "global_batch": global_batch, "memory_budget": budget,
        "rows": [p.row() for p in search.points], "policy_row": own.label,
        "baseline_row": bar.label if bar is not None else None,
        "speedup_vs_baseline": own.tokens_per_s / bar.tokens_per_s if bar is not None and own.tokens_per_s
        else None,
        "within_drift_rule": bool(own.drift) and rule.feasible(own.drift), "drift_rule": rule.describe(),
        "drift_rule_detail": rule.explain(own.drift) if own.drift else None, "compiled": compile,
        "autocast_left_out": None if autocast.in_contest(h.random) else autocast.cannot_win,
        "load": load.records,
    }
    if json_path is not None:
        write_json(json_path, result)
    return result


def _header(model: os.PathLike, pol: Policy, dev: torch.device) -> dict[str, Any]:
    """A result's where and when: the device and machine, versions, the date, model and policy."""
    machine = describe_machine(dev)
    return {"device": machine["device"], "machine": machine, "torch": torch.__version__,
            "autoprec": __version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "model": str(model), "policy": pol.to_dict()}


def _own_point(search: BatchSearch, mine: BatchConfig, pol: Policy, source: str) -> BatchPoint:
    """The policy's point: at its ``batching``'s micro-batch, else the largest that fits.

    Raises:
        AutoprecError: it failed there, or it fits the budget at no micro-batch (names the numbers)."""
    own = search.point(mine, pol.batching.micro_batch) if pol.batching is not None else search.fit(mine)
    if own is not None and own.error is not None:
        raise AutoprecError(f"{source}: failed at micro-batch {own.micro_batch}: {own.error}")
    if own is None or not own.fits:
        where = (f" (peak {own.peak_bytes} bytes at micro-batch {own.micro_batch})" if own
                 else " at any micro-batch")
        raise AutoprecError(f"{source}: does not fit the memory budget ({search.memory_budget:.0f} bytes) at "
                            f"global batch {search.n}{where}")
    return own


def format_batch_table(res: dict[str, Any]) -> str:
    """Markdown: each measured configuration at its micro-batch (peak, fits, accumulated drift,
    tokens/s per global step), then the policy against the baseline to beat."""
    budget = res["memory_budget"]
    lines = [f"global batch {res['global_batch']}, memory budget "
             + (f"{budget / 2**20:.1f} MiB" if budget else "none") + f"; {res['device']}", "",
             "| configuration | micro-batch x accumulation | peak MiB | fits | grad_rel_l2 (accumulated) | "
             "tokens/s |", "|---|---|---:|---|---:|---:|"]
    for r in res["rows"]:
        drift = f"{r['grad_rel_l2']:.2e}" if r["grad_rel_l2"] is not None else ""
        tps = f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else (r["error"] or r["note"] or "")
        lines.append(f"| {r['config']} | {r['micro_batch']}x{r['accumulation']} | "
                     f"{r['peak_bytes'] / 2**20:.1f} | {'yes' if r['fits'] else 'no'} | {drift} | {tps} |")
    ratio = res["speedup_vs_baseline"]
    bar = ("the baseline to beat" if res.get("compiled", True)
           else "the faster eager baseline; the baseline to beat is compiled: bench without --no-compile")
    if res.get("autocast_left_out"):
        lines += ["", f"torch.autocast was not run: {res['autocast_left_out']}"]
    lines += ["", f"{res['policy_row']}: " + (f"{ratio:.2f}x {res['baseline_row']} ({bar})"
                                              if ratio else "no baseline fits")
              + f"; drift {'within' if res['within_drift_rule'] else 'OVER'} the rule "
              f"({res['drift_rule_detail']})"]
    return "\n".join(lines)
