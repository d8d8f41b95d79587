"""Hugging Face ``Trainer`` with an autoprec policy (docs/architecture.md#runtime).

A bf16 or fp32 policy needs nothing here: ``transformers.Trainer(model=autoprec.apply(model, policy,
batch), ...)`` trains the module as it is (it reports the model's forward signature, ``config`` and
``state_dict``: :class:`autoprec.MixedPrecisionModule`). A policy with fp16 nodes needs a dynamic
loss scaler, and the optimizer step is not something Trainer's callbacks can change (they run
before and after it, never instead of it), hence :class:`AutoprecTrainer`.

How it hooks in: Trainer drives its backward pass and optimizer step through ``accelerate``, which
already has GradScaler's protocol (``Accelerator.backward`` calls ``scaler.scale(loss).backward()``;
``AcceleratedOptimizer.step`` calls ``scaler.step(optimizer)`` then ``scaler.update()`` and reports
a skipped step as ``optimizer_step_was_skipped``, which also holds the learning-rate schedule back;
Trainer saves and resumes ``accelerator.scaler``'s ``state_dict`` as ``scaler.pt`` in its checkpoints).
:class:`AutoprecTrainer` puts the policy's :class:`autoprec.DynamicLossScaler` there
(``autoprec.training.train.make_scaler``) and unscales the gradients before Trainer clips them or
measures their norm, so the order of a step is :class:`autoprec.training.train.TrainStep`'s.

A policy with ``batching`` (``tune --global-batch``, :class:`autoprec.policy.Batching`) trains at
``per_device_train_batch_size = micro_batch`` and ``gradient_accumulation_steps = accumulation``.
``TrainingArguments`` are the user's object, so nothing here changes them behind the user's back:
:func:`with_policy_batching` returns a copy that says so, :class:`AutoprecTrainer` builds Trainer's
default arguments with those values when given none and refuses arguments that say otherwise
(:func:`check_batching`), and it checks the examples of each training batch against the micro-batch
(a custom ``get_train_dataloader`` or collator that changes it is refused at the first step). The
stock ``transformers.Trainer`` never reads the policy: pass it ``with_policy_batching(args, policy)``.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import warnings
from collections.abc import Iterator
from typing import Any

import torch

try:
    import transformers
except ImportError as e:  # pragma: no cover - the extra is installed in dev
    raise ImportError("autoprec.integrations.transformers needs transformers and accelerate: "
                      "pip install 'autoprec[transformers]'") from e

from autoprec.applied.apply import MixedPrecisionModule
from autoprec.integrations._batching import OPT_OUT, MicroBatchCheck, batching_fields
from autoprec.policy import Batching, Policy
from autoprec.training.scaler import DynamicLossScaler
from autoprec.training.train import make_scaler

__all__ = ["AutoprecTrainer", "check_batching", "check_training_args", "with_policy_batching"]

#: The output directory ``transformers.Trainer`` gives the ``TrainingArguments`` it builds when given none.
_DEFAULT_OUTPUT_DIR = "tmp_trainer"

#: TrainingArguments flags that cast or autocast the model, with what each would do to a policy.
_PRECISION_FLAGS = {
    "bf16": "runs every forward under torch.autocast(bfloat16)",
    "fp16": "runs every forward under torch.autocast(float16) with torch's own GradScaler",
    "bf16_full_eval": "casts the weights to bfloat16 for evaluation",
    "fp16_full_eval": "casts the weights to float16 for evaluation",
}


def check_training_args(args: Any, what: str = "AutoprecTrainer") -> None:
    """Refuse ``TrainingArguments`` that would change the dtypes a policy sets, or its graph.

    Args:
        args: ``transformers.TrainingArguments`` (or None: Trainer's defaults, which pass).
        what: How the message names the caller.

    Raises:
        ValueError: ``bf16``, ``fp16``, ``bf16_full_eval`` or ``fp16_full_eval`` is True (the policy
            already sets each node's dtype), or ``gradient_checkpointing``/``activation_checkpointing``
            is True (the graph is captured already; the policy's ``activation_memory_budget`` is
            autoprec's equivalent), or ``neftune_noise_alpha`` is set (its hook on the embedding
            module does not run inside the graph). The message names the flag.
    """
    if args is None:
        return
    for flag, effect in _PRECISION_FLAGS.items():
        if getattr(args, flag, False):
            raise ValueError(
                f"{what}: TrainingArguments({flag}=True) together with a policy-applied model: Trainer "
                f"{effect}, overriding the dtypes the policy sets for each node. Pass bf16=False and "
                "fp16=False (the defaults); the policy decides the precision, and AutoprecTrainer adds the "
                "loss scaler a policy with fp16 nodes needs.")
    if getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False):
        raise ValueError(
            f"{what}: TrainingArguments(gradient_checkpointing=True) (or activation_checkpointing=True): "
            "gradient checkpointing cannot be switched on after autoprec.apply (the graph is captured and "
            "lowered already). Pass gradient_checkpointing=False and activation_checkpointing=False; to "
            "trade compute for activation memory, give the policy an activation_memory_budget below 1.0 and "
            "apply with compile=True, or, on a model with dropout (where a memory budget is refused: "
            "pytorch/pytorch#190758), save activations in low precision with the rules' 'saved' "
            "(autoprec tune --max-memory picks either; docs/architecture.md#policy-file).")
    if getattr(args, "neftune_noise_alpha", None):
        raise ValueError(
            f"{what}: TrainingArguments(neftune_noise_alpha={args.neftune_noise_alpha}): NEFTune adds its "
            "noise through a forward hook on the input embedding module, which the captured graph never "
            "calls (it reads the module's weight), so the noise would be dropped. Pass "
            "neftune_noise_alpha=None.")


def with_policy_batching(args: Any, policy: Policy) -> Any:
    """``TrainingArguments`` that train at the policy's batching (``Policy.batching``).

    Args:
        args: ``transformers.TrainingArguments``, or None for the ones ``transformers.Trainer`` builds
            when given none (``output_dir="tmp_trainer"``, every other field at its default).
        policy: The policy (``mp.policy`` of the applied module).

    Returns:
        Without ``policy.batching``: ``args`` itself (None stays None). With it: a shallow copy of
        ``args`` whose ``per_device_train_batch_size`` is ``batching.micro_batch`` (examples per
        forward, per device) and whose ``gradient_accumulation_steps`` is ``batching.accumulation``;
        ``args`` itself is left as it was. Each process then steps on ``micro_batch *
        accumulation`` examples, the policy's global batch (times the processes under DDP).

    Raises:
        ValueError: ``args.auto_find_batch_size`` is True (it would halve the micro-batch after an
            out-of-memory error); the message names both.
    """
    batching = policy.batching
    if batching is None:
        return args
    if args is None:
        args = transformers.TrainingArguments(output_dir=_DEFAULT_OUTPUT_DIR)
    else:
        _refuse_auto_batch(args, batching, "with_policy_batching")
        args = copy.copy(args)
    args.per_device_train_batch_size = batching.micro_batch
    args.gradient_accumulation_steps = batching.accumulation
    return args


def check_batching(args: Any, policy: Policy, what: str = "AutoprecTrainer") -> None:
    """Refuse ``TrainingArguments`` that would train at another batch than the policy's ``batching``.

    Args:
        args: ``transformers.TrainingArguments`` (None passes: :class:`AutoprecTrainer` then builds
            them with :func:`with_policy_batching`).
        policy: The policy; one without ``batching`` passes any arguments.
        what: How the message names the caller.

    Raises:
        ValueError: ``per_device_train_batch_size`` is not ``batching.micro_batch``,
            ``gradient_accumulation_steps`` is not ``batching.accumulation``, or
            ``auto_find_batch_size`` is True. The message names the policy file's fields and values,
            the arguments' values and the fix (:func:`with_policy_batching`).
    """
    batching = policy.batching
    if batching is None or args is None:
        return
    _refuse_auto_batch(args, batching, what)
    ours = (args.per_device_train_batch_size, args.gradient_accumulation_steps)
    if ours != (batching.micro_batch, batching.accumulation):
        raise ValueError(
            f"{what}: TrainingArguments(per_device_train_batch_size={ours[0]}, gradient_accumulation_steps="
            f"{ours[1]}) train at another batch than the policy's: the policy file says "
            f"{batching_fields(batching)}. Pass args=with_policy_batching(args, policy) "
            "(autoprec.integrations.transformers), which sets per_device_train_batch_size="
            f"{batching.micro_batch} and gradient_accumulation_steps={batching.accumulation}, or set them so "
            f"yourself; {OPT_OUT}")


def _refuse_auto_batch(args: Any, batching: Batching, what: str) -> None:
    """ValueError when ``args.auto_find_batch_size`` would change the policy's micro-batch."""
    if getattr(args, "auto_find_batch_size", False):
        raise ValueError(
            f"{what}: TrainingArguments(auto_find_batch_size=True) halves per_device_train_batch_size after "
            "an out-of-memory error, and the policy file fixes the micro-batch "
            f"({batching_fields(batching)}): pass auto_find_batch_size=False; {OPT_OUT}")


def _stock_passes_num_items(model: torch.nn.Module) -> bool:
    """Whether stock ``Trainer`` would pass ``model`` ``num_items_in_batch`` and skip dividing the
    loss by the accumulation steps: transformers' ``Trainer.__init__`` rule, on a peft model's base
    model (``get_base_model()``, as ``unwrap_peft_model``): its ``accepts_loss_kwargs`` where it has
    one, else whether its ``forward`` takes ``**kwargs``."""
    if callable(getattr(model, "get_base_model", None)):
        model = model.get_base_model()
    if hasattr(model, "accepts_loss_kwargs"):
        return bool(model.accepts_loss_kwargs)
    return any(p.kind is inspect.Parameter.VAR_KEYWORD
               for p in inspect.signature(model.forward).parameters.values())


class AutoprecTrainer(transformers.Trainer):
    """``transformers.Trainer`` for a module from :func:`autoprec.apply`, with the policy's loss scaler.

    Use it like ``Trainer`` (same arguments); ``model`` must be a
    :class:`~autoprec.MixedPrecisionModule`. For a policy with fp16 nodes
    (``policy.needs_loss_scaling``) each step scales the loss by the scaler's scale before backward,
    unscales the fp32 gradients before clipping (``max_grad_norm``) and before measuring
    ``grad_norm``, skips the optimizer step (and the learning-rate schedule's step) when any gradient
    is inf/NaN, and updates the scale (GradScaler's rule with the policy's ``loss_scaling``
    settings, docs/architecture.md#policy-file). Every training log line then carries
    ``loss_scale`` (the scale after the step's update) and ``skipped_steps`` (skipped so far), in
    ``trainer.state.log_history`` and in every ``report_to`` integration. The logged ``loss`` is
    unscaled. For bf16/fp32 policies it is Trainer, plus the checks below.

    A policy with ``batching`` trains at its micro-batch and accumulation: given no ``args``, the
    Trainer's default arguments with ``per_device_train_batch_size = micro_batch`` and
    ``gradient_accumulation_steps = accumulation`` (:func:`with_policy_batching`); given ``args``
    that say otherwise, a ``ValueError`` (:func:`check_batching`), since they are the user's. Each
    training batch is checked too: the first must hold ``micro_batch`` examples (leading dimension;
    times the GPUs of ``torch.nn.DataParallel``), a later one no more (the last batch of an epoch
    may hold fewer). A policy without ``batching`` trains at ``args`` as Trainer does.

    ``save_model`` (and each checkpoint) saves the wrapped model as ``Trainer`` saves that model
    itself: through its ``save_pretrained`` when it is a ``PreTrainedModel`` (``config.json`` and the
    weights, for ``from_pretrained`` of the model's own class) or a peft ``PeftModel``
    (``adapter_config.json`` and ``adapter_model.safetensors``, for ``PeftModel.from_pretrained``), else
    its ``state_dict`` as ``model.safetensors`` (a plain ``Trainer`` writes only that for any module
    that is not one of those classes, as the ``MixedPrecisionModule`` is not). Resuming from a
    checkpoint (``train(resume_from_checkpoint=...)``) and ``load_best_model_at_end`` read it back the
    same way (a peft checkpoint through ``load_adapter``, into the Parameters the graph reads).

    Raises:
        TypeError: ``model`` is not a ``MixedPrecisionModule``, or ``model_init`` is given instead.
        ValueError: ``args`` sets ``bf16``/``fp16``/``*_full_eval`` or gradient checkpointing
            (:func:`check_training_args`), or another batch than the policy's ``batching``
            (:func:`check_batching`); at a training step: a batch of another size than the policy's
            micro-batch (its number of examples, the policy's fields and the train DataLoader named).
    """

    def __init__(self, model: MixedPrecisionModule | None = None, args: Any = None, *rest: Any,
                 **kwargs: Any) -> None:
        if not isinstance(model, MixedPrecisionModule):
            raise TypeError(f"AutoprecTrainer: model must be the module autoprec.apply returned (a "
                            f"MixedPrecisionModule), got {type(model).__name__}"
                            + (" (model_init is not supported: apply the policy, then pass model=)"
                               if kwargs.get("model_init") is not None else ""))
        check_training_args(args)
        check_batching(args, model.policy)
        if args is None:
            args = with_policy_batching(None, model.policy)
        super().__init__(model, args, *rest, **kwargs)
        batching = model.policy.batching
        self._micro_batch_check = None if batching is None else MicroBatchCheck(
            batching, "AutoprecTrainer",
            "the Trainer's train DataLoader (get_train_dataloader, data_collator)",
            f"make it give {batching.micro_batch} examples per batch (per device)", replicas=self.args.n_gpu)
        if (steps := self.args.gradient_accumulation_steps) > 1 and _stock_passes_num_items(model.model):
            warnings.warn(
                f"autoprec: gradient_accumulation_steps={steps}: the policy's graph computes each "
                "micro-batch's mean loss (it takes no num_items_in_batch) and Trainer averages those. "
                f"Stock Trainer passes {type(model.model).__name__} num_items_in_batch and does not divide "
                f"by {steps}: where the model's loss uses it (Hugging Face causal LMs) it weights "
                "micro-batches by their token counts, so padded micro-batches of unequal lengths update "
                "otherwise; where the loss ignores it (e.g. a sequence classification head) stock "
                f"Trainer's logged loss and gradients are {steps} times these, and gradient clipping acts "
                "on those (docs/integrations.md)", UserWarning, stacklevel=2)

    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's accelerator, with the policy's :class:`~autoprec.DynamicLossScaler` as its scaler
        (None for a policy without fp16 nodes). Trainer calls this in ``__init__`` and again for a
        hyper-parameter search, so each accelerator gets a fresh scaler."""
        super().create_accelerator_and_postprocess()
        if self.accelerator.scaler is not None:  # check_training_args refused fp16 already
            raise ValueError("AutoprecTrainer: accelerate created its own GradScaler (mixed_precision='fp16' "
                             "in the accelerate config or environment); set mixed_precision='no'")
        self.accelerator.scaler = make_scaler(self.model.policy)

    def training_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """Trainer's ``training_step`` (one micro-batch's forward and backward), after checking the
        batch's examples against the policy's micro-batch (a policy with ``batching``).

        Raises:
            ValueError: the batch has another number of examples (first batch) or more (a later one)
                than the policy's ``batching.micro_batch``; the message names both.
        """
        if self._micro_batch_check is not None:
            self._micro_batch_check(inputs)
        return super().training_step(model, inputs, *args, **kwargs)

    @property
    def loss_scaler(self) -> DynamicLossScaler | None:
        """The policy's loss scaler (``state_dict()`` as saved in checkpoints), None without fp16 nodes."""
        scaler = self.accelerator.scaler
        return scaler if isinstance(scaler, DynamicLossScaler) else None

    def _unscale(self) -> None:
        """Divide the accumulated gradients by the scale (fp32, in place) and record inf/NaN, once per
        step."""
        if self.loss_scaler is not None:
            self.loss_scaler.unscale_(getattr(self.optimizer, "optimizer", self.optimizer))

    def _clip_grad_norm(self, model: Any) -> Any:
        """Unscale, then Trainer's clipping (called when ``max_grad_norm > 0``)."""
        self._unscale()
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        """Trainer's gradient norm; without clipping (``grad_norm`` None) the gradients are unscaled first."""
        if grad_norm is None:
            self._unscale()
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Trainer's ``log``, with ``loss_scale`` and ``skipped_steps`` added to training logs (those
        without ``eval_``/``test_`` metrics) when the policy has fp16 nodes."""
        scaler = self.loss_scaler
        if scaler is not None and not any(k.startswith(("eval_", "test_")) for k in logs):
            logs = {**logs, "loss_scale": scaler.get_scale(), "skipped_steps": scaler.skipped_steps}
        super().log(logs, *args, **kwargs)

    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        """Trainer's ``_save`` run on the wrapped model (:meth:`_inner_model`): ``save_pretrained`` of a
        ``PreTrainedModel`` or a ``PeftModel``, the ``state_dict`` of another model."""
        with self._inner_model():
            super()._save(output_dir, state_dict)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Trainer's checkpoint loading run on the wrapped model (:meth:`_inner_model`), so it reads what
        :meth:`_save` wrote (a peft checkpoint holds only the adapter, loaded with ``load_adapter``)."""
        outer = self.model
        with self._inner_model() as inner:
            super()._load_from_checkpoint(resume_from_checkpoint, inner if model is None or model is outer
                                          else model)

    def _load_best_model(self) -> None:
        """Trainer's ``load_best_model_at_end`` loading run on the wrapped model (:meth:`_inner_model`)."""
        with self._inner_model():
            super()._load_best_model()

    @contextlib.contextmanager
    def _inner_model(self) -> Iterator[Any]:
        """``self.model`` is the wrapped model inside the block (yielded), so Trainer saves and loads it
        as it would that model passed to it directly: transformers' ``Trainer._save`` calls
        ``save_pretrained`` of a ``PreTrainedModel`` or a peft ``PeftModel`` and writes the
        ``state_dict`` of another model (the ``MixedPrecisionModule``'s is the wrapped model's), and
        ``_load_from_checkpoint`` loads a ``PeftModel``'s adapter with ``load_adapter``."""
        mp = self.model
        inner = mp.model if isinstance(mp, MixedPrecisionModule) else mp
        self.model = inner
        try:
            yield inner
        finally:
            self.model = mp
