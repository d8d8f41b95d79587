"""Lightning adapter: a policy applied through a precision plugin (docs/architecture.md#runtime).

``Trainer(plugins=[AutoprecPrecision(policy)])`` trains a ``LightningModule`` whose inner model
(``self.model`` by default) computes as the policy says:

* :meth:`AutoprecPrecision.convert_module` (Lightning calls it in ``Strategy.setup``) routes the
  inner model's ``forward`` through :func:`autoprec.apply`'s :class:`~autoprec.MixedPrecisionModule`,
  built at the first training-mode call (after Lightning has moved the model to its device) on the
  plugin's ``example_batch``, or else on that call's batch. The inner model stays what it was: its
  Parameters (fp32 master weights), ``state_dict`` keys, ``.to()``, hooks and ``train()``/``eval()``
  are unchanged, so ``configure_optimizers`` and Lightning checkpoints see the model's own keys.
  In eval mode (validation, test, predict) it runs its own forward: the graph was captured for
  training (dropout on, ``use_cache=False``).
* For a policy with fp16 nodes the plugin owns the loss scaler ``make_scaler(policy)`` returns (a
  :class:`~autoprec.DynamicLossScaler`) and uses it as Lightning's ``MixedPrecision`` plugin uses
  ``torch.amp.GradScaler`` (lightning/pytorch/plugins/precision/amp.py): the loss is scaled in
  :meth:`~AutoprecPrecision.pre_backward`; :meth:`~AutoprecPrecision.optimizer_step` runs the
  closure, unscales (before ``on_before_optimizer_step`` and gradient clipping), steps unless a
  gradient is inf/NaN and updates the scale. bf16 and fp32 policies need no scaler and step as
  Lightning's default plugin does.
* The plugin's :meth:`~AutoprecPrecision.state_dict` (stored by Lightning under the key
  ``"AutoprecPrecision"`` of every full checkpoint) holds the scaler state, the policy and the RNG
  states (torch CPU and CUDA, Python ``random``), which Lightning's checkpoints do not carry;
  loading it restores all three, so with the same batches and eager execution on the CPU a run
  resumed with ``Trainer.fit(..., ckpt_path=...)`` is bit-identical to an uninterrupted one
  (``tests/integrations/test_lightning.py``).

* A policy with ``batching`` (``tune --global-batch``, :class:`autoprec.policy.Batching`) trains at
  its micro-batch and accumulation. Lightning's gradient accumulation is a ``Trainer`` setting the
  plugin can set, its batch size the user's ``DataLoader``'s, which the plugin cannot change: at the
  start of ``fit`` (:meth:`~AutoprecPrecision.convert_module`) a ``Trainer`` at Lightning's default
  ``accumulate_grad_batches=1`` is set to ``batching.accumulation`` with a warning that names both
  (passing ``accumulate_grad_batches=<accumulation>`` to the ``Trainer`` says so and silences it);
  another value, or a ``GradientAccumulationScheduler``, is refused; and every training forward of
  the inner model is checked against ``batching.micro_batch`` (the first must hold that many
  examples, a later one no more), so a ``DataLoader`` built with another ``batch_size`` is refused at
  the first step, naming both numbers. With manual optimization (``automatic_optimization =
  False``) the ``training_step`` accumulates, and the plugin warns that it cannot make it. A policy
  without ``batching`` leaves the ``Trainer`` and the batches as they are.

Requires the ``lightning`` extra (``pip install 'autoprec[lightning]'``); nothing else in autoprec
imports Lightning.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

try:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.apply_func import move_data_to_device
    from lightning.pytorch.callbacks import GradientAccumulationScheduler
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.exceptions import MisconfigurationException
except ImportError as e:  # pragma: no cover - the extra is installed in dev
    raise ImportError("autoprec.integrations.lightning needs Lightning (>= 2.2): "
                      "pip install 'autoprec[lightning]'") from e

from autoprec.applied.apply import MixedPrecisionModule, apply
from autoprec.errors import AutoprecError
from autoprec.integrations._batching import OPT_OUT, MicroBatchCheck, batching_fields
from autoprec.policy import Policy
from autoprec.training.checkpoint import rng_state, set_rng_state
from autoprec.training.monitor import first_nonfinite_node
from autoprec.training.scaler import DynamicLossScaler
from autoprec.training.train import make_scaler

__all__ = ["AutoprecPrecision"]


class AutoprecPrecision(Precision):
    """Lightning precision plugin that trains a ``LightningModule``'s inner model under a policy.

    Usage::

        policy = autoprec.Policy.load("policy.json")
        trainer = lightning.Trainer(plugins=[AutoprecPrecision(policy)], max_steps=1000)
        trainer.fit(lit_module)            # lit_module.model is the network it trains

    Args:
        policy: The dtype policy (:class:`autoprec.Policy`).
        example_batch: The batch to capture the graph on, as the inner model is called
            (a dict for ``model(**batch)``, a tuple for ``model(*batch)``, or a tensor); moved to
            the device of the model's parameters. None: the batch of the first training-mode
            call. With ``dynamic=True`` the captured batch fixes the largest batch size
            (docs/architecture.md#runtime), so pass the largest batch when sizes vary.
        compile: Compile the lowered graph with ``torch.compile`` (Inductor), as
            :func:`autoprec.apply` does.
        module: Attribute path of the inner model in the ``LightningModule`` (``"model"``,
            ``"backbone.lm"``: ``nn.Module.get_submodule``).
        dynamic: :func:`autoprec.apply`'s ``dynamic`` (batch size and sequence length may vary).
        placement: :func:`autoprec.apply`'s cast placement mode.
        restore_rng: Save the RNG states in the plugin's state and restore them on load.

    Attributes:
        policy: The policy.
        scaler: The :class:`~autoprec.DynamicLossScaler` (policies with fp16 nodes), else None.
        mp: The :class:`~autoprec.MixedPrecisionModule` once built (after the first training
            step), else None.

    With a policy that has ``batching`` (the module docstring): ``fit`` sets the ``Trainer``'s
    ``accumulate_grad_batches`` from Lightning's default 1 to ``batching.accumulation`` (warning),
    and refuses another value; the inner model's training forwards must get ``batching.micro_batch``
    examples (build the ``DataLoader`` with ``batch_size=micro_batch``).

    Raises:
        TypeError: ``policy`` is not a :class:`~autoprec.Policy`.
    """

    precision = "32-true"  # what Lightning reports: the parameters (master weights) stay fp32

    def __init__(self, policy: Policy, example_batch: Any = None, compile: bool = True, module: str = "model",
                 dynamic: bool = True, placement: str = "mincut", restore_rng: bool = True) -> None:
        if not isinstance(policy, Policy):
            raise TypeError("AutoprecPrecision(policy=...) expects an autoprec.Policy, got "
                            f"{type(policy).__name__}")
        self.policy = policy
        self.example_batch, self.compile, self.module = example_batch, bool(compile), module
        self.dynamic, self.placement, self.restore_rng = bool(dynamic), placement, bool(restore_rng)
        self.scaler: DynamicLossScaler | None = make_scaler(policy, diagnose=self._diagnose)
        self.mp: MixedPrecisionModule | None = None
        self._last_batch: Any = None
        batching = policy.batching
        self._micro_batch_check = None if batching is None else MicroBatchCheck(
            batching, "AutoprecPrecision", "the training DataLoader (or the training_step calling the model)",
            f"build the DataLoader with batch_size={batching.micro_batch}")
        self._fitting = False  # set by convert_module during fit: training forwards are checked
        self._trainer: weakref.ref[pl.Trainer] | None = None

    # ----------------------------------------------------------------- the model
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Route the inner model's forward through the policy (idempotent; Lightning calls it at
        every ``fit``/``validate``/``test``); returns ``module`` itself. In ``fit``, with a policy
        that has ``batching``, the Trainer's gradient accumulation is set or checked first
        (:meth:`_setup_batching`).

        Raises:
            AutoprecError: ``module`` has no submodule at the plugin's ``module`` path.
            ValueError: the Trainer accumulates otherwise than the policy's ``batching``.
        """
        inner = _inner(module, self.module)
        self._setup_batching(module)
        own = inner.__dict__.get("forward")
        if isinstance(own, _PolicyForward) and own.plugin is self:
            return module
        if isinstance(own, _PolicyForward):  # another plugin's: keep the model's own forward under ours
            own = own.orig
        if self.mp is not None and self.mp.model is not inner:
            self.mp = None
        inner.forward = _PolicyForward(self, inner, own if own is not None else inner.forward)
        return module

    def _setup_batching(self, module: nn.Module) -> None:
        """At the start of ``fit`` (``module`` attached to a fitting Trainer), with a policy that has
        ``batching``: the Trainer's ``accumulate_grad_batches`` is made the policy's ``accumulation``
        (set from Lightning's default 1, with a ``UserWarning``; left when equal), and the training
        forwards of this ``fit`` are checked against ``micro_batch``. Elsewhere it stops checking.

        Raises:
            ValueError: the Trainer has another ``accumulate_grad_batches`` than 1 or the policy's, or
                a ``GradientAccumulationScheduler`` callback; the message names the Trainer's value,
                the policy file's fields and the fix.
        """
        trainer = getattr(module, "_trainer", None)
        self._fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        batching = self.policy.batching
        if batching is None or not self._fitting:
            return
        self._trainer = weakref.ref(trainer)
        self._micro_batch_check.reset()
        want = batching.accumulation
        if not getattr(module, "automatic_optimization", True):
            if want > 1:
                warnings.warn(
                    f"autoprec: the policy file says {batching_fields(batching)}, and "
                    f"{type(module).__name__} uses manual optimization (automatic_optimization = False), "
                    "where Lightning does not accumulate: your training_step must call optimizer.step() "
                    f"once per {want} micro-batches of {batching.micro_batch} (the plugin checks only the "
                    "micro-batch)", UserWarning, stacklevel=2)
            return
        if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):
            raise ValueError(
                "AutoprecPrecision: a GradientAccumulationScheduler callback changes accumulate_grad_batches "
                f"during fit, and the policy file fixes it ({batching_fields(batching)}): remove the "
                f"callback and pass Trainer(accumulate_grad_batches={want}); {OPT_OUT}")
        have = trainer.accumulate_grad_batches
        if have == want:
            return
        if have != 1:
            raise ValueError(
                f"AutoprecPrecision: Trainer(accumulate_grad_batches={have}) accumulates otherwise than the "
                f"policy: the policy file says {batching_fields(batching)}; pass "
                f"Trainer(accumulate_grad_batches={want}); {OPT_OUT}")
        trainer.accumulate_grad_batches = want
        warnings.warn(
            f"autoprec: Trainer(accumulate_grad_batches=1), Lightning's default, set to {want}: the policy "
            f"file says {batching_fields(batching)}; pass Trainer(accumulate_grad_batches={want}) to say so "
            "(and silence this)", UserWarning, stacklevel=2)

    def _check_training_batch(self, batch: Any) -> None:
        """Check a training forward's batch against the policy's micro-batch (during ``fit``, with a
        policy that has ``batching``; :class:`~autoprec.integrations._batching.MicroBatchCheck`)."""
        if self._fitting and self._micro_batch_check is not None:
            self._micro_batch_check(batch)

    def teardown(self) -> None:
        """Lightning's teardown (the end of ``fit``/``validate``/``test``): later training-mode calls
        are no longer checked against the policy's micro-batch."""
        self._fitting = False
        super().teardown()

    def _module_for(self, inner: nn.Module, orig: Callable[..., Any], batch: Any) -> MixedPrecisionModule:
        """The :class:`MixedPrecisionModule` of ``inner``, built on first use (captured with the
        model's own ``forward`` in place, in training mode)."""
        if self.mp is None:
            example = self.example_batch if self.example_batch is not None else batch
            device = next((p.device for p in inner.parameters()), torch.device("cpu"))
            with _own_forward(inner, orig):
                self.mp = apply(inner, self.policy, move_data_to_device(example, device),
                                compile=self.compile, placement=self.placement, dynamic=self.dynamic)
        return self.mp

    def _diagnose(self) -> str | None:
        """The first node of the last training batch with a non-finite output (the scaler's floor
        error names it)."""
        if self.mp is None or self._last_batch is None:
            return None
        return first_nonfinite_node(self.mp.graph_module, self._last_batch)

    # ----------------------------------------------------------------- loss scaling
    def pre_backward(self, tensor: torch.Tensor,  # type: ignore[override]
                     module: pl.LightningModule) -> torch.Tensor:
        """Scale the loss (fp32) when the policy uses fp16, then Lightning's ``on_before_backward``."""
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    def optimizer_step(self, optimizer: Any, model: pl.LightningModule,  # type: ignore[override]
                       closure: Callable[[], Any], **kwargs: Any) -> Any:
        """One optimizer step: with a scaler, ``MixedPrecision``'s order (closure, ``unscale_``,
        ``on_before_optimizer_step`` and clipping on unscaled gradients, step skipped on inf/NaN,
        scale update); without one, Lightning's default step.

        Returns:
            The closure's result (the loss), as Lightning's ``Precision.optimizer_step``.

        Raises:
            MisconfigurationException: an LBFGS optimizer with a scaler (its step needs a closure,
                which a loss scaler cannot run, as with ``MixedPrecision``).
            LossScaleError: the scaler gave up at its floor (:meth:`DynamicLossScaler.update`).
            ValueError: with a policy that has ``batching``, the Trainer's ``accumulate_grad_batches``
                was changed during ``fit`` away from ``batching.accumulation``.
        """
        self._check_accumulation(model)
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, torch.optim.LBFGS):
            raise MisconfigurationException("AutoprecPrecision with an fp16 policy (loss scaling) and the "
                                            "LBFGS optimizer are not compatible.")
        closure_result = closure()
        # training_step returned None: no backward
        if closure_result is None and model.automatic_optimization:
            return closure_result
        self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return closure_result

    def _check_accumulation(self, model: Any) -> None:
        """ValueError when, during a ``fit`` with a policy that has ``batching`` and automatic
        optimization, the Trainer's ``accumulate_grad_batches`` is no longer the policy's (changed by
        a callback after :meth:`_setup_batching`)."""
        batching = self.policy.batching
        trainer = self._trainer() if self._trainer is not None else None
        if (batching is None or not self._fitting or trainer is None
                or not getattr(model, "automatic_optimization", True)):
            return
        if trainer.accumulate_grad_batches != batching.accumulation:
            raise ValueError(
                f"AutoprecPrecision: accumulate_grad_batches became {trainer.accumulate_grad_batches} during "
                f"fit (a callback changed it), and the policy file says {batching_fields(batching)}; "
                f"{OPT_OUT}")

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without a scaler)."""
        return self.scaler.get_scale() if self.scaler is not None else 1.0

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped on inf/NaN gradients so far (0 without a scaler)."""
        return self.scaler.skipped_steps if self.scaler is not None else 0

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What Lightning saves under ``"AutoprecPrecision"``: ``scaler`` (its state, or ``{}``),
        ``policy`` (JSON text) and ``rng`` (states at the save; absent with ``restore_rng=False``);
        plain tensors, strings and numbers (loads with ``torch.load(weights_only=True)``)."""
        state: dict[str, Any] = {"scaler": self.scaler.state_dict() if self.scaler is not None else {},
                                 "policy": self.policy.to_json()}
        if self.restore_rng:
            state["rng"] = rng_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s content: scaler state, RNG states (``restore_rng``).

        Raises:
            AutoprecError: the checkpoint was saved under another policy
                (:meth:`Policy.training_key` differs) or is not this plugin's state.
            ValueError: the scaler state is invalid (:meth:`DynamicLossScaler.load_state_dict`).
        """
        where = "checkpoint key 'AutoprecPrecision'"
        if not isinstance(state_dict, dict) or "policy" not in state_dict:
            raise AutoprecError(f"{where}: not an AutoprecPrecision state (no 'policy' entry)")
        saved = Policy.from_dict(json.loads(state_dict["policy"]), source=f"{where}:policy")
        if saved.training_key() != self.policy.training_key():
            raise AutoprecError(f"{where}: saved under a different policy than this plugin's "
                                f"({saved.summary()} vs {self.policy.summary()})")
        if self.scaler is not None and state_dict.get("scaler"):
            self.scaler.load_state_dict(state_dict["scaler"])
        if self.restore_rng and "rng" in state_dict:
            set_rng_state(state_dict["rng"])


class _PolicyForward:
    """The inner model's ``forward`` while the plugin is connected: the policy's graph in training
    mode, the model's own forward in eval mode; ``inspect.signature`` is the model's."""

    def __init__(self, plugin: AutoprecPrecision, inner: nn.Module, orig: Callable[..., Any]) -> None:
        self.plugin, self.orig = plugin, orig
        self._inner = inner
        functools.update_wrapper(self, orig)
        self.__signature__ = inspect.signature(orig)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inner = self._inner
        if not inner.training:
            return self.orig(*args, **kwargs)
        if args and kwargs:
            raise ValueError(f"AutoprecPrecision: {type(inner).__name__} was called with positional and "
                             "keyword arguments; autoprec graphs take a batch as model(**batch), "
                             "model(*batch) or model(batch) (docs/architecture.md#modelpy-contract): call it "
                             "one of these ways")
        batch = dict(kwargs) if kwargs else tuple(args)
        self.plugin._check_training_batch(batch)
        mp = self.plugin._module_for(inner, self.orig, batch)
        self.plugin._last_batch = batch
        with _own_forward(inner, self.orig):  # a batch outside the ranges captures the model again
            return mp(*args, **kwargs)


@contextlib.contextmanager
def _own_forward(inner: nn.Module, orig: Callable[..., Any]) -> Iterator[None]:
    """The model's own ``forward`` in place of the plugin's while autoprec captures it (the first
    capture, and a re-capture for a batch outside the captured ranges, ``autoprec.applied.recapture``):
    torch.export must trace the model, not the policy's graph that the plugin's forward calls."""
    ours = inner.__dict__["forward"]
    inner.forward = orig
    try:
        yield
    finally:
        inner.forward = ours


def _inner(module: nn.Module, path: str) -> nn.Module:
    """``module``'s submodule at ``path``, or an error naming both."""
    try:
        return module.get_submodule(path)
    except AttributeError:
        children = [name for name, _ in module.named_children()]
        raise AutoprecError(f"AutoprecPrecision(module={path!r}): {type(module).__name__} has no submodule "
                            f"{path!r} (its children: {children}); pass module='<attribute of the model to "
                            "train under the policy>'") from None
