"""Dynamic loss scaling for fp16 training, with a floor and a diagnosis (docs/architecture.md#runtime, cases
C07/C09/C14): :class:`DynamicLossScaler`, the GradScaler kernels it reproduces in Python, and the checks
of its configuration and of the state dicts it loads.

:class:`DynamicLossScaler` is a drop-in for :class:`torch.amp.GradScaler` (same method names, same
scale trajectory bit for bit, a compatible ``state_dict``) with four additions taken from DeepSpeed's
fp16 ``DynamicLossScaler`` (``min_loss_scale``), from torch's ``ShardedGradScaler`` and from failures
seen in practice:

* the scale is clamped to ``[min_scale, max_scale]``, so it can neither collapse to ~1e-15 while every
  step is skipped nor grow towards ``inf`` on a tiny loss (case C09);
* when the gradients stay non-finite with the scale already at its floor, the overflow is not a scaling
  problem: after ``max_skips_at_floor`` such steps a :class:`~autoprec.errors.LossScaleError` says
  where the non-finite values come from: the first forward node that produced one, or, where the
  forward pass is finite, a backward overflowing even unscaled, with what to do;
* the whole state (scale, growth tracker, skip counters) is plain JSON, so a resumed run continues
  bit-identically (case C14); a loaded state is validated whole before any of it is set;
* under ``torch.distributed`` (DDP, FSDP2) every rank makes the same decision: the inf/NaN flag of each
  ``unscale_`` is all-reduced (MAX) over the process group, so one rank's non-finite gradient (or
  gradient shard) makes every rank skip and back off together, as torch's ``ShardedGradScaler``
  (torch/distributed/fsdp/sharded_grad_scaler.py, ``unscale_``) does (:mod:`autoprec.training.rank_flag`).

:meth:`DynamicLossScaler.back_off_scales` lists the scales training's first steps try while they
overflow (``update``'s rule); the search for the one where they stop backing off, which a drift
measurement runs at, is :func:`autoprec.measure.backoff.search_back_off`. :func:`unscaled_grad_norm`
is the gradient norm to log or clip by after ``unscale_``.

Sources:
    * ``torch.amp.GradScaler`` (torch/amp/grad_scaler.py) and its ATen kernels
      ``_amp_foreach_non_finite_check_and_unscale_`` / ``_amp_update_scale_`` (the fused unscale is
      called through :func:`autoprec._torch_compat.amp_unscale_`).
    * DeepSpeed ``deepspeed/runtime/fp16/loss_scaler.py`` (``DynamicLossScaler``, ``min_loss_scale``).
    * ``torch.distributed.fsdp.ShardedGradScaler`` (found_inf all-reduced before the step).
"""

from __future__ import annotations

import enum
import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from autoprec._torch_compat import amp_unscale_, sparse_values
from autoprec.errors import LossScaleError
from autoprec.policy.loss_scaling import (
    BACKOFF_FACTOR,
    GROWTH_FACTOR,
    GROWTH_INTERVAL,
    INIT_SCALE,
    MAX_SCALE,
    MIN_SCALE,
    check_fp32_exact,
    check_loss_scaling,
    to_fp32,
)
from autoprec.training.rank_flag import any_rank, grad_device

__all__ = ["MAX_SKIPS_AT_FLOOR", "DynamicLossScaler", "nonfinite_steps_message", "unscaled_grad_norm"]

#: Default ``max_skips_at_floor``: consecutive skipped steps at ``min_scale`` before ``update``
#: raises (autoprec's choice; GradScaler has no floor, and its scale halved to ~1e-15 in 65 skipped
#: steps without a word, case C09). At the floor a further overflow cannot come from the scale, so it
#: comes from the forward pass; 8 lets a few bad batches in a row pass (a transient spike is skipped,
#: as GradScaler skips it) and stops a run whose every step is skipped within seconds.
MAX_SKIPS_AT_FLOOR = 8


class _OptState(enum.Enum):
    """Per-optimizer stage within one iteration (``torch.amp.grad_scaler.OptState``)."""

    READY = "ready"
    UNSCALED = "unscaled"
    STEPPED = "stepped"


_READY, _UNSCALED, _STEPPED = _OptState.READY, _OptState.UNSCALED, _OptState.STEPPED


class DynamicLossScaler:
    """Dynamic loss scaler with ``torch.amp.GradScaler`` semantics plus a floor, a cap and a diagnosis.

    Usage is GradScaler's::

        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)          # optional, e.g. before clipping
        applied = scaler.step(optimizer)    # False: non-finite grads, step skipped
        scaler.update()

    To have the floor error name the node that produced the first inf/NaN, wire a
    :class:`~autoprec.training.monitor.Monitor` in (``mp`` is what ``autoprec.apply`` returned)::

        monitor = autoprec.Monitor(graph_module=mp.graph_module)
        scaler = DynamicLossScaler(diagnose=monitor.diagnoser())
        for batch in batches:
            monitor.last_batch = batch      # the batch diagnose() re-runs if update() gives up
            ...                             # forward, scale(loss).backward(), step, update

    The scale is kept as a float32 value, and ``update`` reproduces the kernel ``_amp_update_scale_``
    exactly (so, with the floor and cap not binding, the trajectory equals GradScaler's): on a step
    with inf/NaN gradients the scale is multiplied by ``backoff_factor`` and the growth tracker reset;
    after ``growth_interval`` consecutive clean steps it is multiplied by ``growth_factor``. The result
    is then clamped to ``[min_scale, max_scale]`` (DeepSpeed's ``min_loss_scale``).

    Defaults and valid ranges: :mod:`autoprec.policy.loss_scaling` (the one home shared with the
    policy's ``loss_scaling`` block; GradScaler's defaults, from the PyTorch AMP docs
    https://pytorch.org/docs/stable/amp.html#torch.amp.GradScaler, plus autoprec's floor and cap).

    Args:
        init_scale: Initial scale (rounded to float32, like GradScaler).
        growth_factor: Factor (> 1) applied after ``growth_interval`` clean steps.
        backoff_factor: Factor in (0, 1) applied on a step with non-finite gradients.
        growth_interval: Number (>= 1) of consecutive clean steps between growths.
        min_scale: Floor of the scale (> 0, exactly representable in float32).
        max_scale: Cap of the scale (<= float32 max, exactly representable in float32).
        max_skips_at_floor: Consecutive skipped steps with the scale at ``min_scale`` after which
            ``update`` raises :class:`~autoprec.errors.LossScaleError` (default
            :data:`MAX_SKIPS_AT_FLOOR`, 8: why there).
        enabled: If False, ``scale`` is the identity, ``step`` a plain ``optimizer.step()``, and
            ``unscale_``/``update``/``load_state_dict`` do nothing (like GradScaler).
        diagnose: Optional zero-argument callable returning the key of the first graph node that
            produced a non-finite value, or None: typically ``Monitor(graph_module=...).diagnoser()``
            (re-runs ``monitor.last_batch`` through the graph), or e.g.
            ``lambda: autoprec.training.monitor.first_nonfinite_node(mp.graph_module, batch)``.
            Called only when the error above is raised; if it raises, the error says so instead.
        process_group: The ``torch.distributed`` group whose ranks must agree: None (default) is the
            default group whenever ``torch.distributed`` is initialised at ``unscale_`` time (no
            communication otherwise, or in a group of one rank). Each ``unscale_`` then all-reduces
            its flag (MAX, one 0-dim fp32 tensor: on the current CUDA device under NCCL, else on the
            gradients' device), so every rank of the group must call it for the same optimizers in
            the same order, as DDP and FSDP2 training loops do.

    Raises:
        ValueError: An argument is out of range; the message names it
            (:class:`~autoprec.policy.loss_scaling.LossScalingValueError` for the scale settings).
    """

    def __init__(self, init_scale: float = INIT_SCALE, growth_factor: float = GROWTH_FACTOR,
                 backoff_factor: float = BACKOFF_FACTOR, growth_interval: int = GROWTH_INTERVAL,
                 min_scale: float = MIN_SCALE, max_scale: float = MAX_SCALE,
                 max_skips_at_floor: int = MAX_SKIPS_AT_FLOOR, enabled: bool = True,
                 diagnose: Callable[[], str | None] | None = None, process_group: Any = None) -> None:
        (scale, self._growth_factor, self._backoff_factor, self._growth_interval, self._min_scale,
         self._max_scale, self._max_skips_at_floor) = _check_config(
            "init_scale", init_scale, growth_factor, backoff_factor, growth_interval, min_scale,
            max_scale, max_skips_at_floor)
        if diagnose is not None and not callable(diagnose):
            raise ValueError(f"diagnose must be a zero-argument callable or None, got {diagnose!r}")
        self._enabled = bool(enabled)
        self._diagnose = diagnose
        self._process_group = process_group
        self._scale = to_fp32(scale)  # always a float32 value held in a Python float
        self._growth_tracker = 0
        self._skipped_steps = 0
        self._consecutive_skips = 0
        self._skips_at_floor = 0
        self._found_inf = False
        self._per_optimizer: dict[int, dict[str, Any]] = {}

    # ----------------------------------------------------------------- GradScaler API
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """Returns ``loss * scale`` computed in fp32 (``loss`` unchanged if disabled).

        Raises:
            TypeError: ``loss`` is not a Tensor.
        """
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"scale() expects a Tensor, got {type(loss).__name__}")
        if not self._enabled:
            return loss
        return loss.float() * self._scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divides the optimizer's gradients by the scale in place (fp32) and records inf/NaN.

        Call at most once per optimizer per iteration, before ``step`` (e.g. to clip gradients).

        Raises:
            RuntimeError: Called twice for this optimizer since the last ``update()``, or after ``step``.
        """
        if not self._enabled:
            return
        state = self._per_optimizer.setdefault(id(optimizer), {"stage": _READY, "found_inf": False})
        if state["stage"] == _UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] == _STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        found_inf = _unscale_grads_(optimizer, 1.0 / self._scale)
        state["found_inf"] = any_rank(found_inf, self._process_group, grad_device(optimizer))
        state["stage"] = _UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> bool:
        """Unscales (if not yet done), then ``optimizer.step(*args, **kwargs)`` unless grads are non-finite.

        A skipped step leaves parameters and optimizer state bitwise unchanged.

        Returns:
            True if the optimizer step was applied, False if it was skipped.

        Raises:
            RuntimeError: ``step`` was already called since the last ``update()``, or a ``closure``
                was passed (as GradScaler, closures are not supported).
        """
        if not self._enabled:
            optimizer.step(*args, **kwargs)
            return True
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not supported if DynamicLossScaler is enabled.")
        state = self._per_optimizer.get(id(optimizer))
        if state is not None and state["stage"] == _STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state is None or state["stage"] == _READY:
            self.unscale_(optimizer)
            state = self._per_optimizer[id(optimizer)]
        state["stage"] = _STEPPED
        if state["found_inf"]:
            return False
        optimizer.step(*args, **kwargs)
        return True

    def update(self) -> None:
        """Updates the scale from this iteration's inf checks (GradScaler's rule, then the clamp).

        Raises:
            RuntimeError: No ``unscale_``/``step`` was recorded since the last ``update()``.
            LossScaleError: ``max_skips_at_floor`` consecutive steps were skipped at ``min_scale``.
        """
        if not self._enabled:
            return
        if not self._per_optimizer:
            raise RuntimeError("No inf checks were recorded prior to update(); call step(optimizer) first.")
        found_inf = any(s["found_inf"] for s in self._per_optimizer.values())
        self._per_optimizer = {}
        self._found_inf = found_inf
        at_floor = self._scale <= self._min_scale
        scale, self._growth_tracker = _update_scale(
            self._scale, self._growth_tracker, found_inf, self._growth_factor, self._backoff_factor,
            self._growth_interval)
        self._scale = min(max(scale, self._min_scale), self._max_scale)
        if not found_inf:
            self._consecutive_skips = self._skips_at_floor = 0
            return
        self._skipped_steps += 1
        self._consecutive_skips += 1
        self._skips_at_floor = self._skips_at_floor + 1 if at_floor else 0
        if self._skips_at_floor >= self._max_skips_at_floor:
            raise LossScaleError(self._floor_message())

    def _floor_message(self) -> str:
        return nonfinite_steps_message(
            f"{self._skips_at_floor} consecutive optimizer steps were skipped with the loss scale at "
            f"its floor (min_scale={self._min_scale!r}): the gradients are inf/NaN even at the minimum "
            "scale, so no scale within its bounds avoids them.", self._diagnose,
            f": a gradient beyond its dtype's range even at scale {self._min_scale!r} (fp16's largest is "
            "65504), e.g. from a large loss (a sum over many terms). What to do: make the loss smaller (a "
            "mean instead of a sum), let the scale go below 1 (loss_scaling.min_scale in the policy file, "
            "e.g. 0.0009765625 = 2**-10), or keep the ops whose gradients overflow in bf16 or fp32 (a rule "
            "in the policy file)")

    def get_scale(self) -> float:
        """The current scale as a Python float (a float32 value); 1.0 if disabled, like GradScaler."""
        return self._scale if self._enabled else 1.0

    def is_enabled(self) -> bool:
        """Whether scaling is enabled."""
        return self._enabled

    @property
    def found_inf(self) -> bool:
        """Whether the gradients of the current (or else the last updated) iteration had inf/NaN."""
        if self._per_optimizer:
            return any(s["found_inf"] for s in self._per_optimizer.values())
        return self._found_inf

    @property
    def skipped_steps(self) -> int:
        """Total number of skipped iterations."""
        return self._skipped_steps

    @property
    def consecutive_skips(self) -> int:
        """Number of skipped iterations since the last clean one."""
        return self._consecutive_skips

    @property
    def skips_at_floor(self) -> int:
        """Number of consecutive skipped iterations that ran with the scale at ``min_scale``."""
        return self._skips_at_floor

    # ----------------------------------------------------------------- back-off
    def back_off_scales(self, max_backoffs: int) -> list[float]:
        """The scales training's first steps would try from here while every step overflows.

        ``s_0`` is the current scale and ``s_{j+1}`` the scale after one more skipped step:
        ``update``'s rule (``torch.amp.GradScaler``'s halving, ``s_j · backoff_factor`` rounded to
        float32, then clamped to ``min_scale``), until ``min_scale`` or ``max_backoffs`` back-offs.

        Args:
            max_backoffs: The most back-offs (≥ 0).

        Returns:
            ``[s_0, ..., s_J]``, J ≤ ``max_backoffs``, strictly decreasing; ``[]`` if disabled.
        """
        if not self._enabled:
            return []
        scales = [self._scale]
        while scales[-1] > self._min_scale and len(scales) <= max_backoffs:
            s, _tracker = _update_scale(scales[-1], 0, True, self._growth_factor, self._backoff_factor,
                                        self._growth_interval)
            scales.append(max(s, self._min_scale))
        return scales

    # ----------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """The scaler state as plain JSON-able Python floats/ints ({} if disabled, like GradScaler).

        Keys shared with ``GradScaler.state_dict()``: ``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``; added: ``min_scale``, ``max_scale``,
        ``max_skips_at_floor``, ``skipped_steps``, ``consecutive_skips``, ``skips_at_floor``.
        Call it after ``update()``.
        """
        if not self._enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": self._growth_tracker, "min_scale": self._min_scale,
                "max_scale": self._max_scale, "max_skips_at_floor": self._max_skips_at_floor,
                "skipped_steps": self._skipped_steps, "consecutive_skips": self._consecutive_skips,
                "skips_at_floor": self._skips_at_floor}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores a state from :meth:`state_dict` exactly (``state_dict()`` then equals it).

        A ``GradScaler.state_dict()`` is accepted too: missing autoprec keys keep this scaler's
        ``min_scale``/``max_scale``/``max_skips_at_floor`` and set the skip counters to 0.
        Nothing is changed unless the whole dict is valid. No-op if disabled, like GradScaler.

        Raises:
            ValueError: The dict is empty, has an unknown or missing key, or an invalid value
                (e.g. a scale outside ``[min_scale, max_scale]`` or not a float32 value); the
                message names the key.
        """
        if not self._enabled:
            return
        own = {"min_scale": self._min_scale, "max_scale": self._max_scale,
               "max_skips_at_floor": self._max_skips_at_floor}
        config, counters = _check_state(state_dict, own)
        (self._scale, self._growth_factor, self._backoff_factor, self._growth_interval, self._min_scale,
         self._max_scale, self._max_skips_at_floor) = config
        self._growth_tracker, self._skipped_steps, self._consecutive_skips, self._skips_at_floor = counters


def nonfinite_steps_message(head: str, diagnose: Callable[[], str | None] | None, backward: str = "") -> str:
    """``head`` (why the steps are given up: case C09) and where the non-finite values start: the
    first forward node ``diagnose()`` names (e.g. :meth:`autoprec.Monitor.diagnoser`, whose
    ``source_of`` adds the model's line that made it); where it finds none (the forward pass of the
    batch it re-ran is finite), the backward pass, with ``backward`` (what overflows there and what
    to do, for a loss-scaled policy); without a ``diagnose``, how to find the node."""
    hint = ("To name the first node that produced one, create "
            "monitor = autoprec.Monitor(graph_module=mp.graph_module) (mp: the module autoprec.apply "
            "returned), pass diagnose=monitor.diagnoser() to DynamicLossScaler and set "
            "monitor.last_batch = batch before each step; or call "
            "autoprec.training.monitor.first_nonfinite_node(mp.graph_module, batch) on a batch that "
            "overflows (it returns the node's key).")
    forward = "the forward pass (an op overflowing its dtype, or inf/NaN in the inputs or weights)"
    if diagnose is None:
        also = ", or from the backward pass" if backward else ""
        return f"{head} They come from {forward}{also}. {hint}"
    try:
        node = diagnose()
    except Exception as e:  # noqa: BLE001 - a failing diagnosis must not hide the real error
        return f"{head} They come from {forward}; diagnose() failed ({e!r}). {hint}"
    if node is None:
        return (f"{head} The forward pass of the last batch, run again, has no non-finite output, so they "
                f"arise in the backward pass (unless another batch overflowed){backward}.")
    source = getattr(diagnose, "source_of", None)  # Monitor.diagnoser()'s: the model's line of a node
    src = source(str(node)) if callable(source) else None
    where = f" (from {src})" if src else ""
    return (f"{head} They come from the forward pass. First node that produced a non-finite value: "
            f"{str(node)!r}{where}.")


# ----------------------------------------------------------------- GradScaler's kernels in Python
# The scale update rule, the fused unscale and the gradient norm (torch/amp/grad_scaler.py).
def _update_scale(scale: float, tracker: int, found_inf: bool, growth_factor: float,
                  backoff_factor: float, growth_interval: int) -> tuple[float, int]:
    """One step of GradScaler's ATen kernel ``_amp_update_scale_``, bit for bit.

    The kernel multiplies the float32 scale by the (double) factor in double precision and rounds the
    product to float32; a growth that would overflow float32 to ``inf`` is dropped (the scale is kept)
    but still resets the tracker.
    """
    if found_inf:
        return to_fp32(scale * backoff_factor), 0
    tracker += 1
    if tracker == growth_interval:
        grown = to_fp32(scale * growth_factor)
        return (grown if math.isfinite(grown) else scale), 0
    return scale, tracker


def _grads_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The dense gradient tensors of every parameter in ``optimizer.param_groups`` (coalesced if sparse)."""
    grads = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is None:
                continue
            if param.grad.is_sparse:
                if not param.grad.is_coalesced():
                    param.grad = param.grad.coalesce()  # duplicates are summed before the check
                grads.append(sparse_values(param.grad))
            else:
                grads.append(param.grad)
    return grads


def _unscale_grads_(optimizer: torch.optim.Optimizer, inv_scale: float) -> bool:
    """Multiplies every gradient by ``inv_scale`` in place (computed in fp32); True if any is inf/NaN."""
    by_device_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for grad in _grads_of(optimizer):
        by_device_dtype[(grad.device, grad.dtype)].append(grad)
    found = []
    with torch.no_grad():
        for (device, _), grads in by_device_dtype.items():
            found_inf = torch.zeros((), dtype=torch.float32, device=device)
            inv = torch.full((), inv_scale, dtype=torch.float32, device=device)
            # GradScaler's fused kernel: flags non-finite values, then grad = float(grad) * inv.
            amp_unscale_(grads, found_inf, inv)
            found.append(found_inf)
    return any(bool(f.item()) for f in found)


def unscaled_grad_norm(parameters: torch.Tensor | Iterable[torch.Tensor]) -> float:
    """Total L2 norm of the parameters' gradients, computed in fp32; ``inf`` if any is inf/NaN.

    Call it after ``DynamicLossScaler.unscale_`` so the norm is that of the true gradients (as
    ``torch.nn.utils.clip_grad_norm_`` would see them). Parameters without a gradient are ignored.

    Args:
        parameters: A tensor or an iterable of tensors (e.g. ``model.parameters()``).

    Returns:
        ``sqrt(sum_i ||grad_i||_2^2)`` as a Python float (0.0 if no parameter has a gradient);
        ``math.inf`` if any gradient element is non-finite (or the fp32 norm overflows).
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    norms = []
    for p in parameters:
        grad = p.grad
        if grad is None:
            continue
        if grad.is_sparse:
            grad = sparse_values(grad.coalesce())
        norms.append(torch.linalg.vector_norm(grad.detach(), 2, dtype=torch.float32))
    if not norms:
        return 0.0
    device = norms[0].device
    total = float(torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), 2))
    return total if math.isfinite(total) else math.inf


# ----------------------------------------------------------------- configuration and state checks
# Every value is validated before any is set, each error naming its key. The scale settings are
# checked by the policy's loss-scaling rules (:func:`autoprec.policy.loss_scaling.check_loss_scaling`,
# the one home of their ranges); the skip counters and the growth tracker against each other here.
#: Keys ``GradScaler.state_dict()`` writes (required on load).
_GRADSCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
#: Keys autoprec adds (optional on load).
_AUTOPREC_KEYS = ("min_scale", "max_scale", "max_skips_at_floor", "skipped_steps", "consecutive_skips",
                  "skips_at_floor")

#: ``(scale, growth_factor, backoff_factor, growth_interval, min_scale, max_scale, max_skips_at_floor)``.
_Config = tuple[float, float, float, int, float, float, int]
#: ``(growth_tracker, skipped_steps, consecutive_skips, skips_at_floor)``.
_Counters = tuple[int, int, int, int]


def _as_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")  # noqa: TRY004 (bad value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return value


def _check_config(scale_name: str, scale: Any, growth_factor: Any, backoff_factor: Any,
                  growth_interval: Any, min_scale: Any, max_scale: Any, max_skips_at_floor: Any) -> _Config:
    """The scaler's configuration, validated with the policy's loss-scaling ranges
    (:func:`autoprec.policy.loss_scaling.check_loss_scaling`; the scale named ``scale_name``).

    Raises:
        ValueError: a value is out of range; the message names the argument.
    """
    v = check_loss_scaling({scale_name: scale, "growth_factor": growth_factor,
                            "backoff_factor": backoff_factor, "growth_interval": growth_interval,
                            "min_scale": min_scale, "max_scale": max_scale}, scale_name=scale_name)
    max_skips_at_floor = _as_int("max_skips_at_floor", max_skips_at_floor, 1)
    return (v[scale_name], v["growth_factor"], v["backoff_factor"], v["growth_interval"], v["min_scale"],
            v["max_scale"], max_skips_at_floor)


def _check_state(state_dict: dict[str, Any], defaults: dict[str, Any]) -> tuple[_Config, _Counters]:
    """A state dict's configuration and counters, validated (nothing is set here).

    Args:
        state_dict: A ``DynamicLossScaler.state_dict()`` or a ``GradScaler.state_dict()``.
        defaults: The loading scaler's ``min_scale``, ``max_scale`` and ``max_skips_at_floor``, used
            for keys a ``GradScaler`` state lacks (its skip counters then start at 0).

    Raises:
        ValueError: The dict is empty, has an unknown or missing key, or an invalid value (e.g. a
            scale outside ``[min_scale, max_scale]`` or not a float32 value); the message names the key.
    """
    if not state_dict:
        raise ValueError("the scaler state dict is empty, possibly because it was saved from a "
                         "disabled scaler")
    unknown = sorted(set(state_dict) - set(_GRADSCALER_KEYS) - set(_AUTOPREC_KEYS))
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} in scaler state dict; valid keys: "
                         f"{list(_GRADSCALER_KEYS + _AUTOPREC_KEYS)}")
    missing = [k for k in _GRADSCALER_KEYS if k not in state_dict]
    if missing:
        raise ValueError(f"missing key {missing[0]!r} in scaler state dict")
    d = {**defaults, "skipped_steps": 0, "consecutive_skips": 0, "skips_at_floor": 0, **state_dict}
    config = _check_config("scale", d["scale"], d["growth_factor"], d["backoff_factor"],
                          d["growth_interval"], d["min_scale"], d["max_scale"], d["max_skips_at_floor"])
    check_fp32_exact("scale", config[0])
    return config, _check_counters(d, growth_interval=config[3])


def _check_counters(d: dict[str, Any], growth_interval: int) -> _Counters:
    """Validates the tracker and skip counters of a state dict against each other."""
    tracker = _as_int("_growth_tracker", d["_growth_tracker"], 0)
    if tracker >= growth_interval:
        raise ValueError(f"_growth_tracker must be < growth_interval ({growth_interval}), got {tracker}")
    skipped = _as_int("skipped_steps", d["skipped_steps"], 0)
    consecutive = _as_int("consecutive_skips", d["consecutive_skips"], 0)
    if consecutive > skipped:
        raise ValueError(f"consecutive_skips ({consecutive}) must be <= skipped_steps ({skipped})")
    if consecutive and tracker:
        raise ValueError(f"_growth_tracker must be 0 after a skipped step (consecutive_skips={consecutive}), "
                         f"got {tracker}")
    at_floor = _as_int("skips_at_floor", d["skips_at_floor"], 0)
    if at_floor > consecutive:
        raise ValueError(f"skips_at_floor ({at_floor}) must be <= consecutive_skips ({consecutive})")
    return tracker, skipped, consecutive, at_floor
