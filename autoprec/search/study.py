"""``autoprec.tune``: an Optuna study over policies, measured on the device (DESIGN §1, §5).

Flow: load model.py -> capture -> FP32 reference -> probe dtypes -> baselines (FP32, torch.autocast
eager and compiled) -> Optuna trials (each lowers the graph and measures eager training steps and
``grad_rel_l2``; duplicates of an already measured per-node dtype assignment reuse its result) ->
finalists (fastest feasible trials) compiled with Inductor and measured again, drift included, on
the compiled form -> the fastest compiled finalist within the drift budget -> policy file.

Screening eagerly and compiling only finalists keeps a trial to seconds instead of a ~60 s
Inductor compile; the finalists' compiled numbers are what the policy file reports.
"""

from __future__ import annotations

import hashlib
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import torch

from autoprec._version import __version__
from autoprec.dtypes import LOW_DTYPES, to_torch
from autoprec.errors import SearchError
from autoprec.modelspec import load_model_spec
from autoprec.passes import run_pipeline
from autoprec.policy import Policy
from autoprec.runtime.apply import compile_graph
from autoprec.runtime.train import make_scaler
from autoprec.search.measure import Harness, Measurement, resolve_device
from autoprec.search.space import SearchSpace, probe_dtypes

__all__ = ["TuneResult", "Objective", "tune", "policy_fingerprint", "graph_fingerprint", "default_storage"]

_A = "autoprec:"  # user-attribute namespace (optuna-integration style)


def graph_fingerprint(gm: torch.fx.GraphModule) -> str:
    """SHA-256 (16 hex) of the captured graph's node keys and shapes: same model code -> same value."""
    h = hashlib.sha256()
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        h.update(f"{n.op}|{n.meta.get('autoprec', {}).get('key', n.target)}|{getattr(v, 'shape', '')}|"
                 f"{getattr(v, 'dtype', '')};".encode())
    return h.hexdigest()[:16]


def policy_fingerprint(lowered: torch.fx.GraphModule) -> str:
    """SHA-256 (16 hex) of the effective per-node dtypes of a lowered graph.

    Two policies with the same fingerprint run the same computation, whatever parameters
    produced them; the study measures it once.
    """
    h = hashlib.sha256()
    for n in lowered.graph.nodes:
        meta = n.meta.get("autoprec", {})
        if meta.get("dtype") is not None:
            h.update(f"{meta.get('key', n.name)}={meta['dtype']};".encode())
    return h.hexdigest()[:16]


def default_storage(out: str | os.PathLike) -> str:
    """SQLite URL of the study file beside the output: ``policy.json`` -> ``policy.optuna.db``."""
    p = Path(out)
    return f"sqlite:///{p.with_suffix('').as_posix()}.optuna.db"


def device_name(device: torch.device) -> str:
    """Human-readable device description (GPU name, or CPU model from /proc/cpuinfo)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


@dataclass
class TuneResult:
    """What :func:`tune` returns.

    Attributes:
        policy: The chosen policy with its ``measured`` and ``provenance`` blocks.
        study: The Optuna study (all trials and their ``autoprec:`` user attributes).
        table: Rows ``{"config", "tokens_per_s", "speedup_vs_fp32", "grad_rel_l2", "peak_bytes"}``
            for FP32, torch.autocast (eager and compiled) and the chosen policy.
        timings: Seconds spent per phase (capture, baselines, trials, finalists).
        probes: Per-dtype matmul probe results.
    """

    policy: Policy
    study: optuna.Study
    table: list[dict[str, Any]]
    timings: dict[str, float] = field(default_factory=dict)
    probes: dict[str, Any] = field(default_factory=dict)


class Objective:
    """Optuna objective: params -> policy -> lowered graph -> eager measurement.

    Returns tokens/s (maximised). The drift constraint ``grad_rel_l2 - budget`` (feasible when
    ≤ 0) is stored as ``autoprec:constraint`` for the sampler's ``constraints_func``. A trial
    whose graph fails to lower, produces non-finite values or runs too slowly returns NaN, which
    Optuna records as FAIL, with the reason in ``autoprec:error``; the study goes on.

    Args:
        harness: Shared model/graph/reference.
        space: The search space.
        budget: Maximum ``grad_rel_l2``.
        max_step_s: A trial step slower than this is aborted (several times the FP32 step).
        compile: Measure the compiled graph in every trial (slow; default screens eagerly).
    """

    def __init__(self, harness: Harness, space: SearchSpace, budget: float, max_step_s: float,
                 compile: bool = False) -> None:
        self.harness, self.space, self.budget = harness, space, budget
        self.max_step_s, self.compile = max_step_s, compile

    def __call__(self, trial: optuna.Trial) -> float:
        params = self.space.suggest(trial)
        policy = self.space.to_policy(params)
        trial.set_user_attr(_A + "policy", policy.to_dict())
        try:
            lowered = run_pipeline(self.harness.graph_module, policy)
        except Exception as e:
            trial.set_user_attr(_A + "error", f"lowering failed: {e}")
            return math.nan
        fp = policy_fingerprint(lowered.graph_module)
        trial.set_user_attr(_A + "fingerprint", fp)
        trial.set_user_attr(_A + "casts", lowered.stats.get("casts", 0))
        prior = _find_measured(trial.study, fp, trial.number)
        if prior is not None:
            for k, v in prior.user_attrs.items():
                if k.startswith(_A) and k not in (_A + "policy", _A + "fingerprint"):
                    trial.set_user_attr(k, v)
            _constrain(trial, float(prior.user_attrs.get(_A + "constraint", 1e30)))
            trial.set_user_attr(_A + "reused_from", prior.number)
            return prior.value if prior.values else math.nan
        fn = compile_graph(lowered.graph_module) if self.compile else lowered.graph_module
        m = self.harness.measure(fn, lambda: make_scaler(policy), max_step_s=self.max_step_s)
        _record(trial, m, self.budget)
        if m.error is not None:
            return math.nan
        return m.tokens_per_s


def _record(trial: optuna.Trial, m: Measurement, budget: float) -> None:
    for k in ("tokens_per_s", "step_s", "grad_rel_l2", "loss_rel", "grad_sqnr_db_min", "peak_bytes"):
        v = getattr(m, k)
        trial.set_user_attr(_A + k, v if (not isinstance(v, float) or math.isfinite(v)) else None)
    g = m.grad_rel_l2
    _constrain(trial, (g - budget) if math.isfinite(g) else 1e30)
    if m.error is not None:
        trial.set_user_attr(_A + "error", m.error)


def _find_measured(study: optuna.Study, fp: str, number: int) -> optuna.trial.FrozenTrial | None:
    for t in study.get_trials(deepcopy=False):
        if t.number == number or t.user_attrs.get(_A + "fingerprint") != fp:
            continue
        if t.state == optuna.trial.TrialState.COMPLETE or (
                t.state == optuna.trial.TrialState.FAIL and _A + "error" in t.user_attrs):
            return t
    return None


def _constrain(trial: optuna.Trial, value: float) -> None:
    """Record the drift constraint (feasible when ≤ 0) for the sampler and for selection."""
    trial.set_user_attr(_A + "constraint", value)
    if hasattr(trial, "set_constraint"):  # Optuna ≥ 5; older samplers take constraints_func
        trial.set_constraint("drift", value)


def _row(name: str, m: Measurement, fp32: Measurement) -> dict[str, Any]:
    def fin(x: float) -> float | None:
        return x if math.isfinite(x) else None

    return {"config": name, "tokens_per_s": m.tokens_per_s,
            "speedup_vs_fp32": m.tokens_per_s / fp32.tokens_per_s if fp32.tokens_per_s else 0.0,
            "grad_rel_l2": fin(m.grad_rel_l2), "peak_bytes": m.peak_bytes, "error": m.error}


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[autoprec] {msg}", flush=True)


def tune(model_path: str | os.PathLike, trials: int | None = None, timeout: float | None = None,
         max_drift: str | float = "auto", device: str = "auto", storage: str | None = None,
         study_name: str | None = None, compile: bool = True, out: str | os.PathLike = "policy.json",
         seed: int = 0, finalists: int = 2, quiet: bool = False, progress: bool = True,
         dtypes: str | list[str] = "auto") -> TuneResult:
    """Search for the fastest policy within a drift budget and write it to ``out``.

    Args:
        model_path: A model file following the model.py contract (DESIGN §2).
        trials: Finished trials the study should hold (default 20; a resumed study counts the
            trials it already has).
        timeout: Stop sampling new trials after this many seconds.
        max_drift: ``"auto"``: the ``grad_rel_l2`` of ``torch.autocast`` at the device's default
            low dtype, measured in this run; or a number.
        device: ``auto``, ``cpu`` or ``cuda``.
        storage: Optuna storage URL (default: SQLite file beside ``out``); re-running resumes.
        study_name: Study name (default derived from the model file, graph and device).
        compile: Compile finalists and baselines with Inductor (the policy is then measured
            as training runs it); ``False`` measures everything eagerly.
        out: Policy file to write (atomically).
        seed: Sampler seed (reproducible sampling).
        finalists: How many of the fastest feasible trials are re-measured compiled.
        quiet: No log lines. progress: Show Optuna's progress bar.
        dtypes: Low dtypes to search: ``"auto"`` keeps those whose matmul the probe measured
            faster than fp32 on this device; a list (or comma-separated string) forces them.

    Returns:
        :class:`TuneResult`.

    Raises:
        ModelSpecError: the model file is invalid (nothing is written).
        CaptureError: the model cannot be captured.
        SearchError: bad ``max_drift``, or no policy met the budget.
    """
    budget_arg = _parse_budget(max_drift)
    forced = _parse_dtypes(dtypes)
    spec = load_model_spec(model_path)
    dev = resolve_device(device)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    harness = Harness(spec, dev)
    timings["capture_s"] = harness.capture_s
    _log(f"captured {spec.path}: {sum(1 for _ in harness.graph_module.graph.nodes)} nodes, "
         f"{harness.tokens} tokens/batch, device {device_name(dev)}", quiet)

    probes = probe_dtypes(dev)
    for p in probes.values():
        _log(f"probe {p.dtype}: matmul {p.seconds * 1e3:.2f} ms ({p.speedup:.2f}x fp32)"
             + ("" if p.usable else f" -> excluded: {p.reason}"), quiet)
    usable = forced if forced is not None else [d for d, p in probes.items() if p.usable and d != "fp32"]
    lows = sorted(usable, key=lambda d: probes[d].seconds)
    space = SearchSpace(lows)
    ac_dtype = to_torch(lows[0]) if lows else (torch.bfloat16 if dev.type == "cpu" else torch.float16)

    t1 = time.perf_counter()
    fp32 = harness.measure(harness.graph_module)
    slow = max(10 * fp32.step_s, 1.0)  # a config 10x slower than fp32 is timed on one step only
    autocast = harness.measure(harness.graph_module, autocast_dtype=ac_dtype, max_step_s=slow)
    budget = autocast.grad_rel_l2 if budget_arg is None else budget_arg
    if not math.isfinite(budget):
        raise SearchError(f"drift budget is not finite (torch.autocast drift: {autocast.error}); pass --max-drift X")
    _log(f"fp32 eager {fp32.tokens_per_s:.0f} tok/s; autocast({ac_dtype}) eager {autocast.tokens_per_s:.0f} tok/s, "
         f"grad_rel_l2 {autocast.grad_rel_l2:.3g} -> drift budget {budget:.3g}", quiet)
    timings["baselines_s"] = time.perf_counter() - t1

    study = _open_study(spec.path, harness, dev, storage, study_name, out, seed)
    _enqueue_baselines(study, space)
    t2 = time.perf_counter()
    target = trials if trials is not None else 20
    remaining = max(0, target - len([t for t in study.trials if t.state.is_finished()]))
    objective = Objective(harness, space, budget, max_step_s=slow)
    if remaining:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study.optimize(objective, n_trials=remaining, timeout=timeout, show_progress_bar=progress and not quiet,
                       catch=(Exception,))
    timings["trials_s"] = time.perf_counter() - t2

    t3 = time.perf_counter()
    chosen, chosen_m, rows_extra = _finalists(study, harness, budget, finalists, compile, ac_dtype, slow, quiet)
    timings["finalists_s"] = time.perf_counter() - t3
    timings["total_s"] = time.perf_counter() - t0

    ac_compiled = rows_extra.get("autocast_compiled")
    measured = {
        "tokens_per_s": chosen_m.tokens_per_s,
        "speedup_vs_fp32": chosen_m.tokens_per_s / fp32.tokens_per_s,
        "speedup_vs_autocast": chosen_m.tokens_per_s / (ac_compiled or autocast).tokens_per_s,
        "grad_rel_l2": chosen_m.grad_rel_l2, "loss_rel": chosen_m.loss_rel,
        "peak_bytes": chosen_m.peak_bytes, "drift_budget": budget,
        "autocast_grad_rel_l2": autocast.grad_rel_l2,
    }
    policy = chosen.with_measured(measured).with_provenance(
        model=str(spec.path), graph_fingerprint=graph_fingerprint(harness.graph_module),
        device=device_name(dev), torch=torch.__version__, autoprec=__version__,
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), study=study.study_name, compiled=compile,
    )
    policy.save(out)
    table = [_row("fp32 eager", fp32, fp32), _row(f"autocast {ac_dtype} eager", autocast, fp32)]
    if ac_compiled is not None:
        table.append(_row(f"autocast {ac_dtype} + compile", ac_compiled, fp32))
    table.append(_row("autoprec policy" + (" + compile" if compile else " (eager)"), chosen_m, fp32))
    return TuneResult(policy, study, table, timings, {k: vars(v) for k, v in probes.items()})


def _parse_dtypes(dtypes: str | list[str]) -> list[str] | None:
    if dtypes == "auto":
        return None
    names = [d.strip() for d in (dtypes.split(",") if isinstance(dtypes, str) else dtypes) if d.strip()]
    bad = [d for d in names if d not in LOW_DTYPES]
    if bad:
        raise SearchError(f"--dtypes: {', '.join(bad)} not valid; expected 'auto' or some of {', '.join(LOW_DTYPES)}")
    return names


def _parse_budget(max_drift: str | float) -> float | None:
    if max_drift == "auto":
        return None
    try:
        v = float(max_drift)
    except (TypeError, ValueError):
        raise SearchError(f"--max-drift: expected 'auto' or a positive number, got {max_drift!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise SearchError(f"--max-drift: expected 'auto' or a positive number, got {max_drift!r}")
    return v


def _open_study(path, harness, dev, storage, study_name, out, seed) -> optuna.Study:
    storage = storage or default_storage(out)
    name = study_name or f"autoprec-{Path(str(path)).stem}-{graph_fingerprint(harness.graph_module)[:8]}-{dev.type}"
    if hasattr(optuna.Trial, "set_constraint"):
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=6)
    else:  # Optuna < 5
        sampler = optuna.samplers.TPESampler(
            seed=seed, n_startup_trials=6,
            constraints_func=lambda t: [float(t.user_attrs.get(_A + "constraint", 1e30))])
    return optuna.create_study(storage=storage, study_name=name, direction="maximize", sampler=sampler,
                               load_if_exists=True)


def _enqueue_baselines(study: optuna.Study, space: SearchSpace) -> None:
    if study.trials:  # resumed: baselines were enqueued when the study was created
        return
    for _name, params in space.baselines():
        study.enqueue_trial(params, skip_if_exists=True)


def _feasible(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    ok = [t for t in done if t.user_attrs.get(_A + "constraint", 1e30) <= 0]
    seen, out = set(), []
    for t in sorted(ok, key=lambda t: -t.value):
        fp = t.user_attrs.get(_A + "fingerprint")
        if fp not in seen:
            seen.add(fp)
            out.append(t)
    return out


def _finalists(study, harness, budget, k, compile, ac_dtype, slow, quiet):
    feasible = _feasible(study)
    if not feasible:
        raise SearchError("no trial met the drift budget; not even all-fp32 finished (see the study's "
                          "autoprec:error attributes)")
    extra: dict[str, Measurement] = {}
    if not compile:
        best = feasible[0]
        pol = Policy.from_dict(best.user_attrs[_A + "policy"])
        m = harness.measure(run_pipeline(harness.graph_module, pol).graph_module, lambda: make_scaler(pol))
        return pol, m, extra
    _log("compiling torch.autocast baseline with Inductor", quiet)
    extra["autocast_compiled"] = harness.measure(compile_graph(harness.graph_module), autocast_dtype=ac_dtype,
                                                max_step_s=slow)
    best: tuple[Policy, Measurement] | None = None
    for t in feasible[:k]:
        pol = Policy.from_dict(t.user_attrs[_A + "policy"])
        _log(f"compiling finalist trial {t.number} ({pol.summary()}; eager {t.value:.0f} tok/s)", quiet)
        lowered = run_pipeline(harness.graph_module, pol).graph_module
        m = harness.measure(compile_graph(lowered), lambda pol=pol: make_scaler(pol), max_step_s=slow)
        _log(f"  compiled: {m.tokens_per_s:.0f} tok/s, grad_rel_l2 {m.grad_rel_l2:.3g}"
             + (f" ({m.error})" if m.error else ""), quiet)
        if m.error is None and m.grad_rel_l2 <= budget and (best is None or m.tokens_per_s > best[1].tokens_per_s):
            best = (pol, m)
    if best is None:
        pol = Policy.fp32()
        best = (pol, harness.measure(compile_graph(run_pipeline(harness.graph_module, pol).graph_module)))
    return best[0], best[1], extra
