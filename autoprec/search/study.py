"""``autoprec.tune``: an Optuna study over policies, measured on the device (DESIGN §1, §5).

Flow: load model.py -> capture -> FP32 reference -> probe dtypes -> baselines (FP32 and
torch.autocast, eager) -> Optuna trials (each lowers the graph and measures eager training steps,
``grad_rel_l2`` and memory; a per-node dtype assignment already measured in the study is reused)
-> finalists (fastest feasible trials) compiled with Inductor and measured again on the compiled
form, drift included, and checked on ``traj_rel`` over K optimizer steps -> with ``max_memory``,
finalists over the memory budget get an activation memory budget (recomputation in backward)
that fits, found in at most three compiles -> the fastest finalist within the budgets -> policy
file + report.

Screening eagerly and compiling only finalists keeps a trial to seconds instead of a ~60 s
Inductor compile; the finalists' compiled numbers are what the policy file reports.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import torch

from autoprec._interrupt import check as check_interrupt
from autoprec._version import __version__
from autoprec.dtypes import LOW_DTYPES, NAMES, to_torch
from autoprec.errors import SearchError
from autoprec.modelspec import load_model_spec
from autoprec.passes import run_pipeline
from autoprec.policy import Policy
from autoprec.runtime.apply import compile_graph
from autoprec.runtime.train import autocast_scaler, make_scaler
from autoprec.search.measure import Harness, Measurement, describe_machine, resolve_device, traj_rel
from autoprec.search.objective import ATTR, DIRECTIONS, Objective, is_dead_worker
from autoprec.search.space import SearchSpace, find_blocks, outside_matmuls, probe_dtypes

__all__ = ["TuneResult", "tune", "graph_fingerprint", "default_storage", "sqlite_path", "device_name", "open_study"]

_A = ATTR

#: Version of what a trial measures and how (search/measure.py). Bump it when a change makes old
#: trials' numbers incomparable with new ones; a study holding trials of another version is not
#: resumed. 2: a parameter saved for backward counts once in the CPU peak bytes.
MEASURE_VERSION = 2
#: A configuration whose training step takes longer than this many fp32 eager steps is timed on
#: that one step only: it cannot win, and emulated dtypes (bf16 on AVX2 CPUs) run 10-100x slower.
SLOW_RATIO = 3.0
#: ... but never below this many seconds: tiny models' steps are dominated by Python overhead noise.
SLOW_FLOOR_S = 0.25


def graph_fingerprint(gm: torch.fx.GraphModule) -> str:
    """SHA-256 (16 hex) of the captured graph's node keys and shapes: same model code -> same value."""
    h = hashlib.sha256()
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        h.update(f"{n.op}|{n.meta.get('autoprec', {}).get('key', n.target)}|{getattr(v, 'shape', '')}|"
                 f"{getattr(v, 'dtype', '')};".encode())
    return h.hexdigest()[:16]


def default_storage(out: str | os.PathLike) -> str:
    """SQLite URL of the study file beside the output: ``policy.json`` -> ``policy.optuna.db``."""
    p = Path(out)
    return f"sqlite:///{p.with_suffix('').as_posix()}.optuna.db"


def sqlite_path(storage: str | None) -> str | None:
    """The file of a ``sqlite:///PATH`` storage URL (None for other URLs and in-memory SQLite)."""
    if storage and storage.startswith("sqlite:///") and storage[len("sqlite:///"):] not in ("", ":memory:"):
        return storage[len("sqlite:///"):]
    return None


def device_name(device: torch.device) -> str:
    """Human-readable device description: the GPU's name, or the CPU model and core count."""
    return describe_machine(device)["device"]


@dataclass
class TuneResult:
    """What :func:`tune` returns.

    Attributes:
        policy: The chosen policy with its ``measured`` and ``provenance`` blocks.
        study: The Optuna study (all trials and their ``autoprec:`` user attributes).
        table: Rows ``{"config", "tokens_per_s", "speedup_vs_fp32", "grad_rel_l2", "peak_bytes"}``
            for FP32, torch.autocast (eager and compiled) and the chosen policy.
        timings: Seconds spent per phase (capture, probe, baselines, trials, compile, finalists).
        probes: Per-dtype matmul probe results.
    """

    policy: Policy
    study: optuna.Study
    table: list[dict[str, Any]]
    timings: dict[str, float] = field(default_factory=dict)
    probes: dict[str, Any] = field(default_factory=dict)


def _row(name: str, m: Measurement, fp32: Measurement) -> dict[str, Any]:
    def fin(x: float) -> float | None:
        return x if math.isfinite(x) else None

    return {"config": name, "tokens_per_s": m.tokens_per_s,
            "speedup_vs_fp32": m.tokens_per_s / fp32.tokens_per_s if fp32.tokens_per_s else 0.0,
            "grad_rel_l2": fin(m.grad_rel_l2), "peak_bytes": m.peak_bytes, "error": m.error or m.note}


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[autoprec] {msg}", flush=True)


def tune(model_path: str | os.PathLike, trials: int | None = None, timeout: float | None = None,
         max_drift: str | float = "auto", device: str = "auto", storage: str | None = None,
         study_name: str | None = None, compile: bool = True, out: str | os.PathLike = "policy.json",
         seed: int = 0, finalists: int = 2, quiet: bool = False, progress: bool = True,
         dtypes: str | list[str] = "auto", traj_steps: int = 20, report: bool = True,
         max_memory: str | float | None = None) -> TuneResult:
    """Search for the fastest policy within a drift budget and write it to ``out``.

    Args:
        model_path: A model file following the model.py contract (DESIGN §2).
        trials: Finished trials the study should hold (default 20); a resumed or shared study
            counts the trials it already has, so re-running the same command resumes.
        timeout: Stop sampling new trials after this many seconds.
        max_drift: ``"auto"``: the ``grad_rel_l2`` of ``torch.autocast`` at the device's default
            low dtype, measured in this run; or a number.
        device: ``auto``, ``cpu`` or ``cuda``.
        storage: Optuna storage URL (default: SQLite file beside ``out``). Any RDB URL works,
            so several workers can share one study.
        study_name: Study name (default derived from the model file, graph and device).
        compile: Compile finalists with Inductor (the policy is measured as training runs it);
            ``False`` measures everything eagerly.
        out: Policy file to write (atomically); the report goes beside it.
        seed: Sampler seed (reproducible sampling).
        finalists: How many of the fastest feasible trials are re-measured compiled.
        quiet: No log lines. progress: Show Optuna's progress bar.
        dtypes: Low dtypes to search: ``"auto"`` keeps those whose matmul the probe measured
            faster than fp32 on this device; a list (or comma-separated string) forces them.
        traj_steps: K, the optimizer steps of the ``traj_rel`` check on finalists that lower
            anything (budget: torch.autocast's ``traj_rel`` over the same steps).
        report: Write the markdown report and plots beside ``out``.
        max_memory: Memory budget for the chosen policy's ``peak_bytes`` (DESIGN §5): ``None``
            (none), ``"auto"`` (torch.autocast's peak measured in this run: with ``compile``, that
            of torch.autocast + torch.compile), ``"<r>x"`` (r times FP32 eager's peak), or bytes
            (a number, or a string with a ``KiB``/``MiB``/``GiB`` suffix). With ``compile``, a
            finalist over it gets an ``activation_memory_budget`` that fits, aimed 10% under the
            memory budget (Inductor recomputes the rest of the activations in backward; see
            ``_Selector._fit_memory``); without compile, trials whose measured peak is over it are
            not selected.

    Returns:
        :class:`TuneResult`.

    Raises:
        ModelSpecError: the model file is invalid (nothing is written).
        CaptureError: the model cannot be captured (nothing is written).
        SearchError: bad ``max_drift``, ``max_memory`` or ``dtypes``; no policy met the budgets.
    """
    budget_arg = _parse_budget(max_drift)
    memory_arg = parse_max_memory(max_memory)
    forced = _parse_dtypes(dtypes)
    spec = load_model_spec(model_path)
    dev = resolve_device(device)
    clock = _Clock()
    with clock("capture_s"):
        harness = Harness(spec, dev)
    gm = harness.graph_module
    _log(f"captured {spec.path}: {len(gm.graph.nodes)} nodes, {harness.tokens} tokens/batch, "
         f"device {device_name(dev)}", quiet)
    with clock("probe_s"):
        probes = probe_dtypes(dev)
    for p in probes.values():
        if forced is not None and p.dtype != "fp32":
            verdict = " -> searched (--dtypes)" if p.dtype in forced else " -> not searched (--dtypes)"
        else:
            verdict = "" if p.usable else f" -> excluded: {p.reason}"
        _log(f"probe {p.dtype}: matmul {p.seconds * 1e3:.2f} ms ({p.speedup:.2f}x fp32){verdict}", quiet)
    usable = forced if forced is not None else [d for d, p in probes.items() if p.usable and d != "fp32"]
    lows = sorted(usable, key=lambda d: probes[d].seconds)
    blocks = find_blocks(gm)
    space = SearchSpace(lows, blocks, outside_matmuls(gm, blocks))
    ac_dtype = _autocast_default(dev, lows)
    storage = storage or default_storage(out)
    study_name = study_name or _default_name(spec.path, gm, dev, space)
    _precheck_study(storage, study_name, space)  # a study this run cannot resume fails now

    with clock("baselines_s"):
        # The baselines are what users run without autoprec: their own module, eager.
        fp32 = harness.measure(harness.model)
        slow = max(SLOW_RATIO * fp32.step_s, SLOW_FLOOR_S)
        autocast = harness.measure(harness.model, autocast_scaler(ac_dtype), autocast_dtype=ac_dtype,
                                   max_step_s=slow)
    budget = autocast.grad_rel_l2 if budget_arg is None else budget_arg
    if not math.isfinite(budget):
        raise SearchError(f"drift budget is not finite (torch.autocast: {autocast.error}); pass --max-drift X")
    if memory_arg is not None and memory_arg[0] != "autocast":  # known now: fail before the trials
        _memory_budget(memory_arg, fp32, autocast, harness.state_bytes)
    _log(f"fp32 eager {fp32.tokens_per_s:.0f} tok/s; autocast({ac_dtype}) eager {autocast.tokens_per_s:.0f} tok/s"
         f"{' (' + (autocast.error or autocast.note) + ')' if autocast.error or autocast.note else ''}, grad_rel_l2 {autocast.grad_rel_l2:.3g} "
         f"-> drift budget {budget:.3g}; {space.n_params} search parameters", quiet)

    study = open_study(storage, study_name, seed)
    _check_study(study, storage, space)
    study.set_user_attr(_A + "drift_budget", budget)
    if not study.trials:  # a new study: rank regions, then queue the baselines (resumes skip this)
        with clock("sensitivity_s"):
            sens = region_sensitivity(harness, space)
        if sens:
            study.set_user_attr(_A + "sensitivity", sens)
            _log("sensitivity (grad_rel_l2 with only that region lowered): "
                 + ", ".join(f"{k} {v:.2g}" for k, v in sorted(sens.items(), key=lambda kv: -kv[1])), quiet)
        _enqueue_baselines(study, space, sens)
    target = trials if trials is not None else 20
    if not space.low_dtypes and target > 1:  # every parameter's only float choice is fp32
        _log(f"no low dtype is searched (none measured faster than fp32 here), so every policy is all-fp32: "
             f"1 trial instead of {target} (--dtypes bf16,fp16 searches them anyway)", quiet)
        target = 1
    objective = Objective(harness, space, budget, max_step_s=slow)
    with clock("trials_s"):
        _optimize(study, objective, target, timeout, progress and not quiet)
    sel = _Selector(harness, budget, compile, ac_dtype, slow, traj_steps, clock, quiet)
    with clock("finalists_s"):
        chosen, chosen_m = sel.choose(_feasible(study), finalists, lambda: _memory_budget(
            memory_arg, fp32, sel.autocast_compiled if _ok(sel.autocast_compiled) else autocast, harness.state_bytes))
    with clock("baselines_s"):  # fp32 again, after the finalists: ratios rest on both runs' steps
        fp32 = _pooled(fp32, harness.measure(harness.model), harness.tokens)
    timings = clock.done()

    ref = sel.autocast_compiled or autocast
    measured = {
        "tokens_per_s": chosen_m.tokens_per_s, "speedup_vs_fp32": chosen_m.tokens_per_s / fp32.tokens_per_s,
        "speedup_vs_autocast": chosen_m.tokens_per_s / ref.tokens_per_s if ref.tokens_per_s else 0.0,
        "grad_rel_l2": chosen_m.grad_rel_l2, "loss_rel": chosen_m.loss_rel,
        "traj_rel": sel.traj.get(id(chosen), 0.0), "peak_bytes": chosen_m.peak_bytes,
        "drift_budget": budget,
        # left out when torch.autocast itself overflowed (a policy file holds finite numbers only)
        **({"autocast_grad_rel_l2": autocast.grad_rel_l2} if math.isfinite(autocast.grad_rel_l2) else {}),
        **({"memory_budget_bytes": sel.memory_budget} if sel.memory_budget is not None else {}),
    }
    policy = chosen.with_measured(measured).with_provenance(
        model=str(spec.path), graph_fingerprint=graph_fingerprint(gm), device=device_name(dev),
        torch=torch.__version__, autoprec=__version__, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        study=study.study_name, compiled=compile,
    )
    table = [_row("fp32 eager", fp32, fp32), _row(f"autocast {_short(ac_dtype)} eager", autocast, fp32)]
    if sel.autocast_compiled is not None:
        table.append(_row(f"autocast {_short(ac_dtype)} + compile", sel.autocast_compiled, fp32))
    table.append(_row("autoprec policy" + (" + compile" if compile else " (eager)"), chosen_m, fp32))
    eager = max([(sel.eager_tokens_per_s.get(id(chosen)) or 0.0, "this policy eager"),
                 (fp32.tokens_per_s, "fp32 eager")])
    if compile and eager[0] > 1.1 * chosen_m.tokens_per_s and chosen.activation_memory_budget >= 1.0:
        _log(f"note: {eager[1]} ran faster ({eager[0]:.0f} tok/s) than this policy compiled "
             f"({chosen_m.tokens_per_s:.0f}); for this model consider tuning and training without compile "
             "(autoprec tune/train --no-compile)", quiet)
    if report:  # before the policy: Ctrl-C while writing the report leaves no policy file
        from autoprec.report import write_report

        check_interrupt()
        paths = write_report(study, Path(out).with_suffix(""), table=table, policy=policy, gm=gm, timings=timings)
        _log("report: " + ", ".join(str(p) for p in paths), quiet)
    check_interrupt()  # never write a policy after Ctrl-C, even one Python swallowed
    policy.save(out)  # atomic; the last file written
    return TuneResult(policy, study, table, timings, {k: vars(v) for k, v in probes.items()})


def _pooled(a: Measurement, b: Measurement, tokens: int) -> Measurement:
    """``a`` with ``b``'s step times added (median over both runs): one noisy run moves it less."""
    if b.error is not None or not b.step_times:
        return a
    a.step_times = a.step_times + b.step_times
    a.step_s = statistics.median(a.step_times)
    a.tokens_per_s = tokens / a.step_s
    return a


def _ok(m: Measurement | None) -> bool:
    return m is not None and m.error is None


def _short(dt: torch.dtype) -> str:
    return NAMES.get(dt, str(dt))


def _autocast_default(dev: torch.device, lows: list[str]) -> torch.dtype:
    """torch.autocast's own default low dtype (PyTorch AMP docs: bfloat16 on CPU, float16 on
    CUDA), unless the probe left it out and another low dtype is usable."""
    default = torch.get_autocast_dtype(dev.type)
    if lows and NAMES.get(default) not in lows:
        return to_torch(lows[0])
    return default


class _Clock:
    """Accumulates wall-clock seconds per phase."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.times: dict[str, float] = {}

    def __call__(self, name: str):
        import contextlib

        @contextlib.contextmanager
        def cm():
            t = time.perf_counter()
            try:
                yield
            finally:
                self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t
        return cm()

    def done(self) -> dict[str, float]:
        return {**self.times, "total_s": time.perf_counter() - self.t0}


def _parse_dtypes(dtypes: str | list[str]) -> list[str] | None:
    if dtypes == "auto":
        return None
    names = [d.strip() for d in (dtypes.split(",") if isinstance(dtypes, str) else dtypes) if d.strip()]
    bad = [d for d in names if d not in LOW_DTYPES]
    if bad or not names:
        raise SearchError(f"--dtypes: {', '.join(bad) or 'empty'} not valid; expected 'auto' or some of "
                          f"{', '.join(LOW_DTYPES)}")
    return names


_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_max_memory(max_memory: str | float | None) -> tuple[str, float] | None:
    """Parse ``--max-memory``: ``None``/``"none"`` -> None; ``"auto"`` -> ``("autocast", 1.0)``;
    ``"0.8x"`` -> ``("fp32", 0.8)``; ``"300MiB"``, ``"2GiB"``, ``"5e8"`` or a number -> ``("bytes", n)``.

    Raises:
        SearchError: anything else, or a non-positive value (the message lists the accepted forms).
    """
    if max_memory is None or max_memory == "none":
        return None
    if max_memory == "auto":
        return ("autocast", 1.0)
    text = str(max_memory).strip().lower().replace(" ", "")
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)(x|[kmg]i?b|b)?", text)
    if m is not None:
        value, unit = float(m.group(1)), m.group(2) or ""
        scaled = value if unit == "x" else value * _UNITS[unit]
        if value > 0 and math.isfinite(scaled) and scaled < 2.0**62:
            return ("fp32", value) if unit == "x" else ("bytes", scaled)
    raise SearchError(f"--max-memory: expected 'auto', 'none', a multiple of FP32's peak like '0.8x', or bytes "
                      f"like '300MiB', '2GiB' or '5e8'; got {max_memory!r}")


def _bytes(n: float) -> str:
    """``n`` bytes for messages: MiB when large, else the exact count."""
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n:.0f} bytes"


def _memory_budget(arg: tuple[str, float] | None, fp32: Measurement, autocast: Measurement,
                   state_bytes: int) -> float | None:
    """Bytes allowed by the parsed ``--max-memory`` given this run's baselines.

    Raises:
        SearchError: the reference peak was not measured, or the budget is not above the fp32
            parameter, gradient and optimizer state (``state_bytes``), which no policy can go below.
    """
    if arg is None:
        return None
    kind, value = arg
    if kind == "bytes":
        budget = value
    else:
        ref = autocast if kind == "autocast" else fp32
        if ref.error is not None or ref.peak_bytes <= 0:
            name = "torch.autocast" if kind == "autocast" else "FP32"
            raise SearchError(f"--max-memory: {name}'s peak memory could not be measured ({ref.error}); "
                              "pass a number of bytes instead")
        budget = value * ref.peak_bytes
    if budget <= state_bytes:
        raise SearchError(f"--max-memory: the budget ({_bytes(budget)}) is not above the fp32 parameters, gradients "
                          f"and AdamW state alone ({_bytes(state_bytes)}, 16 bytes per parameter), which every "
                          "policy keeps (master weights, DESIGN §7)")
    return budget


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


def _default_name(path, gm, dev, space: SearchSpace) -> str:
    # The measurement version and the searched dtypes are part of the name: after an upgrade
    # that changes measurements, or with other --dtypes, the same command starts a new study
    # beside the old one instead of failing on it (see _check_study).
    return (f"autoprec-{Path(str(path)).stem}-{graph_fingerprint(gm)[:8]}-{dev.type}-"
            f"{'-'.join(space.dtypes)}-m{MEASURE_VERSION}")


def _precheck_study(storage: str, study_name: str, space: SearchSpace) -> None:
    """:func:`_check_study` on an existing study before the baselines are measured (minutes on
    a model whose low dtype is emulated), reading only: a missing database or study passes.

    Raises:
        SearchError: as :func:`_check_study`.
    """
    path = sqlite_path(storage)
    if path is not None and not os.path.isfile(path):
        return
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if study_name not in {s.study_name for s in optuna.get_all_study_summaries(storage)}:
        return
    _check_study(optuna.load_study(study_name=study_name, storage=storage), storage, space, stamp=False)


def _check_study(study: optuna.Study, storage: str, space: SearchSpace, stamp: bool = True) -> None:
    """Stamp a new study with :data:`MEASURE_VERSION` and the search space; refuse to resume one
    whose trials were measured by another version (studies from before the stamp count as
    version 1) or sampled from another space (e.g. other ``--dtypes``: Optuna cannot change a
    parameter's choices within a study).

    Raises:
        SearchError: naming the study, the storage and what differs; the study is left as it is.
    """
    fix = ("Pass another --study-name (or --storage) to start a new study; the old one is left as it is.")
    where = f"study {study.study_name!r} in {storage}"
    have = study.user_attrs.get(_A + "measure_version", 1 if study.trials else MEASURE_VERSION)
    if have != MEASURE_VERSION:
        raise SearchError(
            f"{where} holds trials measured by another autoprec version (measurement version {have}, "
            f"this one {MEASURE_VERSION}); their numbers are not comparable, so it is not resumed. {fix}")
    old = study.user_attrs.get(_A + "space")
    if study.trials and old is None:  # unstamped: read the dtype choices off its trials
        dists = [t.distributions.get("matmul") for t in study.trials if "matmul" in t.distributions]
        old = {"dtypes": list(dists[0].choices)} if dists else None
    if old is not None and old["dtypes"] != space.dtypes:
        raise SearchError(
            f"{where} searched the dtypes {', '.join(old['dtypes'])}; this run searches "
            f"{', '.join(space.dtypes)} (--dtypes, or what the probe measured as faster than fp32), "
            f"so it cannot resume it. {fix}")
    if stamp:
        study.set_user_attr(_A + "space", {"dtypes": space.dtypes})
        study.set_user_attr(_A + "measure_version", MEASURE_VERSION)


def open_study(storage: str, study_name: str, seed: int = 0) -> optuna.Study:
    """Create or load (resume) the multi-objective study ``study_name`` in ``storage``.

    Trials left RUNNING by a killed worker of this host (its process is gone) are marked FAIL,
    so a resumed run neither waits for nor counts them.
    """
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=6, multivariate=True, group=True)
    for attempt in range(6):
        try:
            study = optuna.create_study(storage=storage, study_name=study_name, directions=list(DIRECTIONS),
                                        sampler=sampler, load_if_exists=True)
            break
        except Exception as e:  # workers creating one new RDB schema at the same moment race
            if attempt == 5 or "IntegrityError" not in type(e).__name__ + repr(e):
                raise
            time.sleep(0.2 * (attempt + 1))
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        if is_dead_worker(t):
            study._storage.set_trial_user_attr(t._trial_id, _A + "interrupted", True)
            study._storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL)
    return study


def region_sensitivity(harness: Harness, space: SearchSpace) -> dict[str, float]:
    """``grad_rel_l2`` when only one region (a layer block's matmuls, or one outside matmul) is
    lowered to the fastest low dtype and everything else stays fp32: one eager forward/backward
    per region. Empty when no low dtype is usable."""
    if not space.low_dtypes:
        return {}
    low = space.low_dtypes[0]
    base = {"matmul": "fp32", "sensitive": "fp32", "follow": "auto"}
    base |= {f"block:{b}": "inherit" for b in space.blocks} | {f"node:{k}": "inherit" for k in space.nodes}
    out = {}
    for name in [f"block:{b}" for b in space.blocks] + [f"node:{k}" for k in space.nodes]:
        pol = space.to_policy(base | {name: low})
        try:
            gm = run_pipeline(harness.graph_module, pol).graph_module
            g = harness.drift(gm, make_scaler(pol)).grad_rel_l2
        except Exception:  # a region that cannot be lowered is maximally sensitive
            g = math.inf
        out[name] = g if math.isfinite(g) else 1e30
    return out


def _enqueue_baselines(study: optuna.Study, space: SearchSpace, sensitivity: dict[str, float] | None = None) -> None:
    """Queue the baselines, plus "autocast-equivalent with the most sensitive region in fp32"."""
    for _name, params in space.baselines():
        study.enqueue_trial(params, skip_if_exists=True)
    if sensitivity and len(space.baselines()) > 1:
        worst = max(sensitivity, key=sensitivity.get)
        study.enqueue_trial(space.baselines()[1][1] | {worst: "fp32"}, skip_if_exists=True)


def _finished(study: optuna.Study) -> int:
    """Trials that count towards ``--trials``: complete, pruned, or failed by their measurement
    (non-finite drift, a lowering error); not those cut short by Ctrl-C or a killed worker."""
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL, optuna.trial.TrialState.PRUNED)
    return sum(not t.user_attrs.get(_A + "interrupted") for t in study.get_trials(deepcopy=False, states=states))


def _optimize(study: optuna.Study, objective: Objective, target: int, timeout: float | None, progress: bool) -> None:
    """Run trials until the study holds ``target`` finished ones (shared with other workers)."""
    t_end = None if timeout is None else time.monotonic() + timeout

    def stop(study: optuna.Study, _trial) -> None:
        if _finished(study) >= target:
            study.stop()

    for _ in range(target + 1):
        remaining = target - _finished(study)
        left = None if t_end is None else t_end - time.monotonic()
        if remaining <= 0 or (left is not None and left <= 0):
            break
        try:
            # check: a Ctrl-C swallowed during the trial (see autoprec._interrupt) stops here
            study.optimize(objective, n_trials=remaining, timeout=left, show_progress_bar=progress,
                           catch=(Exception,), callbacks=[stop, lambda _study, _trial: check_interrupt()])
            break
        except ValueError as e:
            # SQLite has no row locks: two workers can pop the same queued trial, and the second
            # to finish cannot tell it. Its result is the same graph; carry on with the rest.
            if "Cannot tell a" not in str(e):
                raise
    # Another worker may still be measuring: wait (bounded) so every worker selects from the same trials.
    deadline = time.time() + 600
    while time.time() < deadline and any(
            not is_dead_worker(t) for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))):
        time.sleep(1.0)


def _feasible(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    ok = [t for t in done if t.user_attrs.get(_A + "constraint", 1e30) <= 0]
    seen, out = set(), []
    for t in sorted(ok, key=lambda t: (-t.values[0], t.number)):
        fp = t.user_attrs.get(_A + "fingerprint")
        if fp not in seen:
            seen.add(fp)
            out.append(t)
    return out


class _Selector:
    """Re-measures the fastest feasible trials as training will run them and picks one."""

    def __init__(self, harness, budget, compile, ac_dtype, slow, traj_steps, clock, quiet) -> None:
        self.h, self.budget, self.compile, self.ac_dtype = harness, budget, compile, ac_dtype
        self.slow, self.traj_steps, self.clock, self.quiet = slow, traj_steps, clock, quiet
        self.autocast_compiled: Measurement | None = None
        self.memory_budget: float | None = None
        self.traj: dict[int, float] = {}
        self.eager_tokens_per_s: dict[int, float] = {}
        self._ref_trajs: dict[int, tuple[list[float], float]] = {}  # id(reference fn) -> (losses, budget)
        self._traj_budget: float | None = None  # of the last check (for messages)
        self._autocast_fn = None  # torch.autocast's module as compiled for its baseline

    def _fn(self, gm, activation_memory_budget: float = 1.0):
        if not self.compile:
            return gm
        with self.clock("compile_s"):
            return compile_graph(gm, activation_memory_budget)

    def choose(self, feasible: list[optuna.trial.FrozenTrial], k: int,
               memory_budget: Callable[[], float | None] = lambda: None) -> tuple[Policy, Measurement]:
        """The fastest finalist within the drift (and memory) budgets, with its measurement.

        ``memory_budget`` is called once the torch.autocast baselines are measured (``--max-memory
        auto`` refers to them) and gives the byte budget or None.
        """
        if not feasible:
            raise SearchError("no trial met the drift budget, not even all-fp32 (see the study's "
                              "autoprec:error attributes)")
        if self.compile:  # the comparison users care about: torch.autocast + torch.compile, same run
            _log("compiling the torch.autocast baseline with Inductor", self.quiet)
            self._autocast_fn = self._fn(self.h.model)
            self.autocast_compiled = self.h.measure(self._autocast_fn, autocast_scaler(self.ac_dtype),
                                                    autocast_dtype=self.ac_dtype,
                                                    max_step_s=self.slow)
        self.memory_budget = memory_budget()
        if self.memory_budget is not None:
            _log(f"memory budget {_bytes(self.memory_budget)}", self.quiet)
        if not self.compile:
            return self._choose_eager(feasible)
        best: tuple[Policy, Measurement] | None = None
        for pol, label in self._candidates(feasible, k):
            check_interrupt()
            _log(f"finalist {label}: {pol.summary()}", self.quiet)
            fn = self._fn(run_pipeline(self.h.graph_module, pol).graph_module)
            m = self.h.measure(fn, lambda pol=pol: make_scaler(pol), max_step_s=self.slow)
            if (self.memory_budget is not None and m.error is None and m.grad_rel_l2 <= self.budget
                    and m.peak_bytes > self.memory_budget):
                pol, fn, m = self._fit_memory(pol, m)
            why = self._reject_reason(pol, fn, m)
            _log(f"  {'compiled' if self.compile else 'eager'}: {m.tokens_per_s:.0f} tok/s, grad_rel_l2 "
                 f"{m.grad_rel_l2:.3g}, traj_rel {self.traj.get(id(pol), 0.0):.3g}"
                 + (f" -> rejected: {why}" if why else ""), self.quiet)
            if why is None and (best is None or m.tokens_per_s > best[1].tokens_per_s):
                best = (pol, m)
        if best is None:
            raise SearchError("every finalist failed when re-measured, all-fp32 included (see the log)")
        return best

    def _choose_eager(self, feasible: list[optuna.trial.FrozenTrial]) -> tuple[Policy, Measurement]:
        """Without compile the trials' own measurements are what training runs: take the fastest
        feasible trial that passes the trajectory check, then re-measure it for the policy's
        ``measured`` block, beside all-fp32 when it lowers anything (:meth:`_or_fp32`). As with
        compiled finalists, that last comparison is a fresh measurement, so workers sharing a
        study can write different (each feasible) policies when the two are within noise."""
        if self.memory_budget is not None:
            fits = [t for t in feasible if t.values[2] <= self.memory_budget]
            if not fits:
                raise SearchError(f"no feasible trial fits the memory budget ({_bytes(self.memory_budget)}; the "
                                  f"smallest peak was {min(t.values[2] for t in feasible) / 2**20:.1f} MiB); "
                                  "without --no-compile, recomputation in backward can lower the peak")
            feasible = fits
        for t in feasible:
            pol = Policy.from_dict(t.user_attrs[_A + "policy"])
            fn = run_pipeline(self.h.graph_module, pol).graph_module
            if not self._traj_ok(pol, fn):
                _log(f"trial {t.number} ({pol.summary()}) rejected: traj_rel {self.traj[id(pol)]:.3g} > "
                     f"torch.autocast's {self._traj_budget:.3g}", self.quiet)
                continue
            m = self.h.measure(fn, lambda pol=pol: make_scaler(pol), max_step_s=self.slow)
            if m.error is None and (self.memory_budget is None or m.peak_bytes <= self.memory_budget):
                return self._or_fp32(t.number, pol, m)
        raise SearchError("no feasible trial passed the trajectory check"
                          + ("" if self.memory_budget is None else " and the memory budget"))

    def _or_fp32(self, number: int, pol: Policy, m: Measurement) -> tuple[Policy, Measurement]:
        """``pol`` unless all-fp32, re-measured beside it, is faster (and fits the memory budget):
        one screening measurement can flatter a trial, so a lowered policy must beat FP32
        measured the same way to be chosen, as the compiled finalists must."""
        if not (pol.dtypes_used() - {"fp32"}):
            return pol, m
        fp32 = Policy.fp32()
        f = self.h.measure(run_pipeline(self.h.graph_module, fp32).graph_module, max_step_s=self.slow)
        if f.error is None and f.tokens_per_s > m.tokens_per_s and (
                self.memory_budget is None or f.peak_bytes <= self.memory_budget):
            _log(f"trial {number} ({pol.summary()}) re-measured {m.tokens_per_s:.0f} tok/s, all-fp32 "
                 f"{f.tokens_per_s:.0f} tok/s: all-fp32 chosen", self.quiet)
            return fp32, f
        return pol, m

    def _candidates(self, feasible: list[optuna.trial.FrozenTrial], k: int) -> list[tuple[Policy, str]]:
        """The k fastest feasible trials, plus all-fp32 so that a lowered policy must beat FP32
        measured the same way (compiled or not) to be chosen."""
        out = []
        for t in feasible[:k]:
            pol = Policy.from_dict(t.user_attrs[_A + "policy"])
            self.eager_tokens_per_s[id(pol)] = t.values[0]
            out.append((pol, f"trial {t.number} (eager {t.values[0]:.0f} tok/s)"))
        if all(p.dtypes_used() - {"fp32"} for p, _ in out):
            out.append((Policy.fp32(), "all-fp32 (always re-measured)"))
        return out

    def _fit_memory(self, pol: Policy, m: Measurement) -> tuple[Policy, Any, Measurement]:
        """Lower ``pol``'s ``activation_memory_budget`` until the compiled graph's peak fits.

        Saved activations scale about linearly with the partitioner's budget (its definition:
        torch/_functorch/config.py), so the first guess is proportional, the second a secant
        through the measured points, the third 0.0 (full recomputation); each aims 10% under
        the budget. On the CPU memory is counted on one forward/backward (compile included) and
        only the budget that fits is timed; on CUDA each try is timed (its peak is read then).

        Returns:
            The policy, callable and measurement to judge: still over the budget when even full
            recomputation does not fit, with ``error`` set when the budget is below the fp32
            parameter, gradient and optimizer state alone.
        """
        state = self.h.state_bytes
        room = self.memory_budget - state
        if room <= 0:
            m.error = (f"peak {m.peak_bytes / 2**20:.1f} MiB > memory budget {self.memory_budget / 2**20:.1f} MiB, "
                       f"which is below the fp32 parameter, gradient and optimizer state alone ({state / 2**20:.1f} MiB)")
            return pol, None, m
        points = [(pol.activation_memory_budget, m.peak_bytes - state)]
        for attempt in range(3):
            (b1, a1), (b0, a0) = points[-1], points[-2] if len(points) > 1 else (0.0, 0.0)
            slope = (a1 - a0) / (b1 - b0) if (a1 - a0) * (b1 - b0) > 0 else a1 / max(b1, 1e-9)
            b = 0.0 if attempt == 2 else max(0.0, math.floor(100 * (b1 - (a1 - 0.9 * room) / slope)) / 100)
            cand = dataclasses.replace(pol, activation_memory_budget=b)
            # a fresh graph per budget: Dynamo caches compiled code per graph, not per config
            fn = self._fn(run_pipeline(self.h.graph_module, cand).graph_module, b)
            # CUDA's peak (max_memory_allocated) is read after timed steps; the CPU's count needs none
            probe = self.h.measure(fn, lambda cand=cand: make_scaler(cand), timing=self.h.device.type == "cuda",
                                   max_step_s=self.slow)
            _log(f"  peak {points[-1][1] / 2**20 + state / 2**20:.1f} MiB > memory budget "
                 f"{self.memory_budget / 2**20:.1f} MiB: activation memory budget {b:g} -> "
                 f"{probe.peak_bytes / 2**20:.1f} MiB", self.quiet)
            if probe.error is not None or probe.peak_bytes <= self.memory_budget or b == 0.0:
                break
            points.append((b, probe.peak_bytes - state))
        if probe.error is not None or probe.peak_bytes > self.memory_budget or probe.step_times:
            return cand, fn, probe
        return cand, fn, self.h.measure(fn, lambda cand=cand: make_scaler(cand), max_step_s=self.slow)

    def _reject_reason(self, pol: Policy, fn, m: Measurement) -> str | None:
        if m.error is not None:
            return m.error
        if m.grad_rel_l2 > self.budget:
            return f"grad_rel_l2 {m.grad_rel_l2:.3g} > budget {self.budget:.3g}"
        if self.memory_budget is not None and m.peak_bytes > self.memory_budget:
            return (f"peak {m.peak_bytes / 2**20:.1f} MiB > memory budget {self.memory_budget / 2**20:.1f} MiB"
                    + (" even with full recomputation" if self.compile else ""))
        if not self._traj_ok(pol, fn):
            return f"traj_rel {self.traj[id(pol)]:.3g} > torch.autocast's {self._traj_budget:.3g}"
        return None

    def _traj_ok(self, pol: Policy, fn) -> bool:
        """``traj_rel`` ≤ torch.autocast's over the same K steps; policies that lower nothing
        compute what FP32 computes and skip the check.

        The reference is :meth:`Harness.reference_fn`'s: the eager FP32 graph, or, for a compiled
        ``fn`` on a graph that draws random numbers (dropout), the compiled FP32 graph, whose
        masks are the compiled candidate's; torch.autocast's budget is then taken compiled too.
        """
        if not (pol.dtypes_used() - {"fp32"}) or self.traj_steps <= 0:
            return True
        ref_fn = self.h.reference_fn(fn)
        if id(ref_fn) not in self._ref_trajs:
            ref = self.h.trajectory(ref_fn, steps=self.traj_steps)
            ac_fn = self.h.model
            if ref_fn is not self.h.graph_module:  # compiled: torch.autocast as compiled for its baseline
                ac_fn = self._autocast_fn if self._autocast_fn is not None else self._fn(self.h.model)
            ac = self.h.trajectory(ac_fn, autocast_scaler(self.ac_dtype), autocast_dtype=self.ac_dtype,
                                   steps=self.traj_steps)
            self._ref_trajs[id(ref_fn)] = (ref, traj_rel(ac, ref))
        ref, self._traj_budget = self._ref_trajs[id(ref_fn)]
        tr = traj_rel(self.h.trajectory(fn, lambda: make_scaler(pol), steps=self.traj_steps), ref)
        self.traj[id(pol)] = tr
        return tr <= max(self._traj_budget, 1e-12)
