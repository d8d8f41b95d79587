"""Many processes: DDP and FSDP2 over an applied module, the rank's batches, ``train --nproc``
(docs/architecture.md#runtime).

* :func:`ddp` wraps a :class:`~autoprec.runtime.apply.MixedPrecisionModule` in
  ``DistributedDataParallel`` (eager or compiled graph; gloo on CPU, NCCL on CUDA), with the
  policy's ``grad_reduce_dtype`` as its communication hook.
* :func:`shard` puts it under FSDP2 (``torch.distributed.fsdp.fully_shard``) as one FSDP unit
  (the lowered graph is one call: there are no per-layer calls for per-layer units to hook).
* :func:`rank_step_batch` is the data rule of ``autoprec train --nproc N``: rank ``r`` of ``N`` at
  step ``k`` trains on ``get_batch(k * N + r)``, so N ranks x batch B see the batches one rank sees
  in N x as many steps, and their averaged gradient is that of the N batches concatenated.
* :func:`launch` starts ``autoprec train`` on N ranks with ``torch.distributed.run`` (torchrun);
  each rank finds its place in the environment torchrun sets (:func:`ranks_from_env`).

The loss scaler's agreement across ranks is :func:`autoprec.runtime.scaler.any_rank`.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from autoprec._torch_compat import child_module
from autoprec.errors import AutoprecError
from autoprec.policy import Policy
from autoprec.runtime.apply import MixedPrecisionModule
from autoprec.runtime.train import StepStats

__all__ = ["Ranks", "ShardedModule", "bf16_hook", "close_ranks", "ddp", "launch", "mean_loss_hook",
           "ranks_from_env", "init_ranks", "rank_step_batch", "shard", "strip_nproc"]


@dataclass(frozen=True)
class Ranks:
    """Where this process stands: ``rank`` of ``world`` ranks, ``local_rank`` on its machine."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def lead(self) -> bool:
        """True on rank 0, the one that prints, logs and writes checkpoints."""
        return self.rank == 0


def ranks_from_env() -> Ranks:
    """The :class:`Ranks` torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``); one rank without.

    Raises:
        AutoprecError: a variable is not an integer or the rank is outside ``[0, WORLD_SIZE)``.
    """
    try:
        r = Ranks(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                  int(os.environ.get("LOCAL_RANK", 0)))
    except ValueError as e:
        raise AutoprecError(f"RANK/WORLD_SIZE/LOCAL_RANK: not an integer ({e})") from None
    if not 0 <= r.rank < r.world:
        raise AutoprecError(f"RANK={r.rank} is outside [0, WORLD_SIZE={r.world})")
    return r


def init_ranks(device: torch.device, ranks: Ranks) -> torch.device:
    """Join the default process group when ``ranks.world > 1`` (gloo on CPU, NCCL on CUDA, rendezvous
    from torchrun's ``MASTER_ADDR``/``MASTER_PORT``); the device this rank trains on.

    Returns:
        ``device`` on CPU or with one rank; ``cuda:<local_rank>`` (made current) on CUDA.
    """
    if ranks.world <= 1:
        return device
    if device.type == "cuda":
        device = torch.device("cuda", ranks.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=ranks.rank,
                                world_size=ranks.world)
    return device


def close_ranks(ranks: Ranks) -> None:
    """Leave the default process group :func:`init_ranks` joined (no-op with one rank), after a
    barrier: a rank destroying gloo's group while another still talks to it can abort
    (``terminate called without an active exception``). A ``DistributedDataParallel`` module
    lives in a reference cycle and its C++ reducer holds the group: the cyclic GC runs first, so
    no reducer keeps gloo's threads alive past the group's destruction into interpreter exit."""
    if ranks.world > 1 and dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
        gc.collect()


def rank_step_batch(get_batch: Callable[[int, torch.device], Any], device: torch.device,
                    ranks: Ranks) -> Callable[[int], Any]:
    """Step ``k``'s batch of this rank: ``get_batch(k * world + rank, device)`` (module docstring)."""
    return lambda k: get_batch(k * ranks.world + ranks.rank, device)


def mean_loss_hook(ranks: Ranks) -> Callable[[int, Any, StepStats, float], None]:
    """A step hook (:data:`autoprec.runtime.steps.StepHook`) replacing ``stats.loss`` by its mean
    over the ranks (an all-reduce SUM / world), so every rank logs the loss of the whole global
    batch; every rank must run it. A no-op with one rank."""
    def hook(_k: int, _batch: Any, stats: StepStats, _seconds: float) -> None:
        if ranks.world > 1:
            t = torch.tensor(stats.loss, dtype=torch.float64)
            dist.all_reduce(t)
            stats.loss = float(t) / ranks.world

    return hook


def bf16_hook(state, bucket):  # no annotations: DDP compares them to the classes, and these are strings
    """torch's ``bf16_compress_hook`` under another name (same arithmetic: the bucket cast to bf16,
    divided by the world size, all-reduced, cast back into the fp32 bucket). DDP refuses the
    original by name unless CUDA + NCCL >= 2.10 (torch/nn/parallel/distributed.py
    ``register_comm_hook``), though gloo all-reduces bf16; this is what :func:`ddp` registers on gloo."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    return bf16_compress_hook(state, bucket)


def ddp(mp: MixedPrecisionModule, policy: Policy | None = None,
        **kwargs: Any) -> nn.parallel.DistributedDataParallel:
    """``DistributedDataParallel(mp, **kwargs)`` with the gradient communication of the policy.

    Args:
        mp: What :func:`autoprec.apply` returned (compiled or not), on this rank's device.
        policy: Its ``grad_reduce_dtype`` (default ``mp.policy``'s): ``bf16`` registers
            ``bf16_compress_hook`` on NCCL (:func:`bf16_hook` elsewhere); ``fp32`` keeps DDP's
            fp32 all-reduce. The master weights' ``.grad`` is fp32 either way.
        **kwargs: Passed to ``DistributedDataParallel`` (``device_ids`` defaults to the current
            CUDA device for a CUDA module).

    Raises:
        RuntimeError / ValueError: from DDP (e.g. no initialised process group).
    """
    policy = policy if policy is not None else mp.policy
    dev = next(mp.parameters()).device
    if dev.type == "cuda":
        kwargs.setdefault("device_ids", [dev.index])
    model = nn.parallel.DistributedDataParallel(mp, **kwargs)
    if policy.grad_reduce_dtype == "bf16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

        nccl = "nccl" in str(dist.get_backend(kwargs.get("process_group")))
        model.register_comm_hook(kwargs.get("process_group"), bf16_compress_hook if nccl else bf16_hook)
    return model


class ShardedModule(nn.Module):
    """The FSDP2 root over an applied module: its child ``model`` is the wrapped model (so
    ``fully_shard`` finds its Parameters), its forward is the applied module's.

    Built by :func:`shard`; after it the model's Parameters are ``DTensor`` shards, and the lowered
    graph reads the unsharded ones FSDP2 puts on the model's modules around each forward/backward.

    Attributes:
        model: The wrapped model (``state_dict`` keys gain the prefix ``model.``).
        applied: The :class:`~autoprec.runtime.apply.MixedPrecisionModule`.
    """

    def __init__(self, mp: MixedPrecisionModule) -> None:
        super().__init__()
        self.model = mp.model
        object.__setattr__(self, "applied", mp)  # not a child: FSDP2 must not look inside the graph

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The applied module's forward (same inputs, same outputs)."""
        return self.applied(*args, **kwargs)


def shard(mp: MixedPrecisionModule, mesh: Any = None, policy: Policy | None = None,
          reshard_after_forward: bool = True) -> ShardedModule:
    """FSDP2 over an applied module: ``fully_shard(ShardedModule(mp), mesh, mp_policy=...)``.

    The graph's Parameter holders are pointed at the model's own submodules first, so the graph
    reads whatever Parameter FSDP2 has put there (the unsharded one in forward and backward):
    ``fully_shard`` directly over ``mp`` or over the model before ``apply`` does not work (FSDP2
    finds Parameters through ``children()``, which ``mp`` hides; an FSDP2 model cannot be captured).

    Args:
        mp: From :func:`autoprec.apply` (compiled or not), before its first call; one graph
            (static, or dynamic shapes in one graph: not a per-shape cache).
        mesh: A 1-D ``DeviceMesh`` (default: all ranks, ``init_device_mesh`` on the device type).
        policy: Its ``grad_reduce_dtype`` (default ``mp.policy``'s) is FSDP2's
            ``MixedPrecisionPolicy(reduce_dtype=...)``; the compute dtypes stay the graph's.
        reshard_after_forward: FSDP2's option (True: free the unsharded Parameters after forward).

    Returns:
        The sharded root: train it with an optimizer over its ``parameters()`` (DTensor shards,
        fp32) and a :class:`~autoprec.runtime.scaler.DynamicLossScaler` (it agrees across shards).

    Raises:
        AutoprecError: ``mp`` serves shapes by a per-shape cache, or the model has Parameters of
            its own (not in a submodule): names it.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    for gm in _graphs_of(mp):
        _read_model_modules(gm, mp.model)
    policy = policy if policy is not None else mp.policy
    dev = next(mp.parameters()).device
    mesh = mesh if mesh is not None else init_device_mesh(dev.type, (dist.get_world_size(),))
    reduce = torch.bfloat16 if policy.grad_reduce_dtype == "bf16" else None
    root = ShardedModule(mp)
    fully_shard(root, mesh=mesh, reshard_after_forward=reshard_after_forward,
                mp_policy=MixedPrecisionPolicy(reduce_dtype=reduce))
    return root


def _graphs_of(mp: MixedPrecisionModule) -> list[fx.GraphModule]:
    """The graph ``mp`` runs, through its compile wrappers (``fn``, ``_orig_mod``)."""
    fn = mp._fn
    while not isinstance(fn, fx.GraphModule):
        inner = getattr(fn, "_orig_mod", None)
        inner = inner if inner is not None else getattr(fn, "fn", None)
        if inner is None:
            raise AutoprecError(f"shard: {type(mp.model).__name__} is served by one graph per input shape "
                                f"({type(fn).__name__}); FSDP2 needs one graph: apply(..., dynamic=False)")
        fn = inner
    return [fn]


def _read_model_modules(gm: fx.GraphModule, model: nn.Module) -> None:
    """Replace ``gm``'s attribute holders by the model's submodules of the same names."""
    own = dict(model.named_parameters(recurse=False))
    for top in sorted({str(n.target).split(".")[0] for n in gm.graph.nodes if n.op == "get_attr"}):
        if top in own:
            raise AutoprecError(f"shard: {type(model).__name__}.{top} is a Parameter of the model itself; "
                                "FSDP2 over autoprec needs every Parameter in a submodule")
        sub = child_module(model, top)
        if sub is not None:
            setattr(gm, top, sub)


def strip_nproc(argv: Sequence[str]) -> list[str]:
    """``argv`` without its ``--nproc N`` / ``--nproc=N``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


#: The launcher a rank group runs in: torchrun's own parser for its options, the ranks' arguments
#: set after parsing (torchrun's argparse would otherwise take ``--log`` for an ambiguous
#: abbreviation of ``--log-dir``, though it comes after the script).
_TORCHRUN = ("import json, sys\n"
             "from torch.distributed.run import get_args_parser, run\n"
             "args = get_args_parser().parse_args(sys.argv[2:] + ['-m', 'autoprec.cli'])\n"
             "args.training_script_args = json.loads(sys.argv[1])\n"
             "run(args)\n")


def launch(argv: Sequence[str], nproc: int) -> int:
    """Run ``autoprec <argv>`` (``--nproc`` removed) on ``nproc`` ranks of this machine with
    torchrun (``torch.distributed.run --standalone --nproc-per-node N -m autoprec.cli``: a free
    port on localhost), and wait. Each rank finds its place with :func:`ranks_from_env`.

    Returns:
        torchrun's exit code (non-zero when any rank failed; torchrun then stops the others).
    """
    import json

    cmd = [sys.executable, "-c", _TORCHRUN, json.dumps(strip_nproc(argv)), "--standalone",
           f"--nproc-per-node={nproc}"]
    return subprocess.call(cmd)
