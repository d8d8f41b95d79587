"""Precision policies: frozen dataclasses, JSON schema v1, atomic save, validated load (DESIGN §4).

A :class:`Policy` says which dtype each graph node computes in. It is a default dtype plus an
ordered list of :class:`Rule` objects; a rule selects nodes by op class (``ops.py``), by a module
glob, or by an exact node key (``<module path>/<op>#<k>``, DESIGN §3). Later rules override earlier
ones and node rules win over all others.

Every invalid value raises :class:`~autoprec.errors.PolicyError` whose message names the source
(a file path, or the class being constructed) and the exact field, e.g.
``p.json: rules[2].dtype: 'fp64' is not a valid dtype; valid: bf16, fp16, fp32``.
Files are read with :mod:`json` only (never pickle, never eval) and written atomically.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
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

#: The policy file format version this module reads and writes.
SCHEMA_VERSION = 1
#: Op classes of ``ops.py`` (DESIGN §3). ``nonfloat`` ops are never cast, so no rule may target them.
OP_CLASSES: tuple[str, ...] = ("matmul", "sensitive", "follow", "nonfloat")
#: Op classes a rule may target.
RULE_OP_CLASSES: tuple[str, ...] = ("matmul", "sensitive", "follow")
#: dtype allowed only for matmul rules and node rules (on devices that have it).
FP8 = "fp8_e4m3"
ACCUMULATE_MODES: tuple[str, ...] = ("fp32", "none")
LOSS_SCALING_MODES: tuple[str, ...] = ("dynamic", "none")
RULE_KEYS: tuple[str, ...] = ("node", "module", "op_class", "dtype")
LOSS_SCALING_KEYS: tuple[str, ...] = (
    "mode", "init_scale", "growth_factor", "backoff_factor", "growth_interval", "min_scale", "max_scale",
)
TOP_LEVEL_KEYS: tuple[str, ...] = (
    "schema_version", "default_dtype", "rules", "accumulate", "loss_scaling",
    "master_weights", "optimizer_state", "activation_memory_budget", "provenance", "measured",
)


# ----------------------------------------------------------------------------------------- checks


def _fail(source: str, path: str, msg: str) -> PolicyError:
    return PolicyError(f"{source}: {path}: {msg}" if path else f"{source}: {msg}")


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _check_str(value: Any, source: str, path: str) -> str:
    if not isinstance(value, str):
        raise _fail(source, path, f"expected a string, got {_type_name(value)} {value!r}")
    return str(value)


def _check_choice(value: Any, valid: tuple[str, ...] | list[str], what: str, source: str, path: str) -> str:
    value = _check_str(value, source, path)
    if value not in valid:
        raise _fail(source, path, f"{value!r} is not a valid {what}; valid: {', '.join(valid)}")
    return value


def _check_number(value: Any, source: str, path: str) -> float:
    """A finite int or float (bool is not a number); returned as float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(source, path, f"expected a number, got {_type_name(value)} {value!r}")
    if not math.isfinite(value):
        raise _fail(source, path, f"{value!r} is not a finite number")
    return float(value)


def _check_keys(d: Mapping, valid: tuple[str, ...], what: str, source: str, path: str) -> None:
    for key in d:
        if key not in valid:
            hint = difflib.get_close_matches(str(key), valid, n=1)
            did = f"did you mean {hint[0]!r}? " if hint else ""
            raise _fail(source, _join(path, str(key)), f"unknown {what} key; {did}valid: {', '.join(valid)}")


def _check_mapping(value: Any, source: str, path: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise _fail(source, path, f"expected a JSON object, got {_type_name(value)} {value!r}")
    return value


def _jsonable(value: Any, source: str, path: str) -> Any:
    """A plain-JSON deep copy of ``value`` (tuples become lists); rejects non-finite floats."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _fail(source, path, f"{value!r} is not a finite number; JSON cannot hold it")
        return float(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, source, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise _fail(source, path, f"keys must be strings, got {_type_name(k)} {k!r}")
            out[str(k)] = _jsonable(v, source, _join(path, k))
        return out
    raise _fail(source, path, f"{_type_name(value)} {value!r} is not JSON-serialisable; convert it to str")


def _check_rule(rule: Rule, source: str, path: str) -> None:
    """Validate one rule's fields; ``path`` is e.g. ``"rules[2]"`` (or ``""`` for a bare Rule)."""
    for name in ("op_class", "module", "node"):
        value = getattr(rule, name)
        if value is not None and (not isinstance(value, str) or not value):
            raise _fail(source, _join(path, name), f"expected a non-empty string, got {value!r}")
    if rule.op_class is None and rule.module is None and rule.node is None:
        raise _fail(source, path, "a rule needs at least one of op_class, module, node")
    if rule.op_class is not None:
        if rule.op_class != "nonfloat":
            _check_choice(rule.op_class, RULE_OP_CLASSES, "op_class", source, _join(path, "op_class"))
        else:
            raise _fail(source, _join(path, "op_class"),
                        "'nonfloat' ops (integer/bool tensors, indices, masks) are never cast; "
                        "a rule cannot target them (cases C11)")
    fp8_ok = rule.op_class == "matmul" or rule.node is not None
    valid = sorted(DTYPES) + ([FP8] if fp8_ok else [])
    dtype_path = _join(path, "dtype")
    if rule.dtype == FP8 and not fp8_ok:
        raise _fail(source, dtype_path, f"{FP8!r} is allowed only in op_class 'matmul' rules and node rules")
    _check_choice(rule.dtype, valid, "dtype", source, dtype_path)


def _check_loss_scaling(cfg: LossScalingConfig, source: str, path: str) -> dict[str, Any]:
    """Validate a loss-scaling config; returns its fields normalised (floats as float)."""

    def at(name: str) -> str:
        return _join(path, name)

    out: dict[str, Any] = {"mode": _check_choice(cfg.mode, LOSS_SCALING_MODES, "mode", source, at("mode"))}
    for name in ("init_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale"):
        out[name] = _check_number(getattr(cfg, name), source, at(name))
    gi = cfg.growth_interval
    if isinstance(gi, bool) or not isinstance(gi, int):
        raise _fail(source, at("growth_interval"), f"expected an integer, got {_type_name(gi)} {gi!r}")
    if gi < 1:
        raise _fail(source, at("growth_interval"), f"must be >= 1 (optimizer steps), got {gi}")
    out["growth_interval"] = int(gi)
    init = out["init_scale"]
    if init <= 0:
        raise _fail(source, at("init_scale"), f"must be > 0, got {init!r}")
    if out["growth_factor"] <= 1:
        raise _fail(source, at("growth_factor"), f"must be > 1, got {out['growth_factor']!r}")
    if not 0 < out["backoff_factor"] < 1:
        raise _fail(source, at("backoff_factor"), f"must be in (0, 1), got {out['backoff_factor']!r}")
    if out["min_scale"] <= 0:
        raise _fail(source, at("min_scale"), f"must be > 0, got {out['min_scale']!r}")
    if out["min_scale"] > init:
        raise _fail(source, at("min_scale"), f"{out['min_scale']!r} is above init_scale {init!r}")
    if out["max_scale"] < init:
        raise _fail(source, at("max_scale"), f"{out['max_scale']!r} is below init_scale {init!r}")
    return out


# ------------------------------------------------------------------------------------ dataclasses


@dataclass(frozen=True)
class Rule:
    """One policy rule: nodes selected by every given selector compute in ``dtype``.

    Attributes:
        dtype: ``"fp32"``, ``"bf16"`` or ``"fp16"``; ``"fp8_e4m3"`` only when ``op_class`` is
            ``"matmul"`` or ``node`` is set.
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
        _check_rule(self, "Rule", "")

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


@dataclass(frozen=True)
class LossScalingConfig:
    """Dynamic loss-scaling settings (consumed by ``runtime.DynamicLossScaler``).

    The defaults are those of ``torch.amp.GradScaler``
    (https://pytorch.org/docs/stable/amp.html#torch.amp.GradScaler): ``init_scale=2**16``,
    ``growth_factor=2.0``, ``backoff_factor=0.5``, ``growth_interval=2000``. ``min_scale`` and
    ``max_scale`` are autoprec additions (GradScaler has neither): a floor at which a persisting
    overflow is an error, and a cap so a tiny loss cannot grow the scale to inf (cases C09).

    Attributes:
        mode: ``"dynamic"`` or ``"none"``. ``"none"`` is refused for policies that use fp16
            (fp16 gradients underflow without scaling, cases C07).
        init_scale: Initial scale, > 0 (a multiplier, unitless).
        growth_factor: Scale multiplier after ``growth_interval`` clean steps, > 1.
        backoff_factor: Scale multiplier on a step with inf/NaN gradients, in (0, 1).
        growth_interval: Consecutive clean optimizer steps before growing, integer >= 1.
        min_scale: Floor, 0 < min_scale <= init_scale.
        max_scale: Cap, >= init_scale.

    Raises:
        PolicyError: a field has a wrong type, is non-finite or out of range.
    """

    mode: str = "dynamic"
    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    max_scale: float = 2.0**24

    def __post_init__(self) -> None:
        for name, value in _check_loss_scaling(self, "LossScalingConfig", "").items():
            object.__setattr__(self, name, value)

    def to_dict(self) -> dict[str, Any]:
        """The config as a JSON object in field order."""
        return {k: getattr(self, k) for k in LOSS_SCALING_KEYS}


def _readonly(value: Mapping | None, source: str, path: str) -> Mapping[str, Any]:
    return MappingProxyType(_jsonable(dict(value or {}), source, path))


@dataclass(frozen=True)
class Policy:
    """A mixed-precision policy (DESIGN §4): default dtype, ordered rules and training settings.

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
    provenance: Mapping[str, Any] = field(default_factory=dict)
    measured: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_policy(self, "Policy")
        object.__setattr__(self, "rules", tuple(self.rules))
        object.__setattr__(self, "activation_memory_budget", float(self.activation_memory_budget))
        object.__setattr__(self, "provenance", _readonly(self.provenance, "Policy", "provenance"))
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
    def resolve(self, key: str, op_class: str, module_path: str) -> str | None:
        """dtype for one node: the last matching node rule, else the last matching rule, else None.

        Args:
            key: Node key; op_class: its op class; module_path: its innermost module path.

        Returns:
            A dtype name, or None when no rule matches (the caller applies ``default_dtype``
            or, for follow-class nodes, cast placement).
        """
        hit: str | None = None
        for rule in self.rules:
            if rule.node is None and rule.matches(key, op_class, module_path):
                hit = rule.dtype
        for rule in self.rules:
            if rule.node is not None and rule.matches(key, op_class, module_path):
                hit = rule.dtype
        return hit

    def dtypes_used(self) -> set[str]:
        """``default_dtype`` plus every rule's dtype."""
        return {self.default_dtype, *(r.dtype for r in self.rules)}

    @property
    def needs_loss_scaling(self) -> bool:
        """True when the policy computes anything in fp16 (gradients underflow otherwise, C07)."""
        return "fp16" in self.dtypes_used()

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
        return "; ".join(parts)

    # -- JSON -----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The DESIGN §4 JSON layout with ``"schema_version": 1`` (``loss_scaling`` adds max_scale).

        ``activation_memory_budget`` is written only below 1.0, so a policy without it stays
        readable by autoprec versions that predate the field.
        """
        d = {
            "schema_version": SCHEMA_VERSION,
            "default_dtype": self.default_dtype,
            "rules": [r.to_dict() for r in self.rules],
            "accumulate": self.accumulate,
            "loss_scaling": self.loss_scaling.to_dict(),
            "master_weights": self.master_weights,
            "optimizer_state": self.optimizer_state,
        }
        if self.activation_memory_budget < 1.0:
            d["activation_memory_budget"] = self.activation_memory_budget
        return d | {"provenance": _jsonable(self.provenance, "Policy", "provenance"),
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
        d = _check_mapping(d, source, "")
        if "schema_version" not in d:
            raise _fail(source, "schema_version", f"missing; this autoprec reads version {SCHEMA_VERSION}")
        version = d["schema_version"]
        if isinstance(version, bool) or not isinstance(version, int) or version != SCHEMA_VERSION:
            raise _fail(source, "schema_version",
                        f"{version!r} is not supported; this autoprec reads version {SCHEMA_VERSION}")
        _check_keys(d, TOP_LEVEL_KEYS, "top-level", source, "")
        kw: dict[str, Any] = {k: d[k] for k in ("default_dtype", "accumulate", "master_weights",
                                                  "optimizer_state", "activation_memory_budget") if k in d}
        kw["rules"] = _rules_from_json(d.get("rules", []), source)
        if "loss_scaling" in d:
            ls = _check_mapping(d["loss_scaling"], source, "loss_scaling")
            _check_keys(ls, LOSS_SCALING_KEYS, "loss_scaling", source, "loss_scaling")
            kw["loss_scaling"] = _draft(LossScalingConfig, **{**LossScalingConfig().to_dict(), **ls})
        kw["provenance"] = _check_mapping(d.get("provenance", {}), source, "provenance")
        kw["measured"] = _check_mapping(d.get("measured", {}), source, "measured")
        return _construct(cls, kw, source)

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
                _jsonable(d[name], "Policy", name)
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
                line and column), or any field is invalid; the message names ``path``.
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
            data = json.loads(text, object_pairs_hook=_no_duplicates)
        except json.JSONDecodeError as e:
            where = f"line {e.lineno}, column {e.colno}"
            raise PolicyError(f"{source}: invalid JSON at {where}: {e.msg}") from None
        except _DuplicateKey as e:
            raise PolicyError(f"{source}: invalid JSON: duplicate key {e.args[0]!r} in an object") from None
        return cls.from_dict(data, source=source)


# ---------------------------------------------------------------------------------------- helpers


def _check_policy(p: Policy, source: str) -> None:
    _check_choice(p.default_dtype, sorted(DTYPES), "dtype", source, "default_dtype")
    if not isinstance(p.rules, (tuple, list)):
        raise _fail(source, "rules", f"expected a list of rules, got {_type_name(p.rules)}")
    for i, rule in enumerate(p.rules):
        if not isinstance(rule, Rule):
            raise _fail(source, f"rules[{i}]", f"expected a Rule, got {_type_name(rule)} {rule!r}")
    _check_choice(p.accumulate, ACCUMULATE_MODES, "accumulate mode", source, "accumulate")
    if not isinstance(p.loss_scaling, LossScalingConfig):
        raise _fail(source, "loss_scaling", f"expected a LossScalingConfig, got {_type_name(p.loss_scaling)}")
    for name in ("master_weights", "optimizer_state"):
        value = _check_str(getattr(p, name), source, name)
        if value != "fp32":
            raise _fail(source, name, f"{value!r} is not supported; autoprec keeps {name.replace('_', ' ')} "
                        "in fp32 whatever the compute dtype (low-precision state stalls or NaNs, cases C08)")
    amb = _check_number(p.activation_memory_budget, source, "activation_memory_budget")
    if not 0.0 <= amb <= 1.0:
        raise _fail(source, "activation_memory_budget", f"{amb!r} is outside [0, 1] (a fraction of the "
                    "activations Inductor saves by default; 1.0 = no extra recomputation)")
    _check_mapping(p.provenance, source, "provenance")
    for k, v in _check_mapping(p.measured, source, "measured").items():
        if not isinstance(k, str):
            raise _fail(source, "measured", f"keys must be strings, got {_type_name(k)} {k!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _fail(source, f"measured.{k}", f"expected a number, got {_type_name(v)} {v!r}")
        if not math.isfinite(v):
            raise _fail(source, f"measured.{k}", f"{v!r} is not a finite number")
    if p.loss_scaling.mode == "none" and "fp16" in p.dtypes_used():
        where = "default_dtype" if p.default_dtype == "fp16" else next(
            f"rules[{i}].dtype" for i, r in enumerate(p.rules) if r.dtype == "fp16")
        raise _fail(source, "loss_scaling.mode", f"'none' but {where} is fp16: fp16 without a loss scaler "
                    "is refused (small gradients underflow to 0 in fp16, cases C07); use 'dynamic'")


def _rules_from_json(rules: Any, source: str) -> list[Rule]:
    if not isinstance(rules, list):
        raise _fail(source, "rules", f"expected a list, got {_type_name(rules)} {rules!r}")
    out = []
    for i, raw in enumerate(rules):
        path = f"rules[{i}]"
        raw = _check_mapping(raw, source, path)
        _check_keys(raw, RULE_KEYS, "rule", source, path)
        if "dtype" not in raw:
            raise _fail(source, f"{path}.dtype", "missing")
        _check_rule(_draft(Rule, **{k: raw.get(k) for k in RULE_KEYS}), source, path)
        out.append(Rule(**dict(raw)))
    return out


def _construct(cls: type[Policy], kw: dict[str, Any], source: str) -> Policy:
    """Validate ``kw`` naming ``source``, then build the policy."""
    if "loss_scaling" in kw:
        _check_loss_scaling(kw["loss_scaling"], source, "loss_scaling")
        ls = kw["loss_scaling"]
        kw["loss_scaling"] = LossScalingConfig(**{k: getattr(ls, k) for k in LOSS_SCALING_KEYS})
    defaults = {f.name: getattr(Policy(), f.name) for f in dataclasses.fields(cls)}
    _check_policy(_draft(cls, **{**defaults, **kw}), source)
    _jsonable(kw["provenance"], source, "provenance")
    return cls(**kw)


def _draft(cls: type, **values: Any) -> Any:
    """An instance of frozen dataclass ``cls`` with ``values`` set and no ``__post_init__`` run.

    Lets ``from_dict`` validate raw JSON with the file's name and field paths before the real
    constructor (which validates again, with a generic source) runs.
    """
    obj = object.__new__(cls)
    for name, value in values.items():
        object.__setattr__(obj, name, value)
    return obj


class _DuplicateKey(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out
