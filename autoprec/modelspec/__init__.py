"""Load a user's ``model.py`` into a :class:`ModelSpec` (docs/architecture.md#modelpy-contract).

The contract a model file fulfils::

    def build_model() -> torch.nn.Module: ...             # required; fp32 weights
    def get_batch(step: int, device: torch.device): ...   # required; deterministic in step
    def loss_fn(output, batch) -> torch.Tensor: ...       # optional; default: output.loss
    def make_optimizer(params) -> torch.optim.Optimizer   # optional; default AdamW
    def tokens_per_batch(batch) -> int: ...               # optional; default: numel of input_ids
    def get_heldout_batch(step, device): ...              # optional; held-out data for drift checks

Everything that can go wrong while loading (file missing, syntax error, exception at import,
missing/misspelt/non-callable entry point, wrong arity) raises :class:`ModelSpecError` with one
message that names the file and says what is expected; the CLI maps it to exit code 2.

Modules: :mod:`~autoprec.modelspec.loader` (:class:`ModelSpec`, :func:`load_model_spec`),
:mod:`~autoprec.modelspec.batch` (how a batch is called, the default entry points),
:mod:`~autoprec.modelspec.outputs` (the training call arguments and what a captured forward may
return) and
:mod:`~autoprec.modelspec.validate` (:func:`validate_spec`).
"""

from __future__ import annotations

from autoprec.modelspec.batch import (
    call_model,
    default_loss_fn,
    default_make_optimizer,
    default_tokens_per_batch,
    positional_binding,
    scalar_items,
    split_batch,
)
from autoprec.modelspec.loader import ModelSpec, load_model_spec
from autoprec.modelspec.outputs import (
    TRAINING_KWARGS,
    Kept,
    drop_fixed_kwargs,
    grad_leaves,
    prepare_output,
    training_kwargs,
)
from autoprec.modelspec.validate import validate_spec

__all__ = [
    "Kept",
    "ModelSpec",
    "TRAINING_KWARGS",
    "call_model",
    "default_loss_fn",
    "scalar_items",
    "default_make_optimizer",
    "default_tokens_per_batch",
    "drop_fixed_kwargs",
    "grad_leaves",
    "load_model_spec",
    "positional_binding",
    "prepare_output",
    "validate_spec",
    "split_batch",
    "training_kwargs",
]
