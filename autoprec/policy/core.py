"""The :class:`Policy` dataclass: validation, JSON layout, atomic save and validated load.

See ``autoprec.policy`` (the package docstring) and ``docs/architecture.md#policy-file``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from autoprec._io import atomic_write
from autoprec.errors import PolicyError
from autoprec.policy.batching import Batching
from autoprec.policy.checks import (
    ACCUMULATE_MODES,
    FOLLOW_PLACEMENTS,
    FP8_SCALINGS,
    GRAD_REDUCE_DTYPES,
    READ_VERSIONS,
    SCHEMA_VERSION,
    TOP_LEVEL_KEYS,
)
from autoprec.policy.checks import check_fields as _check_fields
from autoprec.policy.checks import rules_from_json as _rules_from_json
from autoprec.policy.checks import versions as _versions
from autoprec.policy.compile_options import REGIONAL_EMULATED, TORCH_COMPILE, CompileOptions, flat_reason
from autoprec.policy.fields import (
    MAX_DEPTH,
    DuplicateKey,
    build,
    check_keys,
    check_mapping,
    fail,
    jsonable,
    no_duplicates,
)
from autoprec.policy.loss_scaling import LOSS_SCALING_KEYS, LossScalingConfig
from autoprec.policy.rule import Rule

__all__ = ["ACCUMULATE_MODES", "FOLLOW_PLACEMENTS", "FP8_SCALINGS", "GRAD_REDUCE_DTYPES", "READ_VERSIONS",
           "SCHEMA_VERSION", "TOP_LEVEL_KEYS", "Policy"]



@dataclass(frozen=True)
class Policy:
    """A mixed-precision policy (docs/architecture.md#policy-file): default dtype, ordered rules and training
    settings.

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
            torch.bfloat16)``: :mod:`autoprec.distributed.wrap`); one process ignores it. The
            ``.grad`` of the master weights stays fp32 either way.
        fp8_scaling: The torchao.float8 recipe of fp8 matmuls (compute ``fp8_e4m3``):
            ``"tensorwise"`` (default; one amax scale per tensor, e5m2 gradients), ``"rowwise"``
            (one power-of-two scale per row of each operand, all e4m3) or ``"rowwise_with_gw_hp"``
            (rowwise, the weight gradient in high precision); :mod:`autoprec.kernels.fp8`. Written
            only when not ``"tensorwise"``.
        follow_placement: How ``follow`` nodes that no rule selects get their dtype:
            ``"mincut"`` (default; the dtype that minimises bytes cast, :func:`autoprec.graph.place_follow`)
            or ``"promote"`` (PyTorch's type promotion over the node's float inputs, as
            ``torch.autocast`` runs every op outside its lists: fp32 as soon as one input is fp32;
            ``torch.result_type``). A schema-2 field, written only when ``"promote"``.
        attention: How ``scaled_dot_product_attention`` runs: ``"fused"`` (default; PyTorch's
            fused kernel) or ``"math"`` (two explicit GEMMs in the node's dtype and an fp32
            softmax, :mod:`autoprec.kernels.attention`; faster than the fused kernel where native
            low-precision GEMMs are, and measured by the search). A schema-2 field, written only
            when ``"math"``.
        compile_options: How the graph is compiled (:class:`CompileOptions`; None: no say, as
            ``torch.compile(model)``). A schema-3 field.
        batching: The micro-batch and gradient accumulation training runs (:class:`Batching`,
            ``tune --global-batch``; None: the model file's batch, no accumulation). A schema-4 field.
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
    follow_placement: str = "mincut"
    attention: str = "fused"
    compile_options: CompileOptions | None = None
    batching: Batching | None = None
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
        """Autocast-like policy: everything in ``low`` except sensitive ops in fp32, unmeasured.

        Whether it is faster than fp32 depends on the device: ``low`` kernels are fast where they
        are native (GPUs; CPUs with AVX512-BF16 or AMX); on a CPU with AVX2 only, bf16 matmuls ran
        17-20x slower than fp32's at a tiny Qwen2's shapes (``benchmarks/results/avx2_2026-12-02``)
        and its training step 24x. ``autoprec tune`` measures which dtypes pay on the machine it runs on.

        Raises:
            PolicyError: ``low`` is not a storage dtype.
        """
        return cls(default_dtype=low, rules=(Rule(op_class="sensitive", dtype="fp32"),))

    @classmethod
    def autocast(cls, low: str = "bf16") -> Policy:
        """The autocast twin: what ``torch.autocast(dtype=low)`` computes on the captured graph.

        Matmuls (autocast's lower-precision list: linear, mm, bmm, addmm, baddbmm, matmul, conv,
        scaled_dot_product_attention) in ``low``; ``sensitive`` ops in fp32 (autocast's fp32 list,
        CUDA's, which also covers the CPU's); every other op by type promotion over its inputs
        (``follow_placement="promote"``), as autocast leaves ops outside its lists: a residual
        ``add`` of an fp32 stream and a ``low`` matmul output stays fp32. Source: PyTorch's
        "Automatic Mixed Precision package" docs, autocast op reference (CPU and CUDA lists).
        The search starts from it and falls back to it (docs/architecture.md#search).

        Raises:
            PolicyError: ``low`` is not a storage dtype.
        """
        return cls(default_dtype=low, rules=(Rule(op_class="sensitive", dtype="fp32"),),
                   follow_placement="promote")

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
        return self._as_trained().to_json()

    @property
    def measured_key(self) -> str:
        """A digest of :meth:`training_key` (SHA-256, the first 16 hex digits): what ``tune`` records
        as ``provenance.measured_policy``, so a later edit of the file shows
        (:meth:`edited_note`)."""
        return hashlib.sha256(self.training_key().encode()).hexdigest()[:16]

    def edited_note(self, source: str | os.PathLike) -> str | None:
        """The note ``show``, ``train`` and ``bench`` print when the file ``source`` was changed since
        ``tune`` measured it (its ``provenance.measured_policy`` is not :attr:`measured_key`): its
        ``measured`` numbers describe the policy as tuned (a user's hand-added bf16 rule kept
        "grad_rel_l2 1.72e-07" for a policy of 3.9e-3). None otherwise, and for a file without the
        record (written by hand, or before it existed)."""
        recorded = self.provenance.get("measured_policy") if self.provenance else None
        if not self.measured or not isinstance(recorded, str) or recorded == self.measured_key:
            return None
        return (f"{os.fspath(source)} was changed since tune measured it (its rules or settings are not "
                "the ones provenance.measured_policy records): its measured numbers describe the policy "
                "as tuned, not this one; autoprec bench measures this one")

    def _as_trained(self) -> Policy:
        """This policy without ``measured`` and ``provenance``: what training runs."""
        return dataclasses.replace(self, measured={}, provenance={})

    def differences(self, other: Policy) -> list[str]:
        """What makes ``other`` train differently: ``"field: mine vs theirs"`` per differing field
        of the JSON layout (one level into objects: ``"loss_scaling.growth_interval: 2000 vs 2"``),
        ``measured`` and ``provenance`` left out; empty when the :meth:`training_key` are equal."""
        mine, theirs = (p._as_trained().to_dict() for p in (self, other))
        out = []
        for key in dict.fromkeys([*mine, *theirs]):
            a, b = mine.get(key), theirs.get(key)
            if a == b:
                continue
            if isinstance(a, dict) and isinstance(b, dict):
                out += [f"{key}.{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in dict.fromkeys([*a, *b])
                        if a.get(k) != b.get(k)]
            else:
                out.append(f"{key}: {a!r} vs {b!r}"[:300])
        return out

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
        if self.follow_placement != "mincut":
            parts.append(f"follow {self.follow_placement}")
        if self.attention != "fused":
            parts.append(f"attention {self.attention}")
        if self.compile_options is not None:
            done = self.carried_out(self.compile_options)
            parts.append(f"compiled {done.describe()}" + (
                " (regional asked for: kept flat by its saved dtypes or memory budget)"
                if done != self.compile_options else ""))
        if self.batching is not None:
            parts.append(self.batching.describe())
        return "; ".join(parts)

    @property
    def kept_flat(self) -> str | None:
        """Why this policy's graph compiles as one flat graph whatever ``compile_options`` asks
        (:func:`~autoprec.policy.compile_options.flat_reason`: a rule's ``saved`` dtype, an
        ``activation_memory_budget`` below 1.0), else None."""
        return flat_reason(any(r.saved is not None for r in self.rules), self.activation_memory_budget)

    def carried_out(self, options: CompileOptions) -> CompileOptions:
        """``options`` as compiling this policy's graph carries them out: regional asked for but
        :attr:`kept_flat` is flat (what ``tune`` records, so the file says how it compiles)."""
        flat = options.regional and self.kept_flat is not None
        return dataclasses.replace(options, regional=False) if flat else options

    @property
    def compiled_as(self) -> CompileOptions:
        """How the policy's graph is compiled: its ``compile_options``; for a file ``tune`` wrote
        compiled before the field existed (``provenance.compiled`` true), what that tune measured
        (:data:`~autoprec.policy.compile_options.REGIONAL_EMULATED`); otherwise, without a say, as
        ``torch.compile(model)`` compiles (:data:`autoprec.policy.compile_options.TORCH_COMPILE`)."""
        if self.compile_options is not None:
            return self.compile_options
        return REGIONAL_EMULATED if self.provenance.get("compiled") is True else TORCH_COMPILE

    @property
    def schema(self) -> int:
        """The file version :meth:`to_dict` writes: 4 with ``batching``, 3 with ``compile_options``,
        2 with another schema-2 field (:attr:`schema2`), else 1 (older readers take what they can)."""
        if self.batching is not None:
            return 4
        return 3 if self.compile_options is not None else (2 if self.schema2 else 1)

    @property
    def schema2(self) -> bool:
        """Whether the policy uses a schema-2 field (a rule's ``compute``, ``saved`` or fp8;
        ``fp8_scaling``, ``follow_placement`` or ``attention`` other than the default): written as
        version 2."""
        defaults = (self.fp8_scaling == "tensorwise" and self.follow_placement == "mincut"
                    and self.attention == "fused")
        return not defaults or any(r.schema2 for r in self.rules)

    # -- JSON -----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The docs/architecture.md#policy-file JSON layout (``loss_scaling`` adds max_scale);
        ``schema_version`` is :attr:`schema`.

        ``activation_memory_budget`` is written only below 1.0 and ``grad_reduce_dtype`` only when
        not ``fp32``, so a policy without them stays readable by autoprec versions that predate
        the fields (and keeps its ``training_key``).
        """
        d = {
            "schema_version": self.schema,
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
        if self.follow_placement != "mincut":
            d["follow_placement"] = self.follow_placement
        if self.attention != "fused":
            d["attention"] = self.attention
        if self.compile_options is not None:
            d["compile_options"] = self.compile_options.to_dict()
        if self.batching is not None:
            d["batching"] = self.batching.to_dict()
        return d | {"provenance": jsonable(self.provenance, "Policy", "provenance"),
                    "measured": dict(self.measured)}

    @classmethod
    def from_dict(cls, d: Any, source: str = "<dict>") -> Policy:
        """Build a policy from its JSON object, validating every field.

        Missing fields other than ``schema_version`` and ``default_dtype`` take their defaults
        (a missing ``default_dtype`` would silently lower every node no rule selects to bf16).

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
                                                  "grad_reduce_dtype", "fp8_scaling", "follow_placement",
                                                  "attention")
                                 if k in d}
        kw["rules"] = _rules_from_json(d.get("rules", []), source, version)
        for key in ("fp8_scaling", "follow_placement", "attention"):
            if version < 2 and key in d:
                raise fail(source, key, "needs schema_version 2 (a schema-2 field); this file says 1")
        if "compile_options" in d:
            if version < 3:
                raise fail(source, "compile_options",
                           f"needs schema_version 3 (a schema-3 field); this file says {version}")
            kw["compile_options"] = CompileOptions.from_dict(d["compile_options"], source)
        if "batching" in d:
            if version < 4:
                raise fail(source, "batching",
                           f"needs schema_version 4 (a schema-4 field); this file says {version}")
            kw["batching"] = Batching.from_dict(d["batching"], source)
        if "loss_scaling" in d:
            ls = check_mapping(d["loss_scaling"], source, "loss_scaling")
            check_keys(ls, LOSS_SCALING_KEYS, "loss_scaling", source, "loss_scaling")
            kw["loss_scaling"] = build(LossScalingConfig, ls, source, "loss_scaling")
        kw["provenance"] = check_mapping(d.get("provenance", {}), source, "provenance")
        kw["measured"] = check_mapping(d.get("measured", {}), source, "measured")
        policy = build(cls, kw, source)  # every other field's error first
        if "default_dtype" not in d:  # its default (bf16) would lower every node no rule selects, unsaid
            raise fail(source, "default_dtype", "missing; a policy file names the dtype of the nodes no rule "
                       "selects: fp32, bf16 or fp16 (every file autoprec writes has it)")
        return policy

    @staticmethod
    def check_replaceable(path: str | os.PathLike, option: str = "out") -> None:
        """Fail before any work when ``path`` exists and is not a policy file (a JSON object with
        ``schema_version``), which writing a policy there would replace: ``tune --out model.py`` or
        ``--out config.json`` lost the user's file without a word. A policy file (a rerun's) may be
        replaced.

        Raises:
            PolicyError: naming ``option``, the path and what to do.
        """
        if not os.path.isfile(path):
            return
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            ours = isinstance(data, dict) and "schema_version" in data
        except (OSError, UnicodeDecodeError, ValueError):
            ours = False
        if not ours:
            raise PolicyError(f"{option} {os.fspath(path)}: exists and is not a policy file (no JSON object "
                              "with 'schema_version'), and it would be replaced; give another path, or "
                              "remove the file")

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
