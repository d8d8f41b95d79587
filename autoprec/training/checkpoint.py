"""Training checkpoints: model, optimizer, loss scaler, policy, step counter and RNG states
(docs/architecture.md#runtime, C14).

A checkpoint is one ``torch.save`` file whose content is plain tensors, dicts, lists, strings and
numbers only, so it loads with ``torch.load(weights_only=True)`` (no arbitrary unpickling). It holds

* ``model``: ``model.state_dict()`` (fp32 master weights; a :class:`MixedPrecisionModule` gives the
  wrapped model's keys, so checkpoints are interchangeable with plain-model ones);
* ``optimizer``: ``optimizer.state_dict()`` (fp32 state);
* ``scaler``: :meth:`DynamicLossScaler.state_dict` (scale, growth tracker, skip counters), or ``{}``;
* ``policy``: the policy JSON text (schema v1), or ``None``;
* ``step``: the number of optimizer steps done (the next batch is ``get_batch(step)``); ``extra``: a
  JSON-able dict of the caller's counters;
* ``rng``: the CPU torch generator state, the CUDA generator states (if CUDA is initialised), and
  Python's ``random`` state, so dropout and any sampling continue as in the uninterrupted run
  (the stream RNG rule of :mod:`autoprec.training.rng`, which ``train`` and ``train --compare``
  follow).

A run sharded by FSDP2 (:func:`autoprec.shard`: its Parameters are ``DTensor`` shards) saves and loads
the same file, with full tensors and the model's own keys: ``save_checkpoint`` gathers the state with
PyTorch's ``torch.distributed.checkpoint.state_dict.get_state_dict`` (``full_state_dict=True,
cpu_offload=True``) and rank 0 writes it; ``load_checkpoint`` gives each rank its shards
(``set_state_dict``); the file also holds every rank's RNG state (``rng_ranks``), and each rank
restores its own. Both are then collectives: every rank calls them, and a save returns on every rank
once the file is written. A save on rank 0 alone, the DDP habit, pairs its gather with the other
ranks' next collectives: gloo aborts ("collective mismatch"). Before, the file held the calling
rank's shards only, and a resume trained on them without a word.

Writes are atomic (temp file in the same directory, ``fsync``, ``os.replace``, directory ``fsync``):
a crash leaves either the old checkpoint or the new one, never a torn file. With the same batches
(``get_batch(step)``) and eager execution on the CPU, a resumed run is bit-identical to an
uninterrupted one (``tests/training/test_checkpoint.py``).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autoprec._io import atomic_write
from autoprec.errors import AutoprecError
from autoprec.policy import Policy
from autoprec.training.scaler import DynamicLossScaler

__all__ = ["CHECKPOINT_FORMAT", "Checkpoint", "load_checkpoint", "peek_checkpoint", "rng_state",
           "save_checkpoint", "set_rng_state"]

#: Format version written under the ``"autoprec_checkpoint"`` key; loading rejects any other.
CHECKPOINT_FORMAT = 1
#: Marks an optimizer state gathered from a sharded run: keyed by parameter name
#: (torch.distributed.checkpoint's form), not by position as ``Optimizer.state_dict`` keys it.
GATHERED = "autoprec_gathered"


@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` restored besides the objects it loaded into.

    Attributes:
        step: Optimizer steps done before the save (resume with batch ``get_batch(step)``).
        policy: The saved policy, or None.
        extra: The caller's JSON-able counters.
    """

    step: int
    policy: Policy | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def rng_state() -> dict[str, Any]:
    """The torch CPU, CUDA (when available) and Python ``random`` generator states, in a form
    ``torch.load(weights_only=True)`` reads back (what a checkpoint saves; Lightning's plugin too)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(),
                             "python": [version, list(internal), gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the generator states :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _check_extra(path: str | os.PathLike, extra: dict[str, Any]) -> None:
    """Raise TypeError naming the first key of ``extra`` whose value ``json.dumps`` refuses."""
    for key, value in extra.items():
        try:
            json.dumps({key: value})
        except (TypeError, ValueError) as e:
            raise TypeError(f"save_checkpoint({os.fspath(path)}): extra[{key!r}] is not JSON-able ({e}); "
                            "extra holds ints, floats, strings, lists and dicts (a checkpoint loads with "
                            "weights_only=True); nothing was written") from e


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scaler: DynamicLossScaler | None = None, policy: Policy | None = None, step: int = 0,
                    extra: dict[str, Any] | None = None) -> None:
    """Write a checkpoint atomically to ``path`` (parent directories are created).

    Args:
        path: Checkpoint file (e.g. ``run/ckpt.pt``).
        model: The model (or :class:`~autoprec.MixedPrecisionModule`) whose ``state_dict`` to save;
            or what :func:`autoprec.ddp` returned (its module's keys are saved: the model's own);
            or the sharded root :func:`autoprec.shard` returned, on every rank (a collective: the
            full state is gathered to rank 0, which writes the file; other ranks write nothing).
        optimizer: Its optimizer.
        scaler: The loss scaler, if training uses one (call after ``update()``).
        policy: The policy trained with.
        step: Optimizer steps done so far.
        extra: JSON-able counters of the caller (ints, floats, strings, lists, dicts).

    Raises:
        OSError: the file system refused the write (an existing checkpoint at ``path`` is intact).
        TypeError: ``extra`` holds a value JSON cannot encode (the message names its key), which
            :func:`load_checkpoint`'s ``weights_only`` load would refuse; nothing is written.
    """
    _check_extra(path, extra or {})
    model = _own_keys(model)
    sharded = _sharded(model)
    ranks_rng: list[Any] | None = None
    if sharded:
        model_state, optimizer_state = _gathered(model, optimizer)
        ranks_rng = [None] * dist.get_world_size()
        dist.all_gather_object(ranks_rng, rng_state())  # each rank's stream (dropout differs per rank)
        if dist.get_rank() != 0:  # rank 0 holds the full state and writes it; the others wait below
            dist.barrier()  # so a load right after the save reads this file, not the one before
            return
    else:
        model_state, optimizer_state = model.state_dict(), optimizer.state_dict()
    payload = {
        "autoprec_checkpoint": CHECKPOINT_FORMAT,
        "model": model_state,
        "optimizer": optimizer_state,
        "scaler": scaler.state_dict() if scaler is not None else {},
        "policy": policy.to_json() if policy is not None else None,
        "step": int(step),
        "extra": dict(extra or {}),
        "rng": rng_state(),
        **({"rng_ranks": ranks_rng} if ranks_rng is not None else {}),
    }
    try:
        atomic_write(path, lambda f: torch.save(payload, f), binary=True)
    finally:
        if sharded:
            dist.barrier()  # the others return once the file is complete (or the write failed)


def _own_keys(model: nn.Module) -> nn.Module:
    """The module whose ``state_dict`` has the model's own keys: under ``DistributedDataParallel``
    (what :func:`autoprec.ddp` returns) its ``module``. DDP's own ``state_dict`` prefixes every key
    with ``module.`` and reaches past a :class:`~autoprec.MixedPrecisionModule`'s key mapping, so a
    file it wrote loaded neither into the DDP module that wrote it nor into the plain model."""
    while isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    return model


def _sharded(model: nn.Module) -> bool:
    """Whether ``model``'s Parameters are FSDP2 shards (``DTensor``: :func:`autoprec.shard`)."""
    if not dist.is_available() or not dist.is_initialized():
        return False
    from torch.distributed.tensor import DTensor
    return any(isinstance(p, DTensor) for p in model.parameters())


def _prefix(model: nn.Module) -> str:
    """What ``model``'s state-dict keys add before the wrapped model's (``"model."`` for the root
    :func:`autoprec.shard` returns: its ``state_dict_prefix``), so the file has the model's own keys."""
    return str(getattr(model, "state_dict_prefix", ""))


def _renamed(state: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    """``state`` (a model's, or an optimizer's keyed by parameter name: torch.distributed.checkpoint's
    form) with the key prefix ``old`` replaced by ``new``."""
    def key(k: Any) -> Any:
        return new + k[len(old):] if isinstance(k, str) and k.startswith(old) else k

    if "state" in state and "param_groups" in state:
        return {"state": {key(k): v for k, v in state["state"].items()},
                "param_groups": [{**g, "params": [key(p) for p in g["params"]]}
                                 for g in state["param_groups"]]}
    return {key(k): v for k, v in state.items()}


def _gathered(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """The full (unsharded) model and optimizer state of a sharded ``model`` on rank 0, on the CPU
    (``torch.distributed.checkpoint.state_dict.get_state_dict`` with ``full_state_dict=True,
    cpu_offload=True``; other ranks get empty dicts), keyed by the model's own names. A collective:
    every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    m, o = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return _renamed(m, _prefix(model), ""), ({GATHERED: True} | _renamed(o, _prefix(model), "") if o else {})


def _scatter(source: str, payload: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer | None,
             ) -> None:
    """Load a checkpoint of full state into a sharded ``model``: each rank keeps its shards
    (``set_model_state_dict`` / ``set_optimizer_state_dict`` with ``full_state_dict=True``; every
    rank reads the file). The optimizer state must be a sharded run's (keyed by parameter name).

    Raises:
        AutoprecError: the weights or the optimizer state do not match (names the path)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    state = payload["optimizer"]
    if optimizer is not None and not state.get(GATHERED):  # refused before any weight is loaded
        raise AutoprecError(f"{source}: its optimizer state was saved from an unsharded run (DDP, one "
                            "process: keyed by position), which a sharded optimizer cannot take; pass "
                            "optimizer=None to load its weights and start the optimizer afresh")
    try:
        set_model_state_dict(model, _renamed(payload["model"], "", _prefix(model)), options=opts)
    except (RuntimeError, KeyError, ValueError) as e:
        raise AutoprecError(f"{source}: model weights do not match this model: {e}") from e
    if optimizer is None:
        return
    state = {k: v for k, v in state.items() if k != GATHERED}
    try:
        set_optimizer_state_dict(model, optimizer, _renamed(state, "", _prefix(model)), options=opts)
    except (RuntimeError, KeyError, ValueError) as e:
        raise AutoprecError(f"{source}: optimizer state does not match this optimizer: {e}") from e


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    scaler: DynamicLossScaler | None = None, restore_rng: bool = True) -> Checkpoint:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model``, ``optimizer`` and ``scaler``.

    Loading uses ``torch.load(weights_only=True, map_location="cpu")``; tensors are copied into the
    existing parameters (in place: a :class:`MixedPrecisionModule` keeps reading the same tensors)
    and optimizer state is moved to the parameters' device by ``Optimizer.load_state_dict``.

    Args:
        path: Checkpoint file.
        model: Model to load the weights into (same architecture); or what :func:`autoprec.ddp`
            returned (loaded into its module); or the sharded root :func:`autoprec.shard` returned,
            on every rank (each keeps its shards of the full state).
        optimizer: Optimizer over ``model``'s parameters, or None to skip its state.
        scaler: Loss scaler to restore, or None. A checkpoint without scaler state leaves it as is.
        restore_rng: Restore the torch (CPU, CUDA) and Python RNG states.

    Returns:
        A :class:`Checkpoint` with the step counter, the saved policy and ``extra``.

    Raises:
        AutoprecError: the file is missing, not a checkpoint, of an unknown format version, or does
            not match the model (the message names the path and the problem).
        ValueError: the scaler state is invalid (from ``DynamicLossScaler.load_state_dict``).
    """
    source = os.fspath(path)
    payload = _read(source)
    model = _own_keys(model)
    if _sharded(model):
        _scatter(source, payload, model, optimizer)
    else:
        try:
            model.load_state_dict(payload["model"])
        except RuntimeError as e:
            raise AutoprecError(f"{source}: model weights do not match this model: {e}") from e
        if optimizer is not None:  # a sharded run's state, keyed by name, loads by position as well
            try:
                optimizer.load_state_dict({k: v for k, v in payload["optimizer"].items() if k != GATHERED})
            except (ValueError, KeyError) as e:
                raise AutoprecError(f"{source}: optimizer state does not match this optimizer: {e}") from e
    if scaler is not None and payload["scaler"]:
        scaler.load_state_dict(payload["scaler"])
    if restore_rng:  # a sharded run's file has every rank's stream: this rank's own
        ranks = payload.get("rng_ranks")
        own = ranks[dist.get_rank()] if ranks and _sharded(model) and dist.get_rank() < len(ranks) else None
        set_rng_state(own if own is not None else payload["rng"])
    return _meta(source, payload)


def peek_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """The step counter, policy and ``extra`` of a checkpoint, without loading it into anything.

    The file is memory-mapped (``torch.load(mmap=True)``), so the weights are not read: this is
    cheap enough to decide, before a model is built, whether a resumed run has anything left to do.

    Raises:
        AutoprecError: the file is missing, not a checkpoint, or of an unknown format version.
    """
    source = os.fspath(path)
    return _meta(source, _read(source, mmap=True))


def _read(source: str, mmap: bool = False) -> dict[str, Any]:
    """The checkpoint payload at ``source`` (weights_only, on the CPU), its format checked.

    Raises:
        AutoprecError: missing, not loadable, not an autoprec checkpoint, or of another format.
    """
    try:
        try:
            payload = torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
        except RuntimeError:
            if not mmap:
                raise
            # not torch.save's zip format, which mmap needs ("mmap can only be used with files saved
            # with ..."): read it whole, which loads an old-format file or names the real fault
            payload = torch.load(source, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise AutoprecError(f"{source}: no such checkpoint") from None
    except Exception as e:  # unpickling errors come in many types
        if (why := _not_torch_save(source)) is not None:  # torch's own message would be about pickles
            raise AutoprecError(f"{source}: not an autoprec checkpoint ({why})") from e
        raise AutoprecError(f"{source}: not a loadable autoprec checkpoint ({type(e).__name__}: {e})") from e
    if not isinstance(payload, dict) or "autoprec_checkpoint" not in payload:
        raise AutoprecError(f"{source}: not an autoprec checkpoint (no 'autoprec_checkpoint' key)")
    if payload["autoprec_checkpoint"] != CHECKPOINT_FORMAT:
        raise AutoprecError(f"{source}: checkpoint format {payload['autoprec_checkpoint']!r} is not "
                            f"supported; this autoprec reads format {CHECKPOINT_FORMAT}")
    return payload


def _not_torch_save(source: str) -> str | None:
    """Why ``source`` is no ``torch.save`` file at all (empty, or neither a zip archive nor a
    pickle by its first bytes), or None (it may be one, or cannot be read)."""
    try:
        with open(source, "rb") as f:
            head = f.read(8)
    except OSError:
        return None
    if not head:
        return "an empty file"
    if head.startswith(b"PK\x03\x04") or head.startswith(b"\x80"):
        return None
    return f"not a torch.save file: it begins {head!r}"


def _meta(source: str, payload: dict[str, Any]) -> Checkpoint:
    """The :class:`Checkpoint` (step, policy, extra) of a payload :func:`_read` returned."""
    policy = Policy.from_dict(json.loads(payload["policy"]), source=f"{source}:policy") \
        if payload["policy"] is not None else None
    return Checkpoint(step=int(payload["step"]), policy=policy, extra=dict(payload["extra"]))

