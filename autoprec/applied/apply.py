"""``autoprec.apply``: a policy applied to a model as a trainable drop-in module
(docs/architecture.md#runtime)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from autoprec.applied.compile import CompiledGraph, compile_graph
from autoprec.applied.eval_backward import EvalBackwardCheck
from autoprec.applied.forward_state import ForwardStateSnapshot
from autoprec.applied.loss_scale_check import UnscaledBackwardCheck
from autoprec.applied.model_facade import (
    ModelFacade,
    ModeSnapshot,
    ParameterSnapshot,
    check_no_autocast,
    check_not_fully_sharded,
    check_not_wrapped,
    signed_class,
)
from autoprec.applied.outputs import flat_output_graph, rebuild
from autoprec.applied.policy_match import check_policy_matches
from autoprec.applied.recapture import Recapture, Routed
from autoprec.applied.saved import apply_saved, saved_activation_context
from autoprec.applied.shape_cache import CompileLog, InputCheck, ShapeCache, is_dynamic
from autoprec.capture import (
    CALL_KWARGS_META,
    PLAN_META,
    DimPlan,
    InputShapes,
    capture,
    capture_dynamic,
    quiet_pytree_deprecation,
)
from autoprec.modelspec import drop_fixed_kwargs
from autoprec.passes import run_pipeline
from autoprec.policy import Policy

__all__ = ["MixedPrecisionModule", "apply"]

class MixedPrecisionModule(ModelFacade):
    """A model whose forward runs a policy-lowered graph on the model's own Parameters.

    Call it exactly like the model (same positional/keyword structure and shapes as the example
    batch given to :func:`apply`); it returns the model's output type and fields (``out.loss``,
    ``out.logits`` of a ``ModelOutput``), outputs in their original dtype (fp32). When the capture
    fixed ``use_cache=False`` for training (:func:`autoprec.modelspec.training_kwargs`), every call
    runs with it: passing ``use_cache=False`` is accepted, another value raises ``ValueError``.
    ``parameters()``, ``named_parameters()``, ``state_dict()`` and ``load_state_dict()`` are the wrapped
    model's, so optimizers and checkpoints are unchanged; parameters (master weights) stay fp32 and
    low-precision copies are cast inside the graph.

    From ``apply(..., dynamic=False)`` the graph is specialised to the example batch's shapes
    (batch size included): a call whose input tensors have other shapes raises ``ValueError``
    naming the input and both shapes (see :class:`autoprec.capture.InputShapes`). From ``apply(...,
    dynamic=True)`` (the default) it takes any batch size and sequence length: the example's shape
    static, then, from the first other shape, the ranges of :mod:`autoprec.capture.dims` (one
    dynamic graph, or one graph per shape: :mod:`autoprec.applied.shape_cache`); a later batch outside those
    ranges is served too, by a re-capture with wider ranges or a graph of its own (logged;
    :mod:`autoprec.applied.recapture`), unless ``apply(..., strict_shapes=True)``, which raises
    ``ValueError`` for it; :attr:`shape_stats` counts its captures and compiles.

    When ``policy.needs_loss_scaling`` is True (the policy computes something in fp16), train it
    with the scaler ``autoprec.training.train.make_scaler(mp.policy)`` returns (a
    :class:`autoprec.DynamicLossScaler`); see :func:`apply`.

    Hugging Face ``Trainer`` (docs/architecture.md#runtime): ``inspect.signature(mp.forward)`` (and of
    the class's ``forward``) is the model's, so Trainer keeps the batch's columns and finds its label
    names; ``config``, ``main_input_name`` and ``_keys_to_ignore_on_save`` are the model's;
    ``named_children()`` are the model's children (Trainer's weight-decay groups, ``.to()``);
    ``save_pretrained`` is the model's. ``accepts_loss_kwargs`` is False: the graph takes the batch
    it was captured with, not Trainer's ``num_items_in_batch``, so Trainer averages the per-batch
    loss over gradient accumulation itself. Gradient checkpointing cannot be switched on after
    the capture (``gradient_checkpointing_enable`` raises; the policy's ``activation_memory_budget``
    is autoprec's way to trade compute for activation memory), and a training-mode call under
    ``torch.autocast`` (``Trainer(bf16=True)``/``fp16=True``) raises ``ValueError``: the policy sets
    the dtypes. In eval mode a call is the model's own forward (fp32, dropout off; :meth:`forward`).

    Attributes:
        model: The original model (its Parameters are the ones trained).
        graph_module: The lowered ``torch.fx.GraphModule``.
        policy: The policy applied.
        stats: Pass statistics (``casts``, ``cast_bytes``).
        compiled: Whether forward runs through ``torch.compile``.
    """

    def __init__(self, model: nn.Module, graph_module: fx.GraphModule, policy: Policy,
                 stats: dict[str, Any], compile: bool) -> None:
        super().__init__()
        object.__setattr__(self, "model", model)  # not a submodule: state_dict keys unchanged
        if not any(m.training for m in model.modules()):  # applied wholly in eval mode (from_pretrained)
            model.train()  # the mode it was captured in, and this module's (ModelFacade.training)
        object.__setattr__(self, "graph_module", graph_module)
        self.policy = policy
        self.stats = stats
        self.compiled = compile
        if not compile and policy.activation_memory_budget < 1.0:
            warnings.warn("autoprec: the policy's activation_memory_budget "
                          f"{policy.activation_memory_budget:g} applies to compiled graphs only; without "
                          "compile every activation is kept, so peak memory exceeds what tune measured",
                          stacklevel=3)
        flat, self._out_spec = flat_output_graph(graph_module)  # the output is rebuilt outside compile
        if not compile:  # nodes' ``saved`` dtypes (autoprec.applied.saved; compile_graph handles compiled)
            apply_saved(flat, compiled=False)
        object.__setattr__(self, "_saved", saved_activation_context(flat) if not compile else nullcontext())
        options = policy.compiled_as  # no say: as torch.compile(model) compiles
        object.__setattr__(self, "_fn", compile_graph(
            flat, policy.activation_memory_budget, regional=options.regional,
            emulate_precision_casts=options.emulate_precision_casts) if compile else flat)
        object.__setattr__(self, "_inputs", InputShapes(graph_module, what=type(self).__name__))
        object.__setattr__(self, "_params", ParameterSnapshot(model))  # None under FSDP2 (autoprec.shard)
        object.__setattr__(self, "_modes", ModeSnapshot(model))
        object.__setattr__(self, "_switches", ForwardStateSnapshot(model))
        self._fixed = dict(graph_module.meta.get(CALL_KWARGS_META, {}))
        self._what = f"{type(self).__name__} of {type(model).__name__}"
        self._unscaled = UnscaledBackwardCheck(policy, self._what)  # fp16 trained without a scaler
        self._eval_backward = EvalBackwardCheck(self._what)
        object.__setattr__(self, "_recapture", None)  # set by apply(dynamic=True, strict_shapes=False)
        object.__setattr__(self, "_retired", _RetiredGraphs())  # graphs adopt() replaced
        self.__class__ = signed_class(type(self), model)  # forward reports model.forward's signature

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the lowered graph; same signature and outputs as ``model.forward``.

        In eval mode (``mp.eval()``, as Hugging Face ``Trainer.evaluate`` and Lightning's validation
        set it) the call is the model's own forward instead, in fp32 and eval mode (dropout off),
        with any batch shape: the graph is the training graph (:func:`autoprec.capture.capture`),
        whose dropout would draw masks at evaluation. The
        Lightning plugin evaluates the same way (:mod:`autoprec.integrations.lightning`).

        Args:
            *args, **kwargs: The batch, with the structure and tensor shapes of the example batch
                the graph was captured on (dtypes and devices as the model expects).

        Returns:
            The model's output type and fields (e.g. a ``CausalLMOutputWithPast`` with ``.loss``
            and ``.logits``), floating outputs in their original dtype, compiled or not
            (:func:`autoprec.applied.outputs.rebuild`).

        Raises:
            TypeError: the call does not bind to the example batch's inputs (in training mode: one
                missing, e.g. ``labels``; an unknown one; the batch dict passed as one
                argument instead of ``**batch``); the message names them.
            ValueError: an input tensor's shape differs from the captured one (e.g. a smaller last
                batch; with ``dynamic=True``: only under ``strict_shapes=True``, a size outside the
                captured ranges, or inputs captured as one dimension that disagree); the message
                names the input, the captured and the given shapes. Or the
                call sets an argument the capture fixed for training to another value (e.g.
                ``use_cache=True``; ``use_cache=False`` is accepted). Or it runs under
                ``torch.autocast`` (e.g. ``Trainer(bf16=True)``), which would override the policy.
                Or FSDP2's ``fully_shard`` wrapped this module directly (use :func:`autoprec.shard`).
                Or the model's Parameters were replaced since ``apply`` (:class:`ParameterSnapshot`).
                Or, with grad enabled, a switch the graph fixed changed since ``apply``: gradient
                checkpointing switched on, peft adapters disabled, merged or switched
                (:mod:`autoprec.applied.forward_state`); under ``torch.no_grad()`` such a call runs
                the model's own forward (fp32) instead.
                In eval mode only the FSDP2 one; the rest is the model's own forward's. The first
                backward through the loss of an fp16 policy's output raises ``ValueError`` when
                nothing scaled the loss (:class:`~autoprec.applied.loss_scale_check.UnscaledBackwardCheck`).
        """
        check_not_fully_sharded(self, self._what)
        if not self.training:
            out = self.model(*args, **kwargs)
            self._eval_backward(out)  # a backward through it trains without the policy: warned once
            return out
        check_no_autocast(self._what)
        if self._params is not None:
            self._params.check(self.model, self._what)
        self._modes.check(self.model, self._what)
        changed = self._switches.changed()
        if changed is not None:
            if torch.is_grad_enabled():
                raise ValueError(changed.refusal(self._what))
            return self.model(*args, **kwargs)  # a reference pass (peft's disable_adapter): exact, fp32
        kwargs = drop_fixed_kwargs(kwargs, self._fixed, self._what)
        try:
            self._inputs.check(args, kwargs)
        except ValueError as e:
            if self._recapture is None:
                raise
            self._recapture(self, args, kwargs, e)  # re-captures or routes the shape; else raises e
        with self._saved:
            out = rebuild(self._fn(*args, **kwargs), self._out_spec)
        self._unscaled(out)
        return out

    @property
    def what(self) -> str:
        """How messages name this module: ``"MixedPrecisionModule of Qwen2ForCausalLM"``."""
        return self._what

    @property
    def runner(self) -> Callable[..., Any]:
        """What a training-mode call runs: the lowered graph, its
        :class:`~autoprec.applied.compile.CompiledGraph`, a
        :class:`~autoprec.applied.shape_cache.ShapeCache` or a
        :class:`~autoprec.applied.recapture.Routed`."""
        return self._fn

    @property
    def input_check(self) -> InputCheck:
        """What checks a call's input shapes before :attr:`runner` runs it (raises ``ValueError``)."""
        return self._inputs

    def serve(self, runner: Callable[..., Any], input_check: InputCheck) -> None:
        """Serve later training calls with ``runner``, checked by ``input_check`` (the per-shape cache
        and :mod:`autoprec.applied.recapture` switch a module so); the graph stays."""
        object.__setattr__(self, "_fn", runner)
        object.__setattr__(self, "_inputs", input_check)

    def adopt(self, other: MixedPrecisionModule) -> None:
        """Take ``other``'s graph, runner, input check, saved-activation context, output structure
        and pass statistics: ``other`` is the same model and policy applied to a new capture
        (:mod:`autoprec.applied.recapture`)."""
        self._retired.add(self._graph_stats())
        for name in ("graph_module", "_fn", "_inputs", "_saved", "_out_spec"):
            object.__setattr__(self, name, getattr(other, name))
        self.__dict__["stats"] = other.stats

    @property
    def shape_stats(self) -> dict[str, Any]:
        """How the module serves batch shapes: ``{"mode": "static", "captures": 1}`` (with
        ``"compiles"`` and ``"compile_seconds"`` when compiled), or, once a call of another shape made
        ``apply(..., dynamic=True)``'s module capture again, ``{"mode": "dynamic", "captures",
        "compiles", "compile_seconds"}`` /
        ``{"mode": "per_shape", "captures", "capture_seconds", "shapes"}`` (see
        :mod:`autoprec.applied.shape_cache`) / ``{"mode": "dynamic+per_shape", ...}`` (shapes below
        a range, :class:`autoprec.applied.recapture.Routed`); ``"recaptures"``: times a batch outside
        the ranges made it capture again with wider ones (:mod:`autoprec.applied.recapture`).

        ``captures``, ``compiles`` and ``compile_seconds`` (seconds of the calls that compiled) count
        every graph of this module, those a recapture replaced included: a static example's graph,
        then one recapture with dynamic dimensions, is ``captures: 2, recaptures: 1``."""
        out = self._graph_stats()
        self._retired.fold_into(out)
        if self._recapture is not None and self._recapture.recaptures:
            out["recaptures"] = self._recapture.recaptures
        return out

    def _graph_stats(self) -> dict[str, Any]:
        """:attr:`shape_stats` of the graph (or per-shape cache) this module runs now alone."""
        fn = self._fn.compile_log if isinstance(self._fn, CompiledGraph) else self._fn
        stats = fn.stats if isinstance(fn, (CompileLog, ShapeCache, Routed)) else None
        return stats() if stats is not None else {
            "mode": "dynamic" if is_dynamic(self.graph_module) else "static", "captures": 1}


@dataclass
class _RetiredGraphs:
    """Counts of the graphs :meth:`MixedPrecisionModule.adopt` replaced (see ``shape_stats``)."""

    captures: int = 0
    compiles: int = 0
    compile_seconds: float = 0.0

    def add(self, stats: dict[str, Any]) -> None:
        """Count a replaced graph's ``shape_stats``-style ``stats``."""
        self.captures += stats.get("captures", 1)
        self.compiles += stats.get("compiles", 0)
        self.compile_seconds += stats.get("compile_seconds", 0.0)

    def fold_into(self, out: dict[str, Any]) -> None:
        """Add these counts to the current graph's ``out`` (in place); compile counts only where
        either side compiled."""
        out["captures"] = out.get("captures", 1) + self.captures
        if self.compiles or "compiles" in out:
            out["compiles"] = out.get("compiles", 0) + self.compiles
            out["compile_seconds"] = out.get("compile_seconds", 0.0) + self.compile_seconds

def apply(model: nn.Module, policy: Policy, example_batch: Any, compile: bool = True,
          placement: str = "mincut", graph_module: fx.GraphModule | None = None,
          dynamic: bool = True, force: bool = False, strict_shapes: bool = False) -> MixedPrecisionModule:
    """Apply ``policy`` to ``model``: capture, lower (passes), optionally compile.

    Args:
        model: fp32 model; its Parameters are shared, not copied.
        policy: The dtype policy (e.g. ``Policy.load("policy.json")``).
        example_batch: A batch as ``get_batch`` returns it (dict, tuple or tensor); fixes the
            call structure and shapes.
        compile: Compile with ``torch.compile`` (Inductor) under the policy's
            ``activation_memory_budget`` and ``Policy.compiled_as`` (its ``compile_options``, what
            ``tune`` measured; without them as ``torch.compile(model)``: :func:`compile_graph`).
        placement: Cast placement of ``follow`` nodes, one of :data:`autoprec.graph.PLACEMENT_MODES`
            (docs/cast_placement.md); a policy's ``follow_placement="promote"`` overrides it.
        graph_module: An already captured graph of ``model`` (skips the capture).
        dynamic: Accept batches of other shapes by ``torch.compile``'s rule (docs/architecture.md#runtime):
            the example's shapes static (what ``tune`` measured; symbolic sizes cost pointwise and
            norm kernels 1.5-3.4x, pytorch/pytorch PR #176653), then at the first other shape one
            capture with dynamic dimensions in the ranges :mod:`autoprec.capture.dims` derives,
            compiled once (:meth:`autoprec.applied.recapture.Recapture.from_static`); where the model
            cannot be exported so, one graph per shape (:class:`~autoprec.applied.shape_cache.ShapeCache`,
            at most ``MAX_SHAPES``). New compiles and shapes are logged (``autoprec`` logger, INFO).
            A later batch outside the ranges is served by a capture with wider ranges (a compiled
            module compiles again) or by a graph of its own (:mod:`autoprec.applied.recapture`, which
            refuses a sequence past ``max_position_embeddings``), logged.
        strict_shapes: With ``dynamic=True``, capture with dynamic dimensions at once (ranges from
            ``example_batch``) and raise ``ValueError`` (naming the input, its shape and the range)
            for a batch outside them instead of capturing again.
        force: Apply a policy none of whose rules selects a node of this model (a policy of
            another model, :func:`autoprec.applied.policy_match.check_policy_matches`) anyway.

    Returns:
        A :class:`MixedPrecisionModule`, a drop-in for ``model`` in the training loop, for batches
        of ``example_batch``'s structure; with ``dynamic=False`` also of its shapes only (another
        shape raises ``ValueError`` at call time).

    Raises:
        CaptureError: the model cannot be captured; a floating Parameter is not fp32 (names it:
            ``model.half()`` or a checkpoint loaded in bf16; the policy sets the dtypes); or it is
            already wrapped by ``DistributedDataParallel`` or FSDP2 (apply first, then
            :func:`autoprec.ddp` / :func:`autoprec.shard`).
        PassError: the policy cannot be applied to this graph (names the node).
        PolicyError: no rule of the policy selects a node of this graph (without ``force``).
        ValueError: ``placement`` is not a placement mode (the message lists them).

    Loss scaling: a policy that computes in fp16 (``policy.needs_loss_scaling``) must be trained with
    a dynamic loss scaler (C07; an unscaled first backward raises), built from its ``loss_scaling``::

        scaler = autoprec.make_scaler(policy)  # a DynamicLossScaler, or None without fp16
        loss = loss_fn(mp(**batch), batch)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)    # optional, e.g. before clipping
        scaler.step(optimizer)        # skipped on inf/NaN gradients
        scaler.update()

    (``autoprec.training.train.TrainStep``, which ``autoprec train`` uses, does all of this.)
    """
    check_not_wrapped(model)
    # torch.compile's rule: the first shape static, dynamic dimensions at the first other one; strict
    # shapes need the ranges a call is checked against from the start
    gm = graph_module if graph_module is not None else (
        capture_dynamic(model, example_batch) if dynamic and strict_shapes else capture(model, example_batch))
    check_policy_matches(policy, gm, force=force)
    with quiet_pytree_deprecation():  # the passes deep-copy the graph and its pytree specs
        result = run_pipeline(gm, policy, placement)
    # passes keep no gm.meta
    result.graph_module.meta[CALL_KWARGS_META] = dict(gm.meta.get(CALL_KWARGS_META, {}))
    mp = MixedPrecisionModule(model, result.graph_module, policy, result.stats, compile)
    static = lambda batch: apply(model, policy, batch, compile, placement, dynamic=False, force=True).runner  # noqa: E731
    # static for the example's shape (or capture_for's unvarying batches), not because export refused
    # dynamic dimensions (PLAN_META): another shape tries one dynamic capture (Recapture.from_static)
    untried = PLAN_META not in gm.meta and not strict_shapes
    if dynamic and not is_dynamic(gm) and not untried:  # one graph per shape, the example's first
        _use_shape_cache(mp, example_batch, static, strict_shapes, gm.meta.get(PLAN_META))
    elif dynamic and not strict_shapes:  # a batch outside the ranges: capture again (applied.recapture)
        again = lambda g: apply(model, policy, example_batch, compile, placement, graph_module=g,  # noqa: E731
                                force=True, strict_shapes=True)
        object.__setattr__(mp, "_recapture", Recapture(model, example_batch, again, static))
    return mp


def _use_shape_cache(mp: MixedPrecisionModule, example_batch: Any, build: Any, strict: bool,
                     plan: DimPlan | None) -> None:
    """Route ``mp``'s calls through a :class:`ShapeCache` seeded with its example-shape graph (its
    ranges: ``plan``, the capture's, else planned from ``example_batch``)."""
    cache = ShapeCache.seeded(mp.model, example_batch, mp.runner, build, mp.what, strict=strict, plan=plan)
    mp.serve(cache, cache)  # its check is the range check of autoprec.capture.dims
