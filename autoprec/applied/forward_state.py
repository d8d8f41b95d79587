"""Switches a model's Python ``forward`` reads that a captured graph fixed, besides the modes
(:class:`~autoprec.applied.model_facade.ModeSnapshot`) and the Parameters
(:class:`~autoprec.applied.model_facade.ParameterSnapshot`):

- Hugging Face's ``gradient_checkpointing`` flag of a module (``model.activation_checkpointing_enable()``,
  ``gradient_checkpointing_enable()`` before transformers 5, sets it on every module that has one).
  The graph was captured without checkpointing (the capture refuses it,
  :func:`autoprec.capture.diagnose.checkpointing_refused`), so switched on after ``apply`` it saved
  no memory, without a word.
- peft's adapter state of a tuner layer (``BaseTunerLayer``: ``disable_adapters``, ``merged_adapters``,
  ``active_adapter``): under ``with model.disable_adapter():`` (TRL's DPO reference pass of a peft
  model) the graph still added the adapter, and after ``merge_adapter()`` it added the adapter's
  delta twice (once merged into the base weight, once as the captured LoRA branch), silently.

A call with grad disabled (``torch.no_grad()``, a reference or evaluation pass) whose switches differ
from the capture's runs the model's own forward, exact in fp32; a call with grad enabled is refused,
since the policy's graph cannot train what the switches ask for.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import nn

__all__ = ["ForwardState", "ForwardStateSnapshot", "SwitchChange"]


class ForwardState(NamedTuple):
    """One module's switches: ``gradient_checkpointing`` (None: the module has no such flag) and
    peft's adapter state (None: not a tuner layer): ``(disabled, merged adapters, active adapters)``."""

    gradient_checkpointing: bool | None
    adapters: tuple[bool, tuple[str, ...], tuple[str, ...]] | None

    @classmethod
    def of(cls, module: nn.Module) -> ForwardState | None:
        """``module``'s switches, or None when it has neither kind (read by duck typing: peft is
        not imported)."""
        flag = getattr(module, "gradient_checkpointing", None)
        checkpointing = flag if isinstance(flag, bool) else None
        adapters = None
        if all(hasattr(module, a) for a in ("merged_adapters", "_disable_adapters", "active_adapter")):
            active = module.active_adapter
            adapters = (bool(module._disable_adapters), tuple(module.merged_adapters),
                        (active,) if isinstance(active, str) else tuple(active))
        if checkpointing is None and adapters is None:
            return None
        return cls(checkpointing, adapters)

    def differs(self, now: ForwardState | None) -> str | None:
        """What changed from this capture-time state to ``now`` (a phrase), or None."""
        if now == self:
            return None
        if now is None or (now.adapters is None) != (self.adapters is None):
            return "its switches changed"
        if now.gradient_checkpointing != self.gradient_checkpointing:
            return f"gradient_checkpointing is {now.gradient_checkpointing}"
        (was_disabled, was_merged, _), (disabled, merged, active) = self.adapters, now.adapters
        if disabled != was_disabled:
            return "its adapters are " + ("disabled (model.disable_adapter())" if disabled else "enabled")
        if merged != was_merged:
            return (f"adapters {list(merged)} are merged into its weights (merge_adapter())" if merged else
                    "its adapters were unmerged (unmerge_adapter())")
        return f"its active adapters are {list(active)} (set_adapter())"


class SwitchChange(NamedTuple):
    """A module whose switches differ from the capture's: its dotted path, what changed (a phrase),
    and whether that is gradient checkpointing switched on (else peft's adapters)."""

    module: str
    phrase: str
    checkpointing: bool

    def refusal(self, what: str) -> str:
        """The ``ValueError`` message for a call with grad enabled; ``what`` names the applied module."""
        changed = f"{self.module or 'the model'!r}: {self.phrase}"
        if self.checkpointing:
            return (f"{what}: gradient checkpointing was switched on after autoprec.apply ({changed}): "
                    "the captured graph does not checkpoint, so it would save every activation as "
                    "before. Switch it off (model.activation_checkpointing_disable(), "
                    "gradient_checkpointing_disable() before transformers 5); to trade compute for "
                    "activation memory, give the policy an activation_memory_budget below 1.0 "
                    "(autoprec tune --max-memory) and apply with compile=True "
                    "(docs/architecture.md#policy-file)")
        return (f"{what}: since autoprec.apply, {changed}; the graph runs the adapters as it captured "
                "them. Under torch.no_grad() (a reference pass, e.g. `with model.disable_adapter():`) the "
                "call runs the model's own forward in fp32; to train with these adapters, restore their "
                "state (enable_adapters(), unmerge_adapter(), set_adapter(...)) or apply the policy again")


class ForwardStateSnapshot:
    """The :class:`ForwardState` of the wrapped model's modules that have one, as captured; a
    training call compares them (one attribute read per such module).

    Args:
        model: The wrapped model, in the state its graph was captured with.
    """

    def __init__(self, model: nn.Module) -> None:
        self.states = [(name, module, state) for name, module in model.named_modules()
                       if (state := ForwardState.of(module)) is not None]

    def changed(self) -> SwitchChange | None:
        """The first module whose switches differ from the capture's, or None."""
        for name, module, state in self.states:
            now = ForwardState.of(module)
            phrase = state.differs(now)
            if phrase is not None:
                checkpointing = now is not None and now.gradient_checkpointing != state.gradient_checkpointing
                return SwitchChange(name, phrase, checkpointing)
        return None
