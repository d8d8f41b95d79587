"""``autoprec bench --nproc N``: gradient communication and memory under DDP and FSDP2
(docs/architecture.md#runtime).

``autoprec bench MODEL --policy P --nproc N`` starts N ranks with torchrun
(:func:`autoprec.commands.launch.launch`); every rank runs :func:`run_bench_dist`, which trains
the policy-applied model under four configurations, one after the other, from the same weights
(rank 0's, broadcast) on the rank's batches of ``autoprec train --nproc N`` (rank r at step k:
``get_batch(k * N + r)``), through the one training loop (:func:`autoprec.training.steps.run_steps`):

=====================  ==============================================================================
``ddp_fp32_reduce``    :func:`~autoprec.distributed.wrap.ddp`, gradients all-reduced in fp32
``ddp_bf16_reduce``    the same with ``grad_reduce_dtype: bf16`` (``bf16_compress_hook``)
``fsdp2_fp32_reduce``  :func:`~autoprec.distributed.wrap.shard` (FSDP2), reduce-scattered in fp32
``fsdp2_bf16_reduce``  the same with ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``
=====================  ==============================================================================

The policy's compute rules are the same in all four; only ``grad_reduce_dtype`` and the wrapper
change. Per row: the median step seconds after warm-up on rank 0 and the largest rank median,
tokens/s of the global batch, ``grad_rel_l2`` (:func:`autoprec.metrics.grad_rel_l2`) of the
reduced gradient of step 0 (unscaled, before the optimizer step, gathered whole on rank 0)
against ``ddp_fp32_reduce``'s on the same batches and weights, and the per-rank peak bytes
beside the prediction of :func:`predicted_peak_bytes`.

Peak bytes per rank, over the span of building the row's model, wrapping it and the warm-up
steps (the first creates the optimizer state, the second starts with it):
:class:`autoprec.measure.memory.PeakBytes` (the memory rule's home, docs/architecture.md#measurements):
on CUDA ``torch.cuda.max_memory_allocated``; on CPU, which keeps no allocator statistics, the C
heap's bytes in use (glibc ``mallinfo2``: torch's tensors and gloo's buffers, on every thread) read
after every ATen op of the span by a ``TorchDispatchMode`` and by a sampling thread, less their
value when the span began. (torch's profiler ``profile_memory`` was tried first and is not used:
it misses a free made on one of gloo's threads, so a buffer freed there counts as alive to the
end.) The rows are eager (``apply(..., compile=False)``), which the dispatch mode sees whole. The
reduced gradients of step 0 come from a separate build of the row, so gathering them counts in no peak.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import os
from typing import Any

import torch
import torch.distributed as dist

from autoprec._io import write_json
from autoprec.applied.apply import apply
from autoprec.applied.policy_match import check_policy_file
from autoprec.device import describe_machine, resolve_device
from autoprec.distributed.ranks import Ranks, init_ranks, joined, rank_step_batch, ranks_from_env
from autoprec.distributed.wrap import ddp, shard
from autoprec.measure.memory import PeakBytes
from autoprec.metrics import grad_rel_l2, median
from autoprec.modelspec import load_model_spec
from autoprec.policy import Policy
from autoprec.training.steps import run_steps
from autoprec.training.train import TrainStep, make_scaler

__all__ = ["DIST_ROWS", "format_dist_table", "predicted_peak_bytes", "run_bench_dist"]

#: The configurations of ``bench --nproc``, in table order: ``(name, wrapper, grad_reduce_dtype)``.
DIST_ROWS: tuple[tuple[str, str, str], ...] = (
    ("ddp_fp32_reduce", "ddp", "fp32"), ("ddp_bf16_reduce", "ddp", "bf16"),
    ("fsdp2_fp32_reduce", "fsdp2", "fp32"), ("fsdp2_bf16_reduce", "fsdp2", "bf16"),
)


def predicted_peak_bytes(n_params: int, largest: int, wrapper: str, world: int, reduce: str,
                         moments: int = 8) -> dict[str, Any]:
    """Per-rank peak bytes of the training state, AdamW, fp32 master weights, activations left
    out (docs/architecture.md#runtime, "Memory under sharding").

    Per parameter (bytes): weights 4, gradients 4, AdamW's two moments ``moments`` (8). DDP also
    keeps its gradient buckets (4, ``gradient_as_bucket_view=False``), and its peak comes when
    :class:`~autoprec.training.train.TrainStep` counts non-finite gradients: ``isfinite`` (1) and
    its ``sum``'s int64 copy (8) of the largest gradient (9 x ``largest`` bytes; more than AdamW's
    per-tensor ``sqrt``/``div`` temporaries, 8 x ``largest``, torch/optim/adamw.py on CPU), or,
    with bf16 reduction, ``bf16_compress_hook``'s bf16 bucket (2). FSDP2
    (:func:`~autoprec.distributed.wrap.shard`, one unit) holds 1/N of weights, gradients and
    moments, and at the end of backward the all-gathered fp32 weights (4), their unsharded
    gradients (4) and the reduce-scatter's input (4: fp32; bf16: the gradients cast, 2, and the
    input, 2). The low-precision weight copy (2 per bf16 weight) is freed in backward as the
    gradients appear, so it is not in the peak. Checked on CPU (gloo) only: on CUDA, AdamW's
    default ``foreach`` step allocates the square roots of all second moments at once (4 per
    parameter), which this formula does not add.

    Args:
        n_params: Trainable parameters (count).
        largest: Elements of the largest trainable parameter.
        wrapper: ``"ddp"`` or ``"fsdp2"``.
        world: Ranks N (≥ 1).
        reduce: ``"fp32"`` or ``"bf16"`` (``grad_reduce_dtype``).
        moments: Optimizer state bytes per parameter (AdamW 8).

    Returns:
        ``{"bytes", "bytes_per_param", "at_rest_per_param", "formula"}`` (bytes; bytes per parameter).

    Raises:
        ValueError: unknown ``wrapper``.
    """
    if wrapper == "ddp":
        rest = 4 + 4 + 4 + moments
        extra = max(9 * largest, 2 * n_params if reduce == "bf16" else 0)
        total = rest * n_params + extra
        formula = (f"(4 weights + 4 grads + 4 buckets + {moments} moments) x params + "
                   + ("max(9 x largest, 2 x params bf16 bucket)" if reduce == "bf16" else "9 x largest"))
    elif wrapper == "fsdp2":
        rest = (4 + 4 + moments) / world
        total = (rest + 12) * n_params
        formula = (f"({4 + 4 + moments}/{world} sharded + 4 gathered weights + 4 unsharded grads "
                   "+ 4 reduce-scatter) x params")
    else:
        raise ValueError(f"predicted_peak_bytes: wrapper {wrapper!r}: expected 'ddp' or 'fsdp2'")
    return {"bytes": total, "bytes_per_param": total / max(n_params, 1), "at_rest_per_param": rest,
            "formula": formula}


def _broadcast_weights(model: torch.nn.Module) -> None:
    """Every rank takes rank 0's weights (FSDP2 shards each rank's copy: they must agree)."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t, 0)


def _full_grads(params: list[torch.Tensor], scale: float) -> list[torch.Tensor]:
    """The reduced, unscaled gradients, whole (an FSDP2 shard is all-gathered: every rank calls)."""
    out = []
    for p in params:
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        g = g.full_tensor() if hasattr(g, "full_tensor") else g
        out.append(g.detach().float().cpu() / scale)
    return out


def _build(spec: Any, policy: Policy, wrapper: str, dev: torch.device) -> tuple[Any, TrainStep]:
    """The row's model (rank 0's weights), applied, wrapped, and its :class:`TrainStep`; the
    policy is checked against the model once, by :func:`run_bench_dist`."""
    model = spec.build_model().to(dev)
    model.train()
    _broadcast_weights(model)
    mp = apply(model, policy, spec.get_batch(0, dev), compile=False, dynamic=False, force=True)
    module = ddp(mp, policy) if wrapper == "ddp" else shard(mp, policy=policy)
    params = [p for p in module.parameters() if p.requires_grad]
    return mp, TrainStep(module, params, spec.make_optimizer(params), spec.loss_fn,
                         scaler=make_scaler(policy), device_type=dev.type)


def _reduced_grads(spec: Any, policy: Policy, wrapper: str, dev: torch.device,
                   ranks: Ranks) -> tuple[list[torch.Tensor], torch.fx.GraphModule]:
    """Step 0's reduced gradients from the initial weights (unscaled), built apart from the
    measured row so that gathering them counts in no peak; and the captured graph."""
    mp, step = _build(spec, policy, wrapper, dev)
    step.forward_backward(rank_step_batch(spec.get_batch, dev, ranks)(0))
    scale = step.scaler.get_scale() if step.scaler is not None else 1.0
    return _full_grads(step.params, scale), mp.graph_module


def _row(spec: Any, policy: Policy, wrapper: str, dev: torch.device, ranks: Ranks, steps: int,
         warmup: int) -> dict[str, Any]:
    """One configuration on this rank: peak over build and warm-up, then the timed steps."""
    meter = PeakBytes(dev)
    batches = rank_step_batch(spec.get_batch, dev, ranks)
    # the rows before: DDP/FSDP2 modules hold reference cycles (hooks); free them outside the span
    gc.collect()
    with meter.span():
        mp, step = _build(spec, policy, wrapper, dev)
        run_steps(step, batches, 0, warmup)
    sizes = [p.numel() for p in mp.model.parameters() if p.requires_grad]
    timed = run_steps(step, batches, warmup, warmup + steps)
    tokens = sum(spec.tokens_per_batch(batches(k)) for k in range(warmup, warmup + steps)) / max(steps, 1)
    local = {"step_s": median([s for _, s in timed]), "peak": meter.peak, "tokens": tokens,
             "losses": [st.loss for st, _ in timed]}
    every = [None] * ranks.world
    dist.all_gather_object(every, local)
    n_params = sum(sizes)
    pred = predicted_peak_bytes(n_params, max(sizes, default=0), wrapper, ranks.world,
                                policy.grad_reduce_dtype)
    step_s = every[0]["step_s"]
    return {"wrapper": wrapper, "grad_reduce_dtype": policy.grad_reduce_dtype, "step_s": step_s,
            "step_s_max_rank": max(e["step_s"] for e in every), "step_times_rank0": [s for _, s in timed],
            "tokens_per_s": sum(e["tokens"] for e in every) / step_s if step_s > 0 else 0.0,
            "peak_bytes_per_rank": [int(e["peak"]) for e in every],
            "predicted_peak_bytes": int(pred["bytes"]), "predicted_bytes_per_param": pred["bytes_per_param"],
            "at_rest_bytes_per_param": pred["at_rest_per_param"], "formula": pred["formula"],
            "params": n_params, "largest_param": max(sizes, default=0),
            "measured_bytes_per_param": max(e["peak"] for e in every) / max(n_params, 1),
            "final_loss_rank0": every[0]["losses"][-1] if every[0]["losses"] else None}


def run_bench_dist(model_path: str | os.PathLike, policy: Policy | str | os.PathLike, steps: int = 5,
                   warmup: int = 2, device: str = "auto", quiet: bool = False,
                   json_path: str | os.PathLike | None = None, force: bool = False) -> dict[str, Any] | None:
    """Measure :data:`DIST_ROWS` on this rank (every rank of a torchrun group calls it).

    Args:
        model_path: Model file (docs/architecture.md#modelpy-contract); its optimizer (default
            AdamW) must take ``DTensor`` parameters for the FSDP2 rows.
        policy: A :class:`Policy` or a policy JSON file; each row replaces its ``grad_reduce_dtype``.
        steps: Timed steps per row (median reported).
        warmup: Untimed steps before timing; the peak is measured over them (≥ 2 to include a
            step that starts with the optimizer state already allocated).
        device: ``auto``, ``cpu``, ``cuda`` (gloo on CPU, NCCL on CUDA: one GPU per rank).
        quiet: Print nothing (rank 0 prints a line per row otherwise).
        json_path: Rank 0 writes the result here (:func:`autoprec._io.write_json`).
        force: Measure a policy none of whose module or node rules matches a node of this model
            (``bench --force``, as one process's :func:`autoprec.commands.bench.run_bench`); rank 0
            warns when the policy file was tuned on another graph either way.

    Returns:
        On rank 0 ``{"device", "machine", "torch", "autoprec", "date", "model", "policy", "world",
        "steps", "warmup", "peak_rule", "configs": {name: row}}`` with a row's ``step_s`` (s,
        rank 0's median), ``step_s_max_rank``, ``tokens_per_s`` (global batch), ``grad_rel_l2``
        (vs ``ddp_fp32_reduce``), ``peak_bytes_per_rank`` (bytes, one per rank),
        ``predicted_peak_bytes`` (:func:`predicted_peak_bytes`), ``policy_choice`` (the row of the
        policy's own ``grad_reduce_dtype``); ``None`` on the other ranks.

    Raises:
        ModelSpecError, PolicyError: bad model or policy file, or (without ``force``) a policy none
            of whose module or node rules matches a node of this model. AutoprecError: no process group
        can be formed (``WORLD_SIZE`` < 2: run it through ``autoprec bench --nproc N``).
    """
    from autoprec._version import __version__
    from autoprec.errors import AutoprecError

    ranks = ranks_from_env()
    if ranks.world < 2 and not dist.is_initialized():
        raise AutoprecError("bench --nproc: this process is not one of N ranks (WORLD_SIZE unset or 1); "
                            "start it with `autoprec bench MODEL --policy P --nproc N`")
    ranks = ranks if ranks.world > 1 else Ranks(dist.get_rank(), dist.get_world_size(), dist.get_rank())
    pol = policy if isinstance(policy, Policy) else Policy.load(policy)
    spec = load_model_spec(model_path)
    own = not dist.is_initialized()
    dev = init_ranks(resolve_device(device), ranks)
    with joined(ranks) if own else contextlib.nullcontext():  # a rank that fails leaves at once
        rows, ref = {}, None
        for name, wrapper, reduce in DIST_ROWS:
            row_policy = dataclasses.replace(pol, grad_reduce_dtype=reduce)
            grads, gm = _reduced_grads(spec, row_policy, wrapper, dev, ranks)
            if ref is None:  # once, on every rank (each refuses): the graph captured for the first row
                why = check_policy_file(pol, None if isinstance(policy, Policy) else policy, gm,
                                        str(spec.path), force, at_batching=False)  # the file's batch
                if why and ranks.lead and not quiet:
                    print(f"[autoprec bench] warning: {why}", flush=True)
            ref = grads if ref is None else ref
            rows[name] = _row(spec, row_policy, wrapper, dev, ranks, steps, warmup)
            rows[name]["grad_rel_l2"] = grad_rel_l2(grads, ref)
            del grads
            rows[name]["policy_choice"] = reduce == pol.grad_reduce_dtype
            if ranks.lead and not quiet:
                r = rows[name]
                print(f"[autoprec bench] {name}: {r['step_s']:.4f} s/step, grad_rel_l2 "
                      f"{r['grad_rel_l2']:.2e}, peak {max(r['peak_bytes_per_rank']) / 2**20:.2f} MiB/rank "
                      f"(predicted {r['predicted_peak_bytes'] / 2**20:.2f})", flush=True)
    if not ranks.lead:
        return None
    machine = describe_machine(dev)
    result = {"device": machine["device"], "machine": machine, "torch": torch.__version__,
              "autoprec": __version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "model": str(spec.path), "policy": pol.to_dict(), "world": ranks.world, "steps": steps,
              "warmup": warmup, "backend": "nccl" if dev.type == "cuda" else "gloo",
              "peak_rule": PeakBytes(dev).rule(), "configs": rows}
    if json_path is not None:
        write_json(json_path, result, indent=2)
    return result


def format_dist_table(result: dict[str, Any]) -> str:
    """Markdown table of a :func:`run_bench_dist` result (one row per configuration)."""
    lines = ["| config | step s (rank 0) | step s (max rank) | tokens/s | grad_rel_l2 vs fp32 reduce "
             "| peak MiB per rank | predicted MiB | measured/predicted | policy's |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, r in result["configs"].items():
        peak = max(r["peak_bytes_per_rank"])
        lines.append(f"| {name} | {r['step_s']:.4f} | {r['step_s_max_rank']:.4f} | {r['tokens_per_s']:.0f} | "
                     f"{r['grad_rel_l2']:.2e} | "
                     f"{' / '.join(f'{b / 2**20:.2f}' for b in r['peak_bytes_per_rank'])} | "
                     f"{r['predicted_peak_bytes'] / 2**20:.2f} | "
                     f"{peak / max(r['predicted_peak_bytes'], 1):.3f} | "
                     f"{'yes' if r['policy_choice'] else ''} |")
    lines.append("")
    lines.append(f"{result['device']}; torch {result['torch']}; {result['world']} ranks "
                 f"({result['backend']}); {result['date']}; peak: {result['peak_rule']}")
    return "\n".join(lines)
