"""A policy :class:`Rule`: which nodes (by op class, module glob or node key) store, compute and
save for backward in which dtype.

See ``docs/architecture.md#policy-file`` (the format) and ``#node-keys-and-op-classes`` (the
keys and op classes rules select by).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from autoprec.dtypes import COMPUTE_DTYPES, DTYPES, FP8_COMPUTE, SAVED_DTYPES, kernel_name
from autoprec.policy.fields import check_choice, fail, join

__all__ = ["FP8", "OP_CLASSES", "RULE_KEYS", "RULE_OP_CLASSES", "SCHEMA2_RULE_KEYS", "Rule"]

#: Op classes of ``ops.py``. ``nonfloat`` ops are never cast, so no rule may target them.
OP_CLASSES: tuple[str, ...] = ("matmul", "sensitive", "follow", "nonfloat")
#: Op classes a rule may target.
RULE_OP_CLASSES: tuple[str, ...] = ("matmul", "sensitive", "follow")
#: The fp8 compute dtype of matmuls (``autoprec.kernels.fp8``: a scaled matmul, torch's ``_scaled_mm``).
FP8 = FP8_COMPUTE
RULE_KEYS: tuple[str, ...] = ("node", "module", "op_class", "dtype", "compute", "saved")
#: Rule keys that schema 1 did not have (a policy using one is written as schema 2).
SCHEMA2_RULE_KEYS: tuple[str, ...] = ("compute", "saved")


@dataclass(frozen=True)
class Rule:
    """One policy rule: nodes selected by every given selector store their output in ``dtype``,
    compute in ``compute`` and save it for backward as ``saved``.

    Attributes:
        dtype: The storage dtype of the selected nodes' outputs, what their consumers read:
            ``"fp32"``, ``"bf16"`` or ``"fp16"``; or ``"fp8_e4m3"`` on matmuls, read as storage
            fp32 with compute fp8_e4m3. None in a rule that sets only ``saved``.
        compute: The dtype the op computes in (None: ``dtype``). ``{"op_class": "matmul",
            "dtype": "bf16", "compute": "fp32"}`` stores inputs and output bf16 and computes the
            product in fp32 (the numerics of a bf16 Tensor Core, which accumulates in fp32, at fp32
            kernel speed); ``"fp8_e4m3"`` is an fp8 scaled matmul (matmuls only). Needs ``dtype``.
        saved: What the node's output is saved as for backward: ``fp32``, ``bf16``, ``fp16`` or
            ``fp8_e5m2`` (with a per-tensor scale); None keeps the storage dtype. The forward is
            unchanged; backward reads the rounded copy (``autoprec.applied.saved``).
        op_class: One of :data:`OP_CLASSES` except ``"nonfloat"`` (never cast), or None.
        module: An :func:`fnmatch.fnmatchcase` glob on the module path, e.g. ``"model.layers.0.*"``
            (which also matches ``"model.layers.0"`` itself) or ``"model.layers.0*"``. A glob
            without wildcards matches that module only, not its submodules.
        node: An exact node key, e.g. ``"model.layers.3.mlp.down_proj/linear#0"``.

    Raises:
        PolicyError: no selector is given; neither ``dtype`` nor ``saved``; ``compute`` without
            ``dtype``; fp8 on a rule that may select non-matmul nodes; a field has a wrong type
            or value.
    """

    dtype: str | None = None
    op_class: str | None = None
    module: str | None = None
    node: str | None = None
    compute: str | None = None
    saved: str | None = None

    def __post_init__(self) -> None:
        self._validate("Rule", "")

    def _validate(self, source: str, path: str) -> None:
        """Check the fields; ``path`` is e.g. ``"rules[2]"`` (``""`` for a bare Rule)."""
        for name in ("op_class", "module", "node"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise fail(source, join(path, name), f"expected a non-empty string, got {value!r}")
        if self.op_class is None and self.module is None and self.node is None:
            raise fail(source, path, "a rule needs at least one of op_class, module, node")
        if self.op_class == "nonfloat":
            raise fail(source, join(path, "op_class"),
                       "'nonfloat' ops (integer/bool tensors, indices, masks) are never cast; "
                       "a rule cannot target them (cases C11)")
        if self.op_class is not None:
            check_choice(self.op_class, RULE_OP_CLASSES, "op_class", source, join(path, "op_class"))
        if self.compute is not None and self.dtype is None:
            raise fail(source, join(path, "compute"), "needs a dtype in the same rule (the storage dtype)")
        if self.dtype is None and self.saved is None:
            raise fail(source, path, "a rule needs at least one of dtype, saved (it selects nodes but "
                       "sets nothing for them)")
        if self.dtype is not None:
            check_choice(self.dtype, [*sorted(DTYPES), FP8], "dtype", source, join(path, "dtype"))
        if self.compute is not None:
            if self.dtype == FP8:
                raise fail(source, join(path, "compute"), f"dtype {FP8!r} already is the compute dtype "
                           "(storage fp32); for other storage write e.g. dtype 'bf16', compute 'fp8_e4m3'")
            check_choice(self.compute, list(COMPUTE_DTYPES), "compute dtype", source, join(path, "compute"))
        if FP8 in (self.dtype, self.compute) and self.op_class != "matmul" and self.node is None:
            field = "dtype" if self.dtype == FP8 else "compute"
            raise fail(source, join(path, field), f"{FP8!r} is a matmul compute dtype: the rule needs "
                       "op_class 'matmul' (or a node key of a matmul)")
        if self.saved is not None:
            check_choice(self.saved, list(SAVED_DTYPES), "saved dtype", source, join(path, "saved"))

    @property
    def storage(self) -> str | None:
        """The storage dtype the rule sets (fp8 ``dtype`` is stored fp32), or None."""
        return "fp32" if self.dtype == FP8 else self.dtype

    @property
    def compute_dtype(self) -> str | None:
        """The compute dtype the rule sets (``compute``, else ``dtype``), or None."""
        return self.compute or self.dtype

    @property
    def schema2(self) -> bool:
        """Whether the rule uses a field schema 1 lacks (``compute``, ``saved``, fp8)."""
        return self.dtype == FP8 or any(getattr(self, k) is not None for k in SCHEMA2_RULE_KEYS)

    def matches(self, key: str, op_class: str, module_path: str) -> bool:
        """Whether this rule selects a node.

        Args:
            key: The node key (``<module path>/<op>#<k>``).
            op_class: The node's op class (one of :data:`OP_CLASSES`).
            module_path: The path of the innermost module owning the node (``""`` for the root).

        Returns:
            True when every selector that is set matches.
        """
        if self.node is not None and self.node != key:
            return False
        if self.op_class is not None and self.op_class != op_class:
            return False
        if self.module is not None:
            glob = self.module
            prefix_hit = glob.endswith(".*") and module_path == glob[:-2]
            if not (prefix_hit or fnmatch.fnmatchcase(module_path, glob)):
                return False
        return True

    def to_dict(self) -> dict[str, str]:
        """The rule as a JSON object, selectors first, without None fields."""
        d = {k: getattr(self, k) for k in RULE_KEYS}
        return {k: v for k, v in d.items() if v is not None}

    def describe(self) -> str:
        """A short human form, e.g. ``"sensitive->fp32"``, ``"matmul->bf16:fp32"`` (storage:compute)
        or ``"model.layers.0.*:matmul->saved fp8_e5m2"``."""
        sel = ":".join(s for s in (self.node, self.module, self.op_class) if s is not None)
        parts = []
        if self.dtype is not None:
            parts.append(kernel_name(self.dtype, self.compute))
        if self.saved is not None:
            parts.append(f"saved {self.saved}")
        return f"{sel}->{' '.join(parts)}"
