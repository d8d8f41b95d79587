"""The field checks of :class:`autoprec.policy.Policy` and the reading of its ``rules`` list, with the
format's constants (docs/architecture.md#policy-file): one home for what a valid policy is.
"""

from __future__ import annotations

import math
from typing import Any

from autoprec.dtypes import DTYPES
from autoprec.policy.batching import Batching
from autoprec.policy.compile_options import CompileOptions
from autoprec.policy.fields import (
    build,
    check_choice,
    check_keys,
    check_mapping,
    check_number,
    check_str,
    described,
    fail,
    type_name,
)
from autoprec.policy.loss_scaling import LossScalingConfig
from autoprec.policy.rule import RULE_KEYS, SCHEMA2_RULE_KEYS, Rule

__all__ = ["ACCUMULATE_MODES", "FOLLOW_PLACEMENTS", "FP8_SCALINGS", "GRAD_REDUCE_DTYPES", "READ_VERSIONS",
           "SCHEMA_VERSION", "TOP_LEVEL_KEYS", "check_fields", "rules_from_json", "versions"]

#: The newest policy file format version: 4 when a policy records ``batching`` (``tune
#: --global-batch``), 3 when it records ``compile_options`` (what ``tune`` writes compiled); a policy
#: without them is written as 2 when it uses a schema-2 field (a rule's ``compute`` or ``saved``, or
#: fp8), else 1, which older readers take (``Policy.schema``).
SCHEMA_VERSION = 4
#: The versions :meth:`Policy.from_dict` reads (schemas 1 to 3 load unchanged).
READ_VERSIONS: tuple[int, ...] = (1, 2, 3, 4)
ACCUMULATE_MODES: tuple[str, ...] = ("fp32", "none")
#: dtypes gradients may be communicated in across ranks (``Policy.grad_reduce_dtype``).
GRAD_REDUCE_DTYPES: tuple[str, ...] = ("fp32", "bf16")
#: fp8 matmul recipes (``Policy.fp8_scaling``): torchao.float8's ``Float8LinearRecipeName`` values,
#: the same list as ``autoprec.kernels.fp8.RECIPES`` (a test checks; the layers keep them apart).
#: ``"rowwise"`` in a file written before autoprec ran torchao's recipes loads unchanged and now
#: means torchao's rowwise (e4m3 gradients, power-of-two scales) where it meant e5m2 gradients and
#: unrounded scales: the format is the same, the numerics differ by ~5e-2 relative (measured).
FP8_SCALINGS: tuple[str, ...] = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
#: How ``follow`` nodes no rule selects get their dtype (``Policy.follow_placement``): ``mincut``
#: (the dtype that minimises bytes cast, :func:`autoprec.graph.place_follow`) or ``promote``
#: (type promotion over their inputs, as under ``torch.autocast``: fp32 when any input is fp32).
FOLLOW_PLACEMENTS: tuple[str, ...] = ("mincut", "promote")
#: How attention (``aten.scaled_dot_product_attention``) runs (``Policy.attention``): ``fused``
#: (PyTorch's fused kernel) or ``math`` (two explicit GEMMs and an fp32 softmax,
#: :mod:`autoprec.kernels.attention`).
ATTENTION_IMPLS: tuple[str, ...] = ("fused", "math")
TOP_LEVEL_KEYS: tuple[str, ...] = (
    "schema_version", "default_dtype", "rules", "accumulate", "loss_scaling",
    "master_weights", "optimizer_state", "activation_memory_budget", "grad_reduce_dtype", "fp8_scaling",
    "follow_placement", "attention", "compile_options", "batching", "provenance", "measured",
)


def check_fields(p: Any, source: str) -> None:
    """The checks of :meth:`Policy._validate` on the policy ``p``, in the order their errors are reported.

    Raises:
        PolicyError: naming ``source`` and the field at fault.
    """
    check_choice(p.default_dtype, sorted(DTYPES), "dtype", source, "default_dtype")
    if not isinstance(p.rules, (tuple, list)):
        raise fail(source, "rules", f"expected a list of rules, got {type_name(p.rules)}")
    for i, rule in enumerate(p.rules):
        if not isinstance(rule, Rule):
            raise fail(source, f"rules[{i}]", f"expected a Rule, got {described(rule)}")
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
    check_choice(p.grad_reduce_dtype, GRAD_REDUCE_DTYPES, "gradient reduction dtype", source,
                 "grad_reduce_dtype")
    check_choice(p.fp8_scaling, FP8_SCALINGS, "fp8 scaling", source, "fp8_scaling")
    check_choice(p.follow_placement, FOLLOW_PLACEMENTS, "follow placement", source, "follow_placement")
    check_choice(p.attention, ATTENTION_IMPLS, "attention implementation", source, "attention")
    if p.compile_options is not None and not isinstance(p.compile_options, CompileOptions):
        raise fail(source, "compile_options",
                   f"expected a CompileOptions, got {described(p.compile_options)}")
    if p.batching is not None and not isinstance(p.batching, Batching):
        raise fail(source, "batching", f"expected a Batching, got {described(p.batching)}")
    check_mapping(p.provenance, source, "provenance")
    for k, v in check_mapping(p.measured, source, "measured").items():
        if not isinstance(k, str):
            raise fail(source, "measured", f"keys must be strings, got {described(k)}")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise fail(source, f"measured.{k}", f"expected a number, got {described(v)}")
        if not math.isfinite(v):
            raise fail(source, f"measured.{k}", f"{v!r} is not a finite number")
    if p.loss_scaling.mode == "none" and p.needs_loss_scaling:
        where = "default_dtype" if p.default_dtype == "fp16" else next(
            f"rules[{i}].{k}" for i, r in enumerate(p.rules) for k in ("dtype", "compute")
            if getattr(r, k) == "fp16")
        raise fail(source, "loss_scaling.mode", f"'none' but {where} is fp16: fp16 without a loss scaler "
                   "is refused (small gradients underflow to 0 in fp16, cases C07); use 'dynamic'")


def versions() -> str:
    """The readable schema versions, for messages: ``"1, 2, 3 and 4"``."""
    *head, last = map(str, READ_VERSIONS)
    return f"{', '.join(head)} and {last}" if head else last


def rules_from_json(rules: Any, source: str, version: int) -> list[Rule]:
    """The ``rules`` list of a policy file as :class:`Rule` objects, each validated once; a
    schema-1 file may not use the schema-2 rule fields.

    Raises:
        PolicyError: naming ``source`` and ``rules[i]``'s field at fault.
    """
    if not isinstance(rules, list):
        raise fail(source, "rules", f"expected a list, got {described(rules)}")
    out = []
    for i, raw in enumerate(rules):
        path = f"rules[{i}]"
        raw = check_mapping(raw, source, path)
        check_keys(raw, RULE_KEYS, "rule", source, path)
        rule = build(Rule, raw, source, path)
        if version < 2 and rule.schema2:
            field = next((k for k in SCHEMA2_RULE_KEYS if k in raw), "dtype")
            raise fail(source, f"{path}.{field}", f"{raw[field]!r} needs schema_version 2 "
                       "(compute, saved and fp8 are schema-2 fields); this file says 1")
        out.append(rule)
    return out
