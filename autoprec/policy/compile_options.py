"""How a policy's graph is compiled (``Policy.compile_options``; docs/architecture.md#policy-file):
the options ``tune`` measured on the device, recorded so ``apply``, ``train`` and ``bench`` compile
what was measured.

- ``regional``: repeated blocks compiled once each as a ``torch.compiler.nested_compile_region``
  (:mod:`autoprec.applied.regions`: a deep model's compile costs about one layer's), or one flat
  graph. Regional compilation slowed an H100 training step 21.5% in bghira/SimpleTuner PR #3152 and
  helps only at some shapes in huggingface/accelerate PR #3529, so it is measured, not assumed.
- ``emulate_precision_casts``: Inductor rounds at each explicit low-precision cast as eager does
  (``torch._inductor.config.emulate_precision_casts``; introduced "mostly for debugging", pytorch
  PR #131595), or keeps fp32 intermediates inside fused kernels (faster, pytorch/pytorch #196958;
  its drift is measured compiled).

A policy without ``compile_options`` (a file written before the field, a policy built in Python)
has no say: ``autoprec.apply`` then compiles as ``torch.compile(model)`` would, one flat graph with
Inductor's defaults (:data:`TORCH_COMPILE`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autoprec.policy.fields import check_keys, check_mapping, described, fail, join

__all__ = ["COMPILE_OPTION_KEYS", "COMPILE_VARIANTS", "REGIONAL_EMULATED", "TORCH_COMPILE", "CompileOptions",
           "flat_reason"]

#: The keys of a policy file's ``compile_options`` object (both required).
COMPILE_OPTION_KEYS: tuple[str, ...] = ("regional", "emulate_precision_casts")
#: Which variants of these options ``tune --compile-variants`` times against its choice
#: (:func:`autoprec.search.contest.variant_options`): ``"none"``; ``"flat"`` (the default: one flat
#: graph where the choice compiled repeated blocks as regions); ``"all"`` (also fp32 intermediates,
#: where it lowers anything).
COMPILE_VARIANTS: tuple[str, ...] = ("none", "flat", "all")


def flat_reason(saved: bool, activation_memory_budget: float) -> str | None:
    """Why a graph compiles as one flat graph whatever ``regional`` asks, or None: saved-activation
    dtypes (``saved``), or an activation memory budget below 1.0 (measured:
    :func:`autoprec.applied.compile.compile_graph`'s ``regional``,
    docs/architecture.md#regional-compilation)."""
    if saved:
        return "the policy's saved-activation dtypes are not honoured reliably inside compiled regions"
    if activation_memory_budget < 1.0:
        return ("AOTAutograd's activation memory budget is not measured inside compiled regions: the "
                "memory fit relies on the flat graph's peaks")
    return None


@dataclass(frozen=True)
class CompileOptions:
    """The compile options of a policy (the module docstring).

    Attributes:
        regional: Compile repeated blocks once each (True) or one flat graph (False).
        emulate_precision_casts: Inductor's ``emulate_precision_casts``.

    Raises:
        PolicyError: a value is not a bool (names the field).
    """

    regional: bool = True
    emulate_precision_casts: bool = True

    def __post_init__(self) -> None:
        self._validate("CompileOptions", "")

    def _validate(self, source: str, path: str) -> None:
        for name in COMPILE_OPTION_KEYS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise fail(source, join(path, name), f"expected true or false, got {described(value)}")

    def describe(self) -> str:
        """``"regional"`` / ``"flat"``, with ``", fp32 intermediates"`` when casts are not emulated."""
        return ("regional" if self.regional else "flat") + (
            "" if self.emulate_precision_casts else ", fp32 intermediates")

    def to_dict(self) -> dict[str, bool]:
        """The policy file's ``compile_options`` object."""
        return {"regional": self.regional, "emulate_precision_casts": self.emulate_precision_casts}

    @classmethod
    def from_dict(cls, d: Any, source: str, path: str = "compile_options") -> CompileOptions:
        """Inverse of :meth:`to_dict`. Raises: PolicyError: not an object, an unknown or missing key,
        or a value that is not a bool (naming ``source`` and the field)."""
        m: Mapping = check_mapping(d, source, path)
        check_keys(m, COMPILE_OPTION_KEYS, "compile_options", source, path)
        for key in COMPILE_OPTION_KEYS:
            if key not in m:
                raise fail(source, join(path, key), "missing (compile_options names both options)")
        obj = object.__new__(cls)
        for key in COMPILE_OPTION_KEYS:
            object.__setattr__(obj, key, m[key])
        obj._validate(source, path)
        return obj


#: What ``torch.compile(model)`` compiles: one flat graph, Inductor's defaults (no emulated casts).
TORCH_COMPILE = CompileOptions(regional=False, emulate_precision_casts=False)
#: How ``tune`` compiles a finalist that names no options, and what it measured before it recorded
#: them: repeated blocks as regions, casts rounded as eager's.
REGIONAL_EMULATED = CompileOptions(regional=True, emulate_precision_casts=True)
