"""Precision policies: frozen dataclasses, JSON schema v4 (v1 to v3 read unchanged), atomic save,
validated load (docs/architecture.md#policy-file).

A :class:`Policy` says which dtype each graph node stores its output in, computes in and saves
for backward. It is a default dtype plus an
ordered list of :class:`Rule` objects; a rule selects nodes by op class (``ops.py``), by a module
glob, or by an exact node key (``<module path>/<op>#<k>``, docs/architecture.md#node-keys-and-op-classes).
Later rules override earlier ones and node rules win over all others.

Every invalid value raises :class:`~autoprec.errors.PolicyError` whose message names the source
(a file path, or the class being constructed) and the exact field, e.g.
``p.json: rules[2].dtype: 'fp64' is not a valid dtype; valid: bf16, fp16, fp32``.
Files are read with :mod:`json` only (never pickle, never eval) and written atomically.

Modules: :mod:`~autoprec.policy.core` (:class:`Policy`, load and save),
:mod:`~autoprec.policy.rule` (:class:`Rule`), :mod:`~autoprec.policy.loss_scaling`
(:class:`LossScalingConfig` and the one home of the loss-scaling defaults and ranges, which
``training.scaler`` uses too), :mod:`~autoprec.policy.compile_options` (:class:`CompileOptions`:
how the graph is compiled), :mod:`~autoprec.policy.batching` (:class:`Batching`: micro-batch and
accumulation) and :mod:`~autoprec.policy.fields` (the field checks).
"""

from __future__ import annotations

from autoprec.policy.batching import Batching
from autoprec.policy.compile_options import COMPILE_VARIANTS, REGIONAL_EMULATED, TORCH_COMPILE, CompileOptions
from autoprec.policy.core import (
    ACCUMULATE_MODES,
    GRAD_REDUCE_DTYPES,
    READ_VERSIONS,
    SCHEMA_VERSION,
    TOP_LEVEL_KEYS,
    Policy,
)
from autoprec.policy.loss_scaling import LOSS_SCALING_KEYS, LOSS_SCALING_MODES, LossScalingConfig
from autoprec.policy.rule import FP8, OP_CLASSES, RULE_KEYS, RULE_OP_CLASSES, Rule

__all__ = [
    "ACCUMULATE_MODES", "FP8", "GRAD_REDUCE_DTYPES", "LOSS_SCALING_KEYS", "LOSS_SCALING_MODES", "OP_CLASSES",
    "RULE_KEYS", "READ_VERSIONS", "RULE_OP_CLASSES", "SCHEMA_VERSION", "TOP_LEVEL_KEYS", "LossScalingConfig",
    "COMPILE_VARIANTS", "Policy", "REGIONAL_EMULATED", "Rule", "TORCH_COMPILE", "Batching", "CompileOptions",
]
