"""``autoprec train``: train a model file with a policy, with monitoring and checkpoint/resume.

Batches are ``get_batch(step, device)`` for step = 0..steps-1, so a run resumed from a checkpoint at
step k sees exactly the batches the uninterrupted run sees from k on. The steps run through
:func:`autoprec.training.steps.run_steps` with the stream RNG rule (:mod:`autoprec.training.rng`):
each step draws from the global generators as the previous one left them, and a checkpoint saves
and restores that state, so a resumed run continues the same random stream.

A policy with ``batching`` (``tune --global-batch``) trains each optimizer step on its global batch as
``accumulation`` micro-batches (:mod:`autoprec.modelspec.micro_batches`: step k's global batch is built
from the model file and split along dimension 0); gradients accumulate in fp32 and the optimizer steps
once per global batch.

Under torchrun (``autoprec train --nproc N``, :mod:`autoprec.distributed`) each rank trains
the applied module under DDP on its own batches (rank r at step k: ``get_batch(k * N + r)``; with a
policy's batching, rank r's step k is the policy's whole global batch ``k * N + r``, so one optimizer
step covers N of them), every rank seeded with ``--seed`` (the same stream on every rank; a resume
restores rank 0's saved state on every rank). The numbers logged are the job's
(:class:`~autoprec.distributed.ranks.JobStep`): the loss is the mean over the ranks, tokens/s all the
ranks' tokens over the slowest rank's step seconds; only rank 0 prints, writes the monitor log and
saves checkpoints (every rank loads one on ``--resume``).

Without ``--resume`` a run starts at step 0, and an existing file at ``--checkpoint`` is refused
before anything is built (:func:`_refuse_existing`): the run would overwrite it at its first save.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from autoprec._torch_compat import compile_cache_counts
from autoprec.applied.apply import apply
from autoprec.applied.compile import cache_report, check_recompute
from autoprec.applied.policy_match import check_policy_file
from autoprec.capture import PROBE_BATCHES, capture_for
from autoprec.device import resolve_device
from autoprec.distributed.ranks import (
    JobStep,
    init_ranks,
    joined,
    rank_step_batch,
    ranks_from_env,
)
from autoprec.distributed.wrap import ddp
from autoprec.errors import AutoprecError
from autoprec.modelspec import load_model_spec
from autoprec.modelspec.micro_batches import (
    count_tokens,
    first_batches,
    one_micro_batch,
    step_batches,
)
from autoprec.policy import Policy
from autoprec.training.checkpoint import load_checkpoint, peek_checkpoint, save_checkpoint
from autoprec.training.monitor import Monitor
from autoprec.training.rng import StepRng
from autoprec.training.scaler import MAX_SKIPS_AT_FLOOR
from autoprec.training.steps import StepHook, every, run_steps
from autoprec.training.train import StepStats, TrainStep, make_scaler

_log = logging.getLogger("autoprec")

__all__ = ["TrainResult", "check_checkpoint", "train"]


@dataclass
class TrainResult:
    """Outcome of :func:`train`.

    Attributes:
        losses: Loss per step run in this call (fp32 floats; a skipped step's loss is still recorded).
        final_loss: Mean loss of the steps not skipped among the last ``min(FINAL_STEPS,
            len(losses))`` (NaN when no step ran or all of those were skipped): a step the loss
            scaler skips (an fp16 overflow it backs off from, GradScaler's rule) left the weights
            unchanged, and its non-finite loss is not the trained model's; a run whose last steps
            are all skipped has diverged or not yet found its scale.
        final_steps: How many steps ``final_loss`` is the mean of.
        tokens_per_s: Tokens/s over the steps after the first (which compiles): mean tokens per
            step / median step seconds (:func:`autoprec.training.monitor.tokens_per_s`); under
            ``--nproc N`` the whole job's, all N ranks' tokens over the slowest rank's step seconds.
        skipped: Steps skipped for non-finite gradients (in this call).
        loss_scale: Final loss scale (1.0 without a scaler).
        start_step: First step run (``> 0`` when resumed from a checkpoint).
        summary: :meth:`Monitor.summary` of the steps run.
        complete: The run was already complete: ``resume`` found a checkpoint at step ``steps`` or
            beyond, so no model was built and no step ran (``start_step`` is the checkpoint's step).
        nonfinite: With a non-finite final loss, where the last batch's forward first goes
            non-finite in the trained weights (``"first non-finite output on the last batch: node
            div#0 (from m.py:8 (forward): ...)"``), or that its outputs are finite; else empty.
    """

    losses: list[float] = field(default_factory=list)
    final_loss: float = math.nan
    final_steps: int = 0
    tokens_per_s: float = 0.0
    skipped: int = 0
    loss_scale: float = 1.0
    start_step: int = 0
    summary: dict[str, Any] = field(default_factory=dict)
    complete: bool = False
    nonfinite: str = ""


def train(model_path: str | os.PathLike, policy_path: str | os.PathLike, steps: int = 50,
          device: str = "auto", compile: bool = True, log_every: int = 1, quiet: bool = False,
          checkpoint: str | os.PathLike | None = None, resume: bool = False, checkpoint_every: int = 0,
          log_path: str | os.PathLike | None = None, max_grad_norm: float | None = None,
          force: bool = False, seed: int | None = 0) -> TrainResult:
    """Train the model of ``model_path`` up to ``steps`` optimizer steps under a policy file.

    The optimizer is the model file's ``make_optimizer`` (default AdamW) over the fp32 parameters
    (master weights). Every step is recorded by a :class:`Monitor` (JSONL at ``log_path`` if given);
    if the policy needs loss scaling, the scaler's floor error names the first non-finite node.

    Args:
        model_path: Model file (docs/architecture.md#modelpy-contract). policy_path: Policy JSON file.
        steps: Total optimizer steps of the run (a resumed run continues up to this number).
        device: ``auto``, ``cpu`` or ``cuda``. compile: ``torch.compile`` the lowered graph.
        log_every: Print every n-th step. quiet: Print nothing.
        checkpoint: Checkpoint file written at the end (and every ``checkpoint_every`` steps); without
            ``resume`` it must not exist yet (an existing run is never overwritten).
        resume: Continue from ``checkpoint`` if it exists (model, optimizer, scaler, step, RNG);
            start from step 0 if it does not. A checkpoint already at step ``steps`` or beyond is a
            finished run: one line says so and the result has ``complete=True`` (nothing written).
        checkpoint_every: Also save every this many steps (0: only at the end).
        log_path: JSONL file for the monitor (appended to; a resumed run first drops its lines of the
            steps after the checkpoint, which it redoes: one line per step).
        max_grad_norm: Clip unscaled gradients to this L2 norm.
        force: Train with a policy none of whose rules selects a node of this model (a policy of
            another model) instead of refusing it (:mod:`autoprec.applied.policy_match`).
        seed: Seed of torch's global generators before the model is built and before step 0 (the
            seeded stream of :mod:`autoprec.training.rng`; a resumed run keeps its checkpoint's
            state), so the same command trains the same numbers (a user's dropout model did not);
            None: the generators as the process found them.

    Raises:
        ModelSpecError: invalid model file. PolicyError: invalid policy file, or (without
            ``force``) none of its rules matches a node of this model.
        CaptureError / PassError: the policy cannot be applied to this model.
        AutoprecError: ``--resume`` with a checkpoint saved under a different policy or model, or
            a file that is not a checkpoint; without ``resume``, a file already at ``checkpoint``
            (raised before the model is built, naming the step it holds).
        LossScaleError: non-finite gradients persist at the scale floor (names the node).
        ValueError: ``steps`` < 1, or ``resume`` without ``checkpoint``.
    """
    if steps < 1:
        raise ValueError(f"steps must be ≥ 1, got {steps}")
    if resume and checkpoint is None:
        raise ValueError("resume=True needs a checkpoint path")
    policy = Policy.load(policy_path)
    ranks = ranks_from_env()
    done = check_checkpoint(checkpoint, resume, policy_path, policy, steps, quiet or not ranks.lead,
                            ranks.world)
    if done is not None:
        return done
    spec = load_model_spec(model_path)
    dev = init_ranks(resolve_device(device), ranks)
    with joined(ranks):  # a rank that fails leaves at once; torchrun stops the others
        return _train(spec, policy, policy_path, dev, ranks, steps, compile, log_every,
                      quiet or not ranks.lead, checkpoint, resume, checkpoint_every, log_path,
                      max_grad_norm, force, seed)


def _train(spec: Any, policy: Policy, policy_path: str | os.PathLike, dev: Any, ranks: Any, steps: int,
           compile: bool, log_every: int, quiet: bool, checkpoint: str | os.PathLike | None, resume: bool,
           checkpoint_every: int, log_path: str | os.PathLike | None,
           max_grad_norm: float | None, force: bool = False, seed: int | None = 0) -> TrainResult:
    """:func:`train` once the files are loaded and this rank's device is known."""
    if seed is not None:  # the initial weights of a model file that seeds nothing itself
        torch.manual_seed(seed)
    model = spec.build_model().to(dev)
    model.train()
    source = step_batches(spec, policy.batching, dev, policy_path)  # the policy's micro-batch x accumulation
    if not quiet:
        _print_header(policy, ranks.world)
    batches = first_batches(spec, source, dev, PROBE_BATCHES)
    first = batches[0]
    gm = capture_for(model, batches)
    why = check_policy_file(policy, policy_path, gm, str(spec.path), force)  # another model's: refused
    if ranks.lead and why:
        print(f"autoprec train: warning: {why}", file=sys.stderr, flush=True)
    if compile:  # refused by apply too; here the message names the policy file
        check_recompute(gm, policy.activation_memory_budget, source=policy_path)
    mp = apply(model, policy, first, compile=compile, graph_module=gm, force=True)
    module = ddp(mp, policy) if ranks.world > 1 else mp
    params = [p for p in model.parameters() if p.requires_grad]
    monitor: Monitor | None = None  # opened after the resume check: a refused resume writes nothing

    def diagnose() -> str | None:
        return monitor.diagnoser()() if monitor is not None else None

    diagnose.source_of = lambda key: monitor.source_of(key) if monitor is not None else None  # type: ignore

    optimizer = spec.make_optimizer(params)
    step = TrainStep(module, params, optimizer, spec.loss_fn, scaler=make_scaler(policy, diagnose),
                     device_type=dev.type, max_grad_norm=max_grad_norm, max_skips=MAX_SKIPS_AT_FLOOR,
                     diagnose=diagnose)
    start = _resume(checkpoint, policy_path, policy, step, model, steps, quiet, ranks.world) if resume else 0
    monitor = Monitor(log_path if ranks.lead else None, graph_module=mp.graph_module,
                      resume_from=start or None)  # resumed: the steps after the checkpoint are redone
    checkpoint = checkpoint if ranks.lead else None  # every rank resumed from it; rank 0 writes it

    def save(done: int) -> None:
        save_checkpoint(checkpoint, model, optimizer, step.scaler, policy, step=done,
                        extra={WORLD_SIZE: ranks.world})

    job = JobStep(ranks, functools.partial(count_tokens, spec.tokens_per_batch))  # every rank runs it
    hooks = [job, _recorder(monitor, job), _printer(steps, log_every, quiet, job)]
    if compile and not quiet:
        hooks.append(_first_step_cache(start, compile_cache_counts()))
    if checkpoint is not None:
        hooks.append(every(checkpoint_every, save, stop=steps))
    get_step = source.step if source is not None else spec.get_batch  # checked: CheckedGetBatch
    batches = rank_step_batch(get_step, dev, ranks) if ranks.world > 1 else (
        (lambda k: first if k == 0 else get_step(k, dev)) if source is None else
        (lambda k: source.step(k, dev)))
    try:
        done = run_steps(step, batches, start, steps, rng=StepRng(seed), device=dev,
                         before=lambda _k, batch: setattr(monitor, "last_batch", one_micro_batch(batch)),
                         after=hooks)
        if checkpoint is not None:
            save(max(steps, start))
    finally:
        monitor.close()
    return _result(done, start, step, monitor)


def check_checkpoint(checkpoint: str | os.PathLike | None, resume: bool, policy_path: str | os.PathLike,
                     policy: Policy, steps: int, quiet: bool, world: int = 1) -> TrainResult | None:
    """What :func:`train` checks of ``checkpoint`` before the model file is loaded, the one home of
    these checks (``autoprec train`` makes them before it validates the model file): without
    ``resume``, an existing file is refused (:func:`_refuse_existing`); with it, a checkpoint at
    step ``steps`` or beyond is a finished run, a no-op (:func:`_finished`, one line unless ``quiet``).

    Returns:
        The finished run's :class:`TrainResult` (``complete=True``), else None (train).

    Raises:
        AutoprecError: as :func:`_refuse_existing` and :func:`_finished`.
    """
    if checkpoint is None:
        return None
    if not resume:
        _refuse_existing(checkpoint)
        return None
    if not Path(checkpoint).exists():
        return None
    return _finished(checkpoint, policy_path, policy, steps, quiet, world)


def _refuse_existing(checkpoint: str | os.PathLike) -> None:
    """Refuse to start a run at step 0 whose saves would overwrite ``checkpoint`` (a file or
    anything else already there): the run it holds would be lost.

    Raises:
        AutoprecError: ``checkpoint`` exists; the message names it, the step it holds (or why it is
            not a checkpoint) and the choices: ``--resume``, another path, or removing it.
    """
    if not Path(checkpoint).exists():
        return
    try:
        held = f"holds a run at step {peek_checkpoint(checkpoint).step}"
        keep = "pass --resume to continue it (with --steps above that step to train further), or "
    except AutoprecError as e:  # not a checkpoint: --resume would refuse it too
        held, keep = f"already exists ({str(e).removeprefix(f'{os.fspath(checkpoint)}: ')})", ""
    raise AutoprecError(f"checkpoint {checkpoint} {held}; without --resume this run would start at step 0 "
                        f"and overwrite it. To keep it, {keep}give another --checkpoint path; to start "
                        "over, remove it first")


def _finished(checkpoint: str | os.PathLike, policy_path: str | os.PathLike, policy: Policy, steps: int,
              quiet: bool, world: int = 1) -> TrainResult | None:
    """The result of a run that ``checkpoint`` shows complete (step ≥ ``steps``), after one line
    saying so; None when steps are left. Reads only the checkpoint's step, policy and process count.

    Raises:
        AutoprecError: not a checkpoint, saved under another policy, or by a run of another number of
            processes than ``world`` (:func:`_check_world`).
    """
    ck = peek_checkpoint(checkpoint)
    _check_policy(checkpoint, ck, policy_path, policy)
    _check_world(checkpoint, ck, world)
    if ck.step < steps:
        return None
    if not quiet:
        print(f"checkpoint {checkpoint} is at step {ck.step} of --steps {steps}: the run is complete, "
              "nothing to do", flush=True)
    return TrainResult(start_step=ck.step, complete=True)


def _check_policy(checkpoint: str | os.PathLike, ck: Any, policy_path: str | os.PathLike,
                  policy: Policy) -> None:
    """Raise :class:`AutoprecError` when checkpoint ``ck`` was saved under a policy other than ``policy``."""
    if ck.policy is not None and ck.policy.training_key() != policy.training_key():
        raise AutoprecError(f"{checkpoint}: saved under a different policy than {policy_path} "
                            f"({'; '.join(ck.policy.differences(policy)) or ck.policy.summary()}: "
                            "the checkpoint's first)")


#: Steps whose mean loss is the run's final loss (``TrainResult.final_loss``).
FINAL_STEPS = 5


def report(res: TrainResult) -> int:
    """``autoprec train``'s last words and exit code: on the lead rank (rank 0 speaks for all under
    ``train --nproc``) the final loss line, and an error line on stderr when the final loss is not
    finite, with where the last batch first goes non-finite (``TrainResult.nonfinite``); 0, or 1
    for a non-finite final loss (also 0 for a run ``--resume`` found complete, which :func:`train`
    reported). A resumed run's skipped steps are its own, and the line names the steps it ran; under
    ``--nproc N`` tokens/s is the job's (``... tokens/s across N ranks``)."""
    if res.complete:
        return 0
    ranks = ranks_from_env()
    lead = ranks.lead
    if lead:
        which = (f"mean of the last {res.final_steps} steps not skipped" if res.final_steps != 1
                 else "the last step not skipped")
        final = (f"final loss ({which}) {res.final_loss:.4f}" if res.final_steps
                 else "final loss none (the last steps were all skipped)")
        span = (f" (of steps {res.start_step}-{res.start_step + len(res.losses) - 1}, run after the resume)"
                if res.start_step else "")
        across = f" across {ranks.world} ranks" if ranks.world > 1 else ""
        print(f"{final}; {res.tokens_per_s:.0f} tokens/s{across}; skipped steps {res.skipped}{span}; "
              f"loss scale {res.loss_scale:g}")
    if math.isfinite(res.final_loss):
        return 0
    if lead:
        where = f"; {res.nonfinite}" if res.nonfinite else ""
        n = min(FINAL_STEPS, len(res.losses))
        which = (f"the loss of the last {n} steps is not finite" if res.final_steps
                 else f"each of the last {n} steps was skipped for non-finite gradients")
        print(f"autoprec train: error: {which} ({res.skipped} of {len(res.losses)} steps skipped){where}",
              file=sys.stderr)
    return 1


#: The checkpoint's ``extra`` key for the number of processes of the run that wrote it.
WORLD_SIZE = "world_size"


def _check_world(checkpoint: str | os.PathLike, ck: Any, world: int) -> None:
    """Raise :class:`AutoprecError` when checkpoint ``ck`` was saved by a run of another number of
    processes than ``world`` (one recorded before the count was: taken)."""
    saved = ck.extra.get(WORLD_SIZE, world)
    if saved != world:
        raise AutoprecError(
            f"checkpoint {checkpoint} was saved by a run of {saved} process{'es' if saved != 1 else ''} "
            f"(train --nproc {saved}) and this one has {world}: each rank r of N trains on "
            "get_batch(k * N + r), so it would not continue that run. Resume with --nproc "
            f"{saved}, or start a new run with another --checkpoint")


def _resume(checkpoint: str | os.PathLike, policy_path: str | os.PathLike, policy: Policy, step: TrainStep,
            model: Any, steps: int, quiet: bool, world: int = 1) -> int:
    """Load ``checkpoint`` into the model, optimizer, scaler and RNG if it exists; the step to start at.

    Raises:
        AutoprecError: saved under another policy, or by a run of another number of processes
            (``world``: rank r of N trains on ``get_batch(k * N + r)``, so the batches would change;
            checkpoints from before the count was recorded are taken), or already at step ``steps``
            or beyond (the file changed since :func:`_finished` read it). Nothing is loaded then.
    """
    if not Path(checkpoint).exists():
        if not quiet:
            print(f"no checkpoint at {checkpoint}; starting from step 0", flush=True)
        return 0
    _check_world(checkpoint, peek_checkpoint(checkpoint), world)
    ck = load_checkpoint(checkpoint, model, step.optimizer, step.scaler)
    _check_policy(checkpoint, ck, policy_path, policy)
    if ck.step >= steps:
        raise AutoprecError(f"checkpoint {checkpoint} is already at step {ck.step} ≥ --steps {steps}; "
                            f"pass --steps larger than {ck.step} to train further")
    if not quiet:
        print(f"resumed from {checkpoint} at step {ck.step}", flush=True)
    return ck.step


def _recorder(monitor: Monitor, job: JobStep) -> StepHook:
    """Hook recording each step in ``monitor`` with the job's numbers ``job`` (run before it) left:
    the tokens of all ranks (the model file's ``tokens_per_batch``, summed over an accumulated step's
    micro-batches) and the slowest rank's seconds; an overflow is diagnosed on the first micro-batch."""
    def hook(k: int, batch: Any, stats: StepStats, _seconds: float) -> None:
        monitor.record(k, stats, tokens=job.tokens, seconds=job.seconds, batch=one_micro_batch(batch))

    return hook


def _first_step_cache(start: int, before: dict[str, int]) -> StepHook:
    """Hook logging, after the first step run, how long it took and what Inductor's caches served
    it (:func:`autoprec.applied.compile.cache_report`): a ``train`` after ``tune`` reuses the
    compiled graph instead of compiling it again."""
    def hook(k: int, _batch: Any, _st: StepStats, seconds: float) -> None:
        if k == start:
            _log.info("first step %.1f s (compile included); %s", seconds, cache_report(before))

    return hook


def _printer(steps: int, log_every: int, quiet: bool, job: JobStep) -> StepHook:
    """Hook printing every ``log_every``-th step and the last one (nothing when ``quiet``), with the
    job's loss and seconds ``job`` (run before it) left: the mean over the ranks, the slowest rank's."""
    def hook(k: int, _batch: Any, st: StepStats, _seconds: float) -> None:
        if not quiet and (k % max(log_every, 1) == 0 or k == steps - 1):
            print(f"step {k:4d}  loss {st.loss:.4f}  grad_norm {st.grad_norm:.3g}  scale {st.loss_scale:g}"
                  f"{'  SKIPPED' if st.skipped else ''}  {job.seconds:.2f}s", flush=True)

    return hook


def _print_header(policy: Policy, world: int) -> None:
    """The lines before the first step: the policy's batching, per rank and across the ranks under
    ``--nproc`` (each rank trains on a whole global batch of its own), and what the numbers printed
    under ``--nproc`` are (the job's, not one rank's)."""
    b = policy.batching
    if b is not None and world == 1:
        print(f"training at {b.describe()} (the policy's batching)", flush=True)
    elif b is not None:
        per_rank = (f"micro-batch {b.micro_batch} x {b.accumulation} accumulated per rank ({b.global_batch} "
                    "per rank, " if b.accumulation > 1 else f"micro-batch {b.micro_batch} per rank (")
        print(f"training at {per_rank}{b.global_batch * world} across {world} ranks) "
              "(the policy's batching)", flush=True)
    if world > 1:
        print(f"{world} ranks: a step's loss is the mean over the ranks, its seconds the slowest rank's, "
              "tokens/s all the ranks' tokens over those seconds", flush=True)


def _result(done: list[tuple[StepStats, float]], start: int, step: TrainStep,
            monitor: Monitor) -> TrainResult:
    """The :class:`TrainResult` of the steps run."""
    res = TrainResult(start_step=start, losses=[st.loss for st, _ in done],
                      skipped=sum(int(st.skipped) for st, _ in done), summary=monitor.summary(),
                      loss_scale=step.scaler.get_scale() if step.scaler is not None else 1.0)
    if res.losses:
        tail = [st.loss for st, _ in done[-FINAL_STEPS:] if not st.skipped]
        res.final_loss, res.final_steps = (sum(tail) / len(tail) if tail else math.nan), len(tail)
        res.tokens_per_s = res.summary["median_tokens_per_s"]  # the monitor's rule (tokens_per_s)
        if not math.isfinite(res.final_loss):
            res.nonfinite = _nonfinite(monitor)
    return res


def _nonfinite(monitor: Monitor) -> str:
    """Where the forward of the last batch run first goes non-finite in the weights trained so far
    (:meth:`Monitor.diagnoser`, one eager forward of the captured graph), with the model's line;
    or that its outputs are finite, so the loss computed from them is not."""
    try:
        key = monitor.diagnoser()()
    except Exception as e:  # noqa: BLE001 - a diagnosis must not hide the error it explains
        return f"its first non-finite node could not be found ({type(e).__name__}: {e})"
    if key is None:
        return ("the forward's outputs on the last batch are finite: the loss computed from them (loss_fn) "
                "is not")
    src = monitor.source_of(key)
    return f"first non-finite output on the last batch: node {key}" + (f" (from {src})" if src else "")
