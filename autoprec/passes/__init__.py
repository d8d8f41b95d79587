"""Graph passes: each a pure ``GraphModule -> PassResult`` (torch.fx ``PassBase`` style).

The pipeline (:func:`run_pipeline`) is: assign dtypes (op classes, policy rules, cast
placement for ``follow`` nodes, constant range checks) -> insert casts -> fp32 accumulation ->
verify. :func:`first_nonfinite_node` diagnoses overflow. Every pass records its decision in
``node.meta["autoprec"]`` and raises :class:`autoprec.errors.PassError` naming the pass and
``node.format_node()`` on failure.
"""

from __future__ import annotations

from autoprec.passes.assign import assign_dtypes
from autoprec.passes.base import PassResult, pass_error
from autoprec.passes.diagnose import first_nonfinite_node, nonfinite_nodes
from autoprec.passes.pipeline import finish_pipeline, lower, run_pipeline

__all__ = [
    "PassResult", "assign_dtypes", "finish_pipeline", "first_nonfinite_node", "lower", "nonfinite_nodes",
    "pass_error", "run_pipeline",
]
