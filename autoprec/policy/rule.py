"""A policy :class:`Rule`: which nodes (by op class, module glob or node key) compute in which dtype.

See ``docs/architecture.md#policy-file`` (the format) and ``#node-keys-and-op-classes`` (the
keys and op classes rules select by).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from autoprec.dtypes import DTYPES
from autoprec.policy.fields import check_choice, fail, join

__all__ = ["FP8", "OP_CLASSES", "RULE_KEYS", "RULE_OP_CLASSES", "Rule"]

#: Op classes of ``ops.py``. ``nonfloat`` ops are never cast, so no rule may target them.
OP_CLASSES: tuple[str, ...] = ("matmul", "sensitive", "follow", "nonfloat")
#: Op classes a rule may target.
RULE_OP_CLASSES: tuple[str, ...] = ("matmul", "sensitive", "follow")
#: The fp8 dtype name, refused at load until fp8 matmuls are built (the passes cannot lower it).
FP8 = "fp8_e4m3"
RULE_KEYS: tuple[str, ...] = ("node", "module", "op_class", "dtype")


@dataclass(frozen=True)
class Rule:
    """One policy rule: nodes selected by every given selector compute in ``dtype``.

    Attributes:
        dtype: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (``"fp8_e4m3"`` is refused with a message
            saying fp8 matmuls are not supported yet: no pass can lower it).
        op_class: One of :data:`OP_CLASSES` except ``"nonfloat"`` (never cast), or None.
        module: An :func:`fnmatch.fnmatchcase` glob on the module path, e.g. ``"model.layers.0.*"``
            (which also matches ``"model.layers.0"`` itself) or ``"model.layers.0*"``. A glob
            without wildcards matches that module only, not its submodules.
        node: An exact node key, e.g. ``"model.layers.3.mlp.down_proj/linear#0"``.

    Raises:
        PolicyError: no selector is given, or a field has a wrong type or value.
    """

    dtype: str
    op_class: str | None = None
    module: str | None = None
    node: str | None = None

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
        dtype_path = join(path, "dtype")
        if self.dtype == FP8:
            raise fail(source, dtype_path, f"{FP8!r} is not supported yet: fp8 matmuls are not built in this "
                       f"version, so no pass can lower it; use one of {', '.join(sorted(DTYPES))}")
        check_choice(self.dtype, sorted(DTYPES), "dtype", source, dtype_path)

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
        """A short human form, e.g. ``"sensitive->fp32"`` or ``"model.layers.0.*:matmul->fp32"``."""
        sel = ":".join(s for s in (self.node, self.module, self.op_class) if s is not None)
        return f"{sel}->{self.dtype}"
