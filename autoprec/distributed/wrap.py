"""Many processes: DDP and FSDP2 over an applied module (docs/architecture.md#runtime).

* :func:`ddp` wraps a :class:`~autoprec.applied.apply.MixedPrecisionModule` in
  ``DistributedDataParallel`` (eager or compiled graph; gloo on CPU, NCCL on CUDA), with the
  policy's ``grad_reduce_dtype`` as its communication hook.
* :func:`shard` puts it under FSDP2 (``torch.distributed.fsdp.fully_shard``) as one FSDP unit
  (the lowered graph is one call: there are no per-layer calls for per-layer units to hook).

Each rank's place and batches are :mod:`autoprec.distributed.ranks`. The loss scaler's agreement
across ranks is :func:`autoprec.training.rank_flag.any_rank`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from autoprec._torch_compat import child_module
from autoprec.applied.apply import MixedPrecisionModule
from autoprec.applied.compile import CompiledGraph
from autoprec.applied.recapture import Routed
from autoprec.errors import AutoprecError
from autoprec.policy import Policy

__all__ = ["ShardedModule", "bf16_hook", "ddp", "shard"]


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
        AutoprecError: ``mp`` is not what :func:`autoprec.apply` returned.
        RuntimeError / ValueError: from DDP (e.g. no initialised process group).
    """
    _check_applied(mp, "ddp")
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
        applied: The :class:`~autoprec.applied.apply.MixedPrecisionModule`.
        state_dict_prefix: ``"model."``, that prefix: :func:`autoprec.save_checkpoint` writes the
            model's own keys (its checkpoint loads into the plain model, and back).
    """

    state_dict_prefix = "model."

    def __init__(self, mp: MixedPrecisionModule) -> None:
        super().__init__()
        self.model = mp.model
        object.__setattr__(self, "applied", mp)  # not a child: FSDP2 must not look inside the graph

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The applied module's forward (same inputs, same outputs; in eval mode the model's own
        forward, on the Parameters FSDP2 has unsharded for this call)."""
        return self.applied(*args, **kwargs)

    def train(self, mode: bool = True) -> ShardedModule:
        """Set the training flag here and on the applied module (not a child, so ``nn.Module.train``
        would miss it), whose mode picks the lowered graph or the model's own forward."""
        self.applied.train(mode)
        return super().train(mode)


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
        fp32) and a :class:`~autoprec.training.scaler.DynamicLossScaler` (it agrees across shards).

    Raises:
        AutoprecError: ``mp`` is not what :func:`autoprec.apply` returned, serves shapes by a
            per-shape cache, or the model has Parameters of its own (not in a submodule): names it.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    _check_applied(mp, "shard")
    for gm in _graphs_of(mp):
        _read_model_modules(gm, mp.model)
    policy = policy if policy is not None else mp.policy
    dev = next(mp.parameters()).device
    mesh = mesh if mesh is not None else init_device_mesh(dev.type, (dist.get_world_size(),))
    reduce = torch.bfloat16 if policy.grad_reduce_dtype == "bf16" else None
    root = ShardedModule(mp)
    object.__setattr__(mp, "_params", None)  # FSDP2 swaps the model's Parameters around every call
    fully_shard(root, mesh=mesh, reshard_after_forward=reshard_after_forward,
                mp_policy=MixedPrecisionPolicy(reduce_dtype=reduce))
    return root


def _check_applied(mp: Any, fn: str) -> None:
    """Raise AutoprecError unless ``mp`` is what :func:`autoprec.apply` returned."""
    if not isinstance(mp, MixedPrecisionModule):
        raise AutoprecError(f"{fn}: expects the module autoprec.apply returned, got {type(mp).__name__}: "
                            f"mp = autoprec.apply(model, policy, example_batch), then autoprec.{fn}(mp)")


def _graphs_of(mp: MixedPrecisionModule) -> list[fx.GraphModule]:
    """The graph ``mp`` runs: its lowered graph, the graph its :class:`CompiledGraph` compiled
    (``target``), or the dynamic graph of a :class:`Routed` (its per-shape graphs are not sharded)."""
    fn = mp.runner
    fn = fn.fn if isinstance(fn, Routed) else fn
    fn = fn.target if isinstance(fn, CompiledGraph) else fn
    if not isinstance(fn, fx.GraphModule):
        raise AutoprecError(f"shard: {type(mp.model).__name__} is served by one graph per input shape "
                            f"({type(fn).__name__}); FSDP2 needs one graph: apply(..., dynamic=False)")
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
