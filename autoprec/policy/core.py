"""The :class:`Policy` dataclass: validation, JSON layout, atomic save and validated load.

See ``autoprec.policy`` (the package docstring) and ``docs/architecture.md#policy-file``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from autoprec._io import atomic_write
from autoprec.dtypes import DTYPES
from autoprec.errors import PolicyError
from autoprec.policy.fields import (
    MAX_DEPTH,
    DuplicateKey,
    build,
    check_choice,
    check_keys,
    check_mapping,
    check_number,
    check_str,
    fail,
    jsonable,
    no_duplicates,
    type_name,
)
from autoprec.policy.loss_scaling import LOSS_SCALING_KEYS, LossScalingConfig
from autoprec.policy.rule import RULE_KEYS, SCHEMA2_RULE_KEYS, Rule

__all__ = ["ACCUMULATE_MODES", "FP8_SCALINGS", "GRAD_REDUCE_DTYPES", "READ_VERSIONS", "SCHEMA_VERSION", "TOP_LEVEL_KEYS", "Policy"]

#: The policy file format version this module writes when a policy uses a schema-2 field (a rule's
#: ``compute`` or ``saved``, or fp8); others are written as version 1, which older readers take.
SCHEMA_VERSION = 2
#: The versions :meth:`Policy.from_dict` reads (schema 1 loads unchanged).
READ_VERSIONS: tuple[int, ...] = (1, 2)
ACCUMULATE_MODES: tuple[str, ...] = ("fp32", "none")
#: dtypes gradients may be communicated in across ranks (``Policy.grad_reduce_dtype``).
GRAD_REDUCE_DTYPES: tuple[str, ...] = ("fp32", "bf16")
#: Scale granularities of fp8 matmuls (``Policy.fp8_scaling``; torchao.float8's recipes).
FP8_SCALINGS: tuple[str, ...] = ("tensorwise", "rowwise")
TOP_LEVEL_KEYS: tuple[str, ...] = (
    "schema_version", "default_dtype", "rules", "accumulate", "loss_scaling",
    "master_weights", "optimizer_state", "activation_memory_budget", "grad_reduce_dtype", "fp8_scaling", "provenance",
    "measured",
)


@dataclass(frozen=True)
class Policy:
    """A mixed-precision policy (docs/architecture.md#policy-file): default dtype, ordered rules and training settings.

    Attributes:
        default_dtype: dtype of float nodes no rule selects (``fp32``, ``bf16`` or ``fp16``);
            follow-class nodes may still take a cheaper dtype from cast placement.
        rules: Ordered :class:`Rule` tuple; later rules override earlier ones, node rules win.
            A list is accepted and stored as a tuple.
        accumulate: ``"fp32"`` (low-precision reductions accumulate in fp32) or ``"none"``.
        loss_scaling: :class:`LossScalingConfig`.
        master_weights: Only ``"fp32"`` is supported (cases C08).
        optimizer_state: Only ``"fp32"`` is supported (cases C08).
        activation_memory_budget: Fraction in [0, 1] of the activations the compiled graph keeps
            for backward, relative to Inductor's runtime-optimal partition (1.0, the default);
            the rest is recomputed in backward. 0.0 recomputes the whole forward (activation
            checkpointing of the compiled region). Passed to
            ``torch._functorch.config.activation_memory_budget`` when the graph is compiled;
            eager execution ignores it. ``autoprec tune --max-memory`` sets it.
        grad_reduce_dtype: dtype gradients are communicated in across ranks: ``"fp32"`` (default)
            or ``"bf16"`` (DDP's ``bf16_compress_hook``, FSDP2's ``MixedPrecisionPolicy(reduce_dtype=
            torch.bfloat16)``: :mod:`autoprec.runtime.distributed`); one process ignores it. The
            ``.grad`` of the master weights stays fp32 either way.
        fp8_scaling: How fp8 matmuls (compute ``fp8_e4m3``) scale their operands: ``"tensorwise"``
            (default; one amax scale per tensor) or ``"rowwise"`` (one per row of the input and per
            output row of the weight), torchao.float8's two recipes (:mod:`autoprec.kernels.fp8`).
            Written only when ``"rowwise"``.
        provenance: Read-only JSON-ready mapping (model, graph fingerprint, device, versions, ...).
        measured: Read-only mapping of finite numbers (tokens_per_s, grad_rel_l2, peak_bytes, ...).

    Raises:
        PolicyError: a field is invalid; fp16 is used while ``loss_scaling.mode`` is ``"none"``.
    """

    default_dtype: str = "bf16"
    rules: tuple[Rule, ...] = ()
    accumulate: str = "fp32"
    loss_scaling: LossScalingConfig = field(default_factory=LossScalingConfig)
    master_weights: str = "fp32"
    optimizer_state: str = "fp32"
    activation_memory_budget: float = 1.0
    grad_reduce_dtype: str = "fp32"
    fp8_scaling: str = "tensorwise"
    provenance: Mapping[str, Any] = field(default_factory=dict)
    measured: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._validate("Policy", "")

    def _validate(self, source: str, path: str = "") -> None:
        """Check every field once naming ``source``, then normalise (rules to a tuple, read-only
        deep copies of ``provenance`` and ``measured``). ``path`` is unused (the policy is the root)."""
        _check_fields(self, source)
        object.__setattr__(self, "rules", tuple(self.rules))
        object.__setattr__(self, "activation_memory_budget", float(self.activation_memory_budget))
        provenance = jsonable(dict(self.provenance or {}), source, "provenance")
        object.__setattr__(self, "provenance", MappingProxyType(provenance))
        object.__setattr__(self, "measured", MappingProxyType(dict(self.measured)))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # MappingProxyType cannot be pickled; rebuild from plain dicts (pickle, copy.deepcopy).
        args = tuple(getattr(self, f.name) for f in dataclasses.fields(self))
        return (type(self), args[:-2] + (dict(self.provenance), dict(self.measured)))

    # -- constructors ---------------------------------------------------------------------------
    @classmethod
    def default(cls, low: str = "bf16") -> Policy:
        """Autocast-like policy: everything in ``low`` except sensitive ops in fp32."""
        return cls(default_dtype=low, rules=(Rule(op_class="sensitive", dtype="fp32"),))

    @classmethod
    def fp32(cls) -> Policy:
        """The full-precision reference policy: fp32 everywhere, no rules."""
        return cls(default_dtype="fp32")

    # -- queries --------------------------------------------------------------------------------
    def _last(self, field: str, key: str, op_class: str, module_path: str) -> Rule | None:
        """The last matching node rule that sets ``field``, else the last matching rule that does."""
        hit: Rule | None = None
        for by_node in (False, True):
            for rule in self.rules:
                if (rule.node is not None) == by_node and getattr(rule, field) is not None \
                        and rule.matches(key, op_class, module_path):
                    hit = rule
        return hit

    def resolve_rule(self, key: str, op_class: str, module_path: str) -> Rule | None:
        """The rule that decides one node's storage and compute dtype: the last matching node rule
        with a ``dtype``, else the last matching rule with one, else None (its ``compute`` goes
        with its ``dtype``: a later rule that sets ``dtype`` resets both).

        Args:
            key: Node key; op_class: its op class; module_path: its innermost module path.
        """
        return self._last("dtype", key, op_class, module_path)

    def resolve(self, key: str, op_class: str, module_path: str) -> str | None:
        """The storage dtype for one node (:meth:`resolve_rule`'s ``storage``), or None when no
        rule sets one (the caller applies ``default_dtype`` or, for follow-class nodes, cast
        placement)."""
        rule = self.resolve_rule(key, op_class, module_path)
        return rule.storage if rule is not None else None

    def resolve_saved(self, key: str, op_class: str, module_path: str) -> str | None:
        """What one node's output is saved as for backward: the last matching rule (node rules
        win) that sets ``saved``, else None (saved as stored)."""
        rule = self._last("saved", key, op_class, module_path)
        return rule.saved if rule is not None else None

    def dtypes_used(self) -> set[str]:
        """``default_dtype`` plus every rule's storage, compute and saved dtype (fp8 names included)."""
        used = {self.default_dtype}
        for r in self.rules:
            used |= {d for d in (r.storage, r.compute_dtype, r.saved) if d is not None}
        return used

    @property
    def needs_loss_scaling(self) -> bool:
        """True when the policy stores or computes anything in fp16 (gradients underflow
        otherwise, C07)."""
        return "fp16" in {self.default_dtype, *(d for r in self.rules for d in (r.storage, r.compute_dtype))}

    def training_key(self) -> str:
        """What identifies the policy as training runs it: its JSON text without ``provenance``
        and ``measured``. Two policies with equal keys train identically (the one rule for
        "same policy": checkpoint resume and finalist bookkeeping use it)."""
        return dataclasses.replace(self, measured={}, provenance={}).to_json()

    def with_measured(self, measured: Mapping[str, float]) -> Policy:
        """A copy whose ``measured`` is replaced by ``measured`` (a new measurement supersedes)."""
        return dataclasses.replace(self, measured=dict(measured))

    def with_provenance(self, **kw: Any) -> Policy:
        """A copy with ``kw`` merged into ``provenance`` (new keys win)."""
        return dataclasses.replace(self, provenance={**self.provenance, **kw})

    def summary(self) -> str:
        """One line, e.g. ``"default bf16; sensitive->fp32; 2 node rules"``."""
        parts = [f"default {self.default_dtype}"]
        other = [r.describe() for r in self.rules if r.node is None]
        parts += other[:6] + ([f"+{len(other) - 6} more rules"] if len(other) > 6 else [])
        n_node = sum(r.node is not None for r in self.rules)
        if n_node:
            parts.append(f"{n_node} node rule{'s' if n_node != 1 else ''}")
        if self.needs_loss_scaling:
            parts.append(f"loss scaling {self.loss_scaling.mode}")
        if self.activation_memory_budget < 1.0:
            parts.append(f"activation memory budget {self.activation_memory_budget:g}")
        if self.grad_reduce_dtype != "fp32":
            parts.append(f"gradients reduced in {self.grad_reduce_dtype}")
        if self.fp8_scaling != "tensorwise":
            parts.append(f"fp8 scaling {self.fp8_scaling}")
        return "; ".join(parts)

    # -- JSON -----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The docs/architecture.md#policy-file JSON layout (``loss_scaling`` adds max_scale);
        ``schema_version`` is 2 when a rule uses ``compute``, ``saved`` or fp8, else 1.

        ``activation_memory_budget`` is written only below 1.0 and ``grad_reduce_dtype`` only when
        not ``fp32``, so a policy without them stays readable by autoprec versions that predate
        the fields (and keeps its ``training_key``).
        """
        d = {
            "schema_version": SCHEMA_VERSION if self.fp8_scaling != "tensorwise" or any(r.schema2 for r in self.rules) else 1,
            "default_dtype": self.default_dtype,
            "rules": [r.to_dict() for r in self.rules],
            "accumulate": self.accumulate,
            "loss_scaling": self.loss_scaling.to_dict(),
            "master_weights": self.master_weights,
            "optimizer_state": self.optimizer_state,
        }
        if self.activation_memory_budget < 1.0:
            d["activation_memory_budget"] = self.activation_memory_budget
        if self.grad_reduce_dtype != "fp32":
            d["grad_reduce_dtype"] = self.grad_reduce_dtype
        if self.fp8_scaling != "tensorwise":
            d["fp8_scaling"] = self.fp8_scaling
        return d | {"provenance": jsonable(self.provenance, "Policy", "provenance"),
                    "measured": dict(self.measured)}

    @classmethod
    def from_dict(cls, d: Any, source: str = "<dict>") -> Policy:
        """Build a policy from its JSON object, validating every field.

        Missing fields other than ``schema_version`` take their defaults.

        Args:
            d: The decoded JSON object.
            source: Named in every error message (the file path when loading).

        Raises:
            PolicyError: naming ``source`` and the field, for any invalid or unknown value.
        """
        d = check_mapping(d, source, "")
        if "schema_version" not in d:
            raise fail(source, "schema_version", f"missing; this autoprec reads versions {_versions()}")
        version = d["schema_version"]
        if isinstance(version, bool) or not isinstance(version, int) or version not in READ_VERSIONS:
            raise fail(source, "schema_version",
                       f"{version!r} is not supported; this autoprec reads versions {_versions()}")
        check_keys(d, TOP_LEVEL_KEYS, "top-level", source, "")
        kw: dict[str, Any] = {k: d[k] for k in ("default_dtype", "accumulate", "master_weights",
                                                  "optimizer_state", "activation_memory_budget",
                                                  "grad_reduce_dtype", "fp8_scaling") if k in d}
        kw["rules"] = _rules_from_json(d.get("rules", []), source, version)
        if version < 2 and "fp8_scaling" in d:
            raise fail(source, "fp8_scaling", "needs schema_version 2 (a schema-2 field); this file says 1")
        if "loss_scaling" in d:
            ls = check_mapping(d["loss_scaling"], source, "loss_scaling")
            check_keys(ls, LOSS_SCALING_KEYS, "loss_scaling", source, "loss_scaling")
            kw["loss_scaling"] = build(LossScalingConfig, ls, source, "loss_scaling")
        kw["provenance"] = check_mapping(d.get("provenance", {}), source, "provenance")
        kw["measured"] = check_mapping(d.get("measured", {}), source, "measured")
        return build(cls, kw, source)

    def to_json(self) -> str:
        """The policy as indented JSON (``indent=2``, keys in layout order).

        Raises:
            PolicyError: a value is non-finite or not JSON-serialisable (names the field).
        """
        d = self.to_dict()
        try:
            return json.dumps(d, indent=2, sort_keys=False, allow_nan=False)
        except (ValueError, TypeError) as e:
            for name in ("measured", "provenance"):
                jsonable(d[name], "Policy", name)
            raise PolicyError(f"Policy: cannot be written as JSON: {e}") from e

    def save(self, path: str | os.PathLike) -> None:
        """Write the policy to ``path`` atomically, creating parent directories.

        The JSON goes to a temporary file in the same directory, which is flushed, fsynced and
        renamed over ``path`` with :func:`os.replace`; on any error the temporary file is
        removed and an existing ``path`` is left untouched.

        Raises:
            PolicyError: the policy cannot be serialised (nothing is written).
            OSError: the file system refused the write (the old file stays intact).
        """
        text = self.to_json() + "\n"
        atomic_write(path, lambda f: f.write(text))

    @classmethod
    def load(cls, path: str | os.PathLike) -> Policy:
        """Read and validate a policy file (JSON only; never pickle or eval).

        Raises:
            PolicyError: the file is missing or unreadable, is not valid UTF-8 JSON (message gives
                line and column; lists and objects nested too deeply to parse included), or any
                field is invalid; the message names ``path``.
        """
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8-sig")
        except FileNotFoundError:
            raise PolicyError(f"{source}: no such policy file") from None
        except IsADirectoryError:
            raise PolicyError(f"{source}: is a directory, not a policy file") from None
        except UnicodeDecodeError as e:
            raise PolicyError(f"{source}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except OSError as e:
            raise PolicyError(f"{source}: cannot read policy file: {e.strerror or e}") from e
        try:
            data = json.loads(text, object_pairs_hook=no_duplicates)
            return cls.from_dict(data, source=source)
        except json.JSONDecodeError as e:
            where = f"line {e.lineno}, column {e.colno}"
            raise PolicyError(f"{source}: invalid JSON at {where}: {e.msg}") from None
        except DuplicateKey as e:
            raise PolicyError(f"{source}: invalid JSON: duplicate key {e.args[0]!r} in an object") from None
        except RecursionError:  # json's C scanner (or a repr in an error message) on e.g. '[' * 100000
            raise PolicyError(f"{source}: invalid JSON: lists and objects nested too deeply to read "
                              f"(a policy file nests {MAX_DEPTH} levels at most)") from None


# ---------------------------------------------------------------------------------------- helpers


def _check_fields(p: Policy, source: str) -> None:
    """The checks of :meth:`Policy._validate`, in the order their errors are reported."""
    check_choice(p.default_dtype, sorted(DTYPES), "dtype", source, "default_dtype")
    if not isinstance(p.rules, (tuple, list)):
        raise fail(source, "rules", f"expected a list of rules, got {type_name(p.rules)}")
    for i, rule in enumerate(p.rules):
        if not isinstance(rule, Rule):
            raise fail(source, f"rules[{i}]", f"expected a Rule, got {type_name(rule)} {rule!r}")
    check_choice(p.accumulate, ACCUMULATE_MODES, "accumulate mode", source, "accumulate")
    if not isinstance(p.loss_scaling, LossScalingConfig):
        raise fail(source, "loss_scaling", f"expected a LossScalingConfig, got {type_name(p.loss_scaling)}")
    for name in ("master_weights", "optimizer_state"):
        value = check_str(getattr(p, name), source, name)
        if value != "fp32":
            raise fail(source, name, f"{value!r} is not supported; autoprec keeps {name.replace('_', ' ')} "
                       "in fp32 whatever the compute dtype (low-precision state stalls or NaNs, cases C08)")
    amb = check_number(p.activation_memory_budget, source, "activation_memory_budget")
    if not 0.0 <= amb <= 1.0:
        raise fail(source, "activation_memory_budget", f"{amb!r} is outside [0, 1] (a fraction of the "
                   "activations Inductor saves by default; 1.0 = no extra recomputation)")
    check_choice(p.grad_reduce_dtype, GRAD_REDUCE_DTYPES, "gradient reduction dtype", source, "grad_reduce_dtype")
    check_choice(p.fp8_scaling, FP8_SCALINGS, "fp8 scaling", source, "fp8_scaling")
    check_mapping(p.provenance, source, "provenance")
    for k, v in check_mapping(p.measured, source, "measured").items():
        if not isinstance(k, str):
            raise fail(source, "measured", f"keys must be strings, got {type_name(k)} {k!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise fail(source, f"measured.{k}", f"expected a number, got {type_name(v)} {v!r}")
        if not math.isfinite(v):
            raise fail(source, f"measured.{k}", f"{v!r} is not a finite number")
    if p.loss_scaling.mode == "none" and p.needs_loss_scaling:
        where = "default_dtype" if p.default_dtype == "fp16" else next(
            f"rules[{i}].{k}" for i, r in enumerate(p.rules) for k in ("dtype", "compute") if getattr(r, k) == "fp16")
        raise fail(source, "loss_scaling.mode", f"'none' but {where} is fp16: fp16 without a loss scaler "
                   "is refused (small gradients underflow to 0 in fp16, cases C07); use 'dynamic'")


def _versions() -> str:
    return " and ".join(map(str, READ_VERSIONS))


def _rules_from_json(rules: Any, source: str, version: int) -> list[Rule]:
    """The ``rules`` list of a policy file as :class:`Rule` objects, each validated once; a
    schema-1 file may not use the schema-2 rule fields."""
    if not isinstance(rules, list):
        raise fail(source, "rules", f"expected a list, got {type_name(rules)} {rules!r}")
    out = []
    for i, raw in enumerate(rules):
        path = f"rules[{i}]"
        raw = check_mapping(raw, source, path)
        check_keys(raw, RULE_KEYS, "rule", source, path)
        if "dtype" not in raw and "saved" not in raw and "compute" not in raw:
            raise fail(source, f"{path}.dtype", "missing")
        rule = build(Rule, raw, source, path)
        if version < 2 and rule.schema2:
            field = next((k for k in SCHEMA2_RULE_KEYS if k in raw), "dtype")
            raise fail(source, f"{path}.{field}", f"{raw[field]!r} needs schema_version 2 "
                       "(compute, saved and fp8 are schema-2 fields); this file says 1")
        out.append(rule)
    return out
