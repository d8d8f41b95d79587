"""Convergence check: a policy's loss curve against FP32 and ``torch.autocast`` (``autoprec train
--compare``).

Every configuration starts from the same initial weights (one ``build_model()`` state dict loaded into
each fresh model), sees the same batches (``get_batch(step)``) and the same global RNG seed, and uses
the model file's optimizer. The configurations:

Where the policy has ``batching`` (``tune --global-batch``), every configuration trains at its
micro-batch x accumulation, on the same global batches (as ``autoprec train`` runs the policy):

* ``policy``: the policy file applied with :func:`autoprec.apply` (compiled unless ``compile=False``),
  with a :class:`DynamicLossScaler` when the policy uses fp16;
* ``fp32``: the unmodified model, eager, fp32 (the reference; always run);
* ``autocast``: the unmodified model under ``torch.autocast(device,
  dtype=autoprec.device.autocast_dtype(device))`` (torch's default: bf16 on CPU, fp16 on CUDA; fp16 gets a
  loss scaler), eager: standard AMP.

For each curve the maximum relative deviation from the FP32 curve, ``max_k |L_k − L32_k| / |L32_k|``
(docs/architecture.md#measurements ``traj_rel``), and the final held-out loss (mean over ``heldout_batches``
batches of ``get_heldout_batch(j)``, or of ``get_batch(10**6 + j)`` when the model file has none, evaluated
under ``torch.no_grad`` in the configuration's own precision, in training mode: the policy's graph is
the training graph, so dropout stays on, drawing the same masks in every configuration from ``seed``,
:func:`~autoprec.training.rng.same_rng`) are reported, and written with the curves
to ``convergence.json`` and ``convergence.png`` (matplotlib, Agg backend).

On a CPU without native bf16 torch.autocast's bf16 GEMMs run ~60x slower than fp32's (AVX2 only;
``benchmarks/results/avx2_autocast_2026-12-05``): when its first timed step takes
:data:`~autoprec.search.autocast_baseline.EMULATE_AT` times fp32's median step or more, its later steps
compute those GEMMs as fp32 products rounded once to its dtype (:class:`Fp32ComputeGemms`, the
roundings of a native kernel), so its curve keeps torch.autocast's numerics at near fp32's speed
(1.6x fp32's step on ``examples/qwen2_tiny.py``, against 23x natively); its ``seconds_per_step`` is
its native step 1's and ``notes["autocast"]`` says so. A run can still
be long, so progress is kept in ``OUT_DIR/compare_state/``: each finished configuration's results go to
``results.json`` as soon as it ends, and with ``checkpoint_every=N`` the running one saves a checkpoint
(:func:`save_checkpoint`: weights, optimizer, scaler, RNG, losses so far) every N steps. ``resume=True``
(``autoprec train --compare … --resume``) re-runs nothing that is saved there; it refuses a state
written for another model file, policy, step count, seed, device or torch version. On CPU, eager
configurations resume bit-identically. The state directory is removed once ``convergence.json`` is
written.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from autoprec._io import atomic_write, json_safe
from autoprec.applied.apply import apply
from autoprec.capture import PROBE_BATCHES, capture_for
from autoprec.commands.compare_report import CompareResult, plot_curves, summary_table
from autoprec.device import autocast_dtype, describe_machine, resolve_device
from autoprec.errors import AutoprecError
from autoprec.kernels.fp32_gemms import Fp32ComputeGemms
from autoprec.metrics import median, traj_rel
from autoprec.modelspec import ModelSpec, call_model, load_model_spec
from autoprec.modelspec.micro_batches import first_batches, step_batches
from autoprec.policy import Policy
from autoprec.search.autocast_baseline import EMULATE_AT
from autoprec.training.checkpoint import load_checkpoint, save_checkpoint
from autoprec.training.rng import StepRng, same_rng
from autoprec.training.steps import every, run_steps
from autoprec.training.train import StepStats, TrainStep, autocast_scaler, make_scaler

__all__ = ["BASELINES", "CompareResult", "compare", "plot_curves", "summary_table"]

#: Baseline names accepted by ``--compare``.
BASELINES = ("fp32", "autocast")

#: Offset of the training-batch steps used as held-out data when the model file has no get_heldout_batch.
FAR_STEP = 10**6

#: Subdirectory of the output directory holding the progress of an unfinished run.
STATE_DIR = "compare_state"


def _heldout(spec: ModelSpec, j: int, dev: torch.device) -> Any:
    return spec.heldout_batch(j, dev) if spec.heldout_batch is not None else spec.get_batch(FAR_STEP + j, dev)


class _State:
    """Progress of one compare run under ``OUT_DIR/compare_state/`` (see the module docstring).

    ``key`` identifies the run (model file bytes, policy, steps, seed, device, compile, torch); a
    state written under another key is refused rather than mixed in or overwritten.
    """

    def __init__(self, out_dir: Path, key: dict[str, Any], resume: bool) -> None:
        self.dir = out_dir / STATE_DIR
        self.results = self.dir / "results.json"
        self.key = key
        self.done: dict[str, dict[str, Any]] = {}
        if not self.dir.exists():
            return
        if not resume:
            raise AutoprecError(f"{self.dir} holds an unfinished --compare run; pass --resume to continue "
                                "it, or remove that directory (or use another --out-dir) to start over")
        try:
            saved = json.loads(self.results.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise AutoprecError(f"{self.results}: unreadable compare state ({e}); remove {self.dir} "
                                "to start over") from e
        old = saved.get("key", {}) if isinstance(saved, dict) else {}
        diff = [k for k in sorted(set(key) | set(old)) if old.get(k) != key.get(k)]
        if diff:
            raise AutoprecError(f"{self.results}: saved for a different run ({', '.join(diff)} differ); "
                                f"remove {self.dir} or use another --out-dir")
        self.done = saved.get("done", {})

    def checkpoint(self, name: str) -> Path:
        """The running configuration's checkpoint file."""
        return self.dir / f"{name}.pt"

    def _write(self) -> None:
        payload = json.dumps(json_safe({"key": self.key, "done": self.done}), allow_nan=False)
        atomic_write(self.results, lambda f: f.write(payload + "\n"))

    def save(self, name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             scaler: Any, step: int, extra: dict[str, Any]) -> None:
        """Checkpoint the running configuration (the run's key is written first, so any saved
        state can be checked before it is resumed)."""
        if not self.results.exists():
            self._write()
        save_checkpoint(self.checkpoint(name), model, optimizer, scaler, step=step, extra=extra)

    def finish(self, name: str, result: dict[str, Any]) -> None:
        """Record a finished configuration (atomically) and drop its checkpoint."""
        self.done[name] = result
        self._write()
        self.checkpoint(name).unlink(missing_ok=True)

    def remove(self) -> None:
        """Delete the state once the results are written: checkpoints first and ``results.json``
        last, so a failure part-way leaves a state that ``resume`` still reads."""
        for f in self.dir.glob("*.pt"):
            f.unlink(missing_ok=True)
        self.results.unlink(missing_ok=True)
        shutil.rmtree(self.dir, ignore_errors=True)


def _run(name: str, spec: ModelSpec, init: dict[str, torch.Tensor], policy: Policy, steps: int,
         dev: torch.device, compile: bool, heldout_batches: int, seed: int,
         log: Callable[[int, str], None], state: _State | None = None,
         checkpoint_every: int = 0, fp32_step_s: float | None = None,
         max_grad_norm: float | None = None) -> dict[str, Any]:
    """Train one configuration; returns its losses, held-out loss, median s/step, skipped steps and
    a note (torch.autocast's GEMMs computed in fp32 from some step on: :func:`_emulate_from`, given
    ``fp32_step_s``, fp32's median seconds per step). ``max_grad_norm``: clip the unscaled
    gradients to this L2 norm, as ``autoprec train --max-grad-norm``.

    Every configuration trains at the policy's ``batching`` where it has one (micro-batch x
    accumulation of the same global batches, :func:`~autoprec.modelspec.micro_batches.step_batches`,
    as ``autoprec train`` runs the policy), else at the model file's batch.

    The steps run through :func:`autoprec.training.steps.run_steps` with the seeded-stream RNG rule
    (``StepRng(seed)``, :mod:`autoprec.training.rng`): the global generators are seeded with
    ``seed`` before step 0, so every configuration starts from the same RNG state. With ``state``,
    resumes from ``state.checkpoint(name)`` if it exists (weights, optimizer, scaler, RNG state,
    losses so far) and saves it every ``checkpoint_every`` steps (0: never).
    """
    model = spec.build_model().to(dev)
    model.load_state_dict(init)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    source = step_batches(spec, policy.batching, dev)  # every configuration at the policy's batching
    ac, scaler, module = None, None, model
    if name == "policy":  # captured from the first batches as train and tune do: the graph tune measured
        batches = first_batches(spec, source, dev, PROBE_BATCHES)
        module = apply(model, policy, batches[0], compile=compile, graph_module=capture_for(model, batches))
        scaler = make_scaler(policy)
    elif name == "autocast":
        ac = autocast_dtype(dev)
        scaler = autocast_scaler(ac)()
    optimizer = spec.make_optimizer(params)
    step = TrainStep(module, params, optimizer, spec.loss_fn, scaler=scaler, autocast_dtype=ac,
                     device_type=dev.type, max_grad_norm=max_grad_norm)
    run = {"losses": [], "times": [], "skipped": 0, "warm": [0]}  # warm: steps whose time includes compiling
    start = 0
    if state is not None and state.checkpoint(name).exists():
        ckpt = state.checkpoint(name)
        ck = load_checkpoint(ckpt, model, optimizer, scaler)  # also restores the RNG state
        start = ck.step
        run = {"losses": list(ck.extra["losses"]), "times": list(ck.extra["times"]),
               # the resumed process compiles again
               "skipped": ck.extra["skipped"], "warm": sorted(set(ck.extra.get("warm", [0])) | {start}),
               **{k: ck.extra.get(k) for k in ("fp32_gemms_from", "native_step_s")}}
        log(start, f"[{name}] resumed from {ckpt} at step {start}")

    def collect(k: int, _batch: Any, st: StepStats, seconds: float) -> None:
        run["times"].append(seconds)
        run["losses"].append(st.loss)
        run["skipped"] += int(st.skipped)
        log(k, f"[{name}] step {k:4d}  loss {st.loss:.4f}  {seconds:.2f}s")

    def decide(k: int, *_: Any) -> None:  # after step 1, before its checkpoint is saved
        if k == 1 and ac is not None and fp32_step_s is not None:
            run["fp32_gemms_from"] = _emulate_from(run, 2, fp32_step_s)

    hooks = [collect, decide]
    if state is not None:
        hooks.append(every(checkpoint_every, stop=steps,
                           fn=lambda done: state.save(name, model, optimizer, scaler, done, run)))
    batches = ((lambda k: source.step(k, dev)) if source is not None  # noqa: E731
               else (lambda k: spec.get_batch(k, dev)))
    rng = StepRng(seed)
    if ac is not None and start < 2:  # step 0 warms up; step 1 is timed natively, then decide()
        run_steps(step, batches, start, min(2, steps), rng=rng, device=dev, after=hooks)
        start = min(2, steps)
    gemms = run.get("fp32_gemms_from") is not None and start >= run["fp32_gemms_from"]
    if gemms:
        log(0, f"[{name}] {_gemm_note(run, fp32_step_s)}")  # always shown
    with Fp32ComputeGemms(ac) if gemms else contextlib.nullcontext():
        run_steps(step, batches, start, steps, rng=rng, device=dev, after=hooks)
        with torch.no_grad(), step._context(), same_rng(dev, seed):  # the same dropout masks in each
            held = [float(spec.loss_fn(call_model(module, b), b).float())
                    for b in (_heldout(spec, j, dev) for j in range(heldout_batches))]
    native = run["times"][:run["fp32_gemms_from"]] if run.get("fp32_gemms_from") is not None else run["times"]
    return {"losses": run["losses"], "heldout_loss": sum(held) / len(held), "skipped": run["skipped"],
            "seconds_per_step": median_step_seconds(native, set(run["warm"])),
            "note": _gemm_note(run, fp32_step_s) if run.get("fp32_gemms_from") is not None else None}


def _emulate_from(run: dict[str, Any], stop: int, fp32_step_s: float) -> int | None:
    """``stop`` (the step from which torch.autocast's GEMMs are computed as fp32 products) when its
    last native step, not a warm-up one (the last one when all were: a run resumed at step 1), took
    :data:`EMULATE_AT` x ``fp32_step_s`` or more (the GEMM probe's rule of ``tune``, here on whole
    steps, whose other ops cost what fp32's do); else None."""
    timed = [t for k, t in enumerate(run["times"]) if k not in set(run["warm"])] or run["times"][-1:]
    if not timed or not fp32_step_s > 0 or timed[-1] < EMULATE_AT * fp32_step_s:
        return None
    run["native_step_s"] = timed[-1]
    return stop


def _gemm_note(run: dict[str, Any], fp32_step_s: float | None) -> str:
    """The log's and ``convergence.json``'s words for a curve computed with fp32 GEMM products."""
    native = run.get("native_step_s", math.nan)
    ratio = f", {native / fp32_step_s:.3g}x fp32's" if fp32_step_s else ""
    return (f"steps {run['fp32_gemms_from']}+ compute torch.autocast's GEMMs as fp32 products rounded once "
            f"to its dtype (its native step 1 took {native:.3g} s{ratio}): the curve's numerics are "
            "torch.autocast's, its s/step that one native step's")


def median_step_seconds(times: list[float], warm: set[int]) -> float:
    """Median (:func:`autoprec.metrics.median`) of the per-step wall-clock ``times`` (seconds,
    index = step) leaving out the ``warm`` steps (step 0 and the first step after each resume:
    they include compilation); the median of all steps if nothing else is left."""
    return median([t for k, t in enumerate(times) if k not in warm] or times)


def _run_key(model_path: str | os.PathLike, policy: Policy, steps: int, seed: int, dev: torch.device,
             compile: bool, heldout_batches: int, max_grad_norm: float | None = None) -> dict[str, Any]:
    """What must match for a saved compare state to be resumed."""
    sha = hashlib.sha256(Path(model_path).read_bytes()).hexdigest()
    return {"model_sha256": sha, "policy_sha256": hashlib.sha256(policy.to_json().encode()).hexdigest(),
            "steps": steps, "seed": seed, "device": str(dev), "compile_policy": compile,
            "heldout_batches": heldout_batches, "torch": torch.__version__,
            **({"max_grad_norm": max_grad_norm} if max_grad_norm is not None else {})}


def _meta(model_path: str | os.PathLike, policy_path: str | os.PathLike, policy: Policy, spec: ModelSpec,
          steps: int, dev: torch.device, compile: bool, seed: int, heldout_batches: int) -> dict[str, Any]:
    """``convergence.json``'s ``meta``: the run's files, settings, machine and date."""
    return {
        "model": os.fspath(model_path), "policy_file": os.fspath(policy_path), "policy": policy.summary(),
        "steps": steps, "device": str(dev), "cpu": describe_machine(dev)["cpu"], "torch": torch.__version__,
        "compile_policy": compile, "seed": seed, "heldout_batches": heldout_batches,
        "heldout_source": ("get_heldout_batch" if spec.heldout_batch is not None
                           else f"get_batch({FAR_STEP}+j)"),
        "autocast_dtype": str(autocast_dtype(dev)).replace("torch.", ""),
        "batching": policy.batching.describe() if policy.batching is not None else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def compare(model_path: str | os.PathLike, policy_path: str | os.PathLike, steps: int,
            baselines: tuple[str, ...] | list[str] = BASELINES, device: str = "auto", compile: bool = True,
            out_dir: str | os.PathLike | None = None, heldout_batches: int = 4, seed: int = 0,
            quiet: bool = False, log_every: int = 10, checkpoint_every: int = 0,
            resume: bool = False, max_grad_norm: float | None = None) -> CompareResult:
    """Train the policy and the baselines from the same weights on the same batches; compare the curves.

    Args:
        model_path: Model file (docs/architecture.md#modelpy-contract). policy_path: Policy JSON file.
        steps: Optimizer steps per configuration.
        baselines: Any of :data:`BASELINES`; ``fp32`` is always run (it is the reference).
        device: ``auto``, ``cpu`` or ``cuda``. compile: Compile the policy's graph (baselines run eager).
        out_dir: Write ``convergence.json`` and ``convergence.png`` there (created), or None. While
            the run is unfinished its progress is kept in ``out_dir/compare_state/``.
        heldout_batches: Number of held-out batches averaged for the final held-out loss.
        seed: Global torch seed set before each configuration's first step.
        quiet: Print nothing. log_every: Print every n-th step's loss.
        checkpoint_every: Save the running configuration every N steps (0: only finished
            configurations are kept). Needs ``out_dir``.
        resume: Continue the unfinished run saved in ``out_dir/compare_state/``.
        max_grad_norm: Clip every configuration's unscaled gradients to this L2 norm (``train
            --max-grad-norm``; recorded in ``convergence.json``'s ``meta``), or None.

    Returns:
        A :class:`CompareResult`.

    Raises:
        ValueError: ``steps`` < 1, an unknown baseline name (lists the valid ones), or
            ``checkpoint_every``/``resume`` without ``out_dir``.
        AutoprecError: ``out_dir`` holds an unfinished run and ``resume`` is False, or a saved state
            of a different run (names the fields that differ).
        ModelSpecError / PolicyError / CaptureError / PassError: as for ``autoprec train``.
    """
    if steps < 1:
        raise ValueError(f"steps must be ≥ 1, got {steps}")
    unknown = [b for b in baselines if b not in BASELINES]
    if unknown:
        raise ValueError(f"unknown --compare baseline {unknown[0]!r}; valid: {', '.join(BASELINES)}")
    if out_dir is None and (checkpoint_every > 0 or resume):
        raise ValueError("checkpoint_every and resume need out_dir (the state is kept there)")
    policy = Policy.load(policy_path)
    spec = load_model_spec(model_path)
    dev = resolve_device(device)
    state = None if out_dir is None else _State(
        Path(out_dir), _run_key(spec.path, policy, steps, seed, dev, compile, heldout_batches, max_grad_norm),
        resume)
    init = {k: v.detach().clone() for k, v in spec.build_model().state_dict().items()}
    names = ["fp32", "policy"] + [b for b in BASELINES if b in baselines and b != "fp32"]
    res = CompareResult(meta=_meta(model_path, policy_path, policy, spec, steps, dev, compile, seed,
                                   heldout_batches) | {"max_grad_norm": max_grad_norm})

    def log(i: int, msg: str) -> None:
        if not quiet and (i % max(log_every, 1) == 0 or i == steps - 1):
            print(msg, flush=True)

    if policy.batching is not None:
        step_batches(spec, policy.batching, dev, policy_path)  # refused before any configuration trains
        log(0, f"training every configuration at {policy.batching.describe()} (the policy's batching)")
    for name in names:
        if state is not None and name in state.done:
            r = state.done[name]
            log(0, f"[{name}] finished in an earlier run: kept from {state.dir}")
        else:
            r = _run(name, spec, init, policy, steps, dev, compile, heldout_batches, seed, log, state,
                     checkpoint_every, fp32_step_s=res.seconds_per_step.get("fp32"),
                     max_grad_norm=max_grad_norm)
            if state is not None:
                state.finish(name, r)
        res.curves[name], res.heldout_loss[name] = [float(x) for x in r["losses"]], float(r["heldout_loss"])
        res.seconds_per_step[name], res.skipped[name] = float(r["seconds_per_step"]), int(r["skipped"])
        res.notes.update({name: r["note"]} if r.get("note") else {})
    for name in names:
        res.max_rel_dev[name] = traj_rel(res.curves[name], res.curves["fp32"])
    if out_dir is not None:
        out = Path(out_dir)
        payload = json.dumps(res.to_dict(), indent=1, allow_nan=False) + "\n"
        atomic_write(out / "convergence.json", lambda f: f.write(payload))
        plot_curves(res, out / "convergence.png")
        state.remove()
    return res
