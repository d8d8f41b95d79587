"""What both integrations check about a policy's batching (``Policy.batching``, docs/integrations.md):
the number of examples each training forward receives, against the policy's ``micro_batch``.

Examples are counted as :mod:`autoprec.modelspec.micro_batches` counts them: the leading dimension of
the batch's tensors. It imports neither framework.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from autoprec.policy.batching import Batching

__all__ = ["MicroBatchCheck", "OPT_OUT", "batching_fields", "leading_rows"]

#: How every batching message says to train at the framework's own batch instead of the policy's.
OPT_OUT = ("to train at your own batch instead, use the policy without its batching "
           "(dataclasses.replace(policy, batching=None))")


def batching_fields(batching: Batching) -> str:
    """``"batching.micro_batch=2, batching.accumulation=2 (micro-batch 2 x 2 accumulated (global batch
    4))"``: the policy file's fields and values, as messages name them."""
    return (f"batching.micro_batch={batching.micro_batch}, batching.accumulation={batching.accumulation} "
            f"({batching.describe()})")


def leading_rows(batch: Any) -> int | None:
    """Examples in ``batch``: the leading dimension of its first tensor with at least one dimension
    (a dict, tuple or list, nested, or a tensor), or None when it holds no such tensor."""
    leaves, _ = tree_flatten(batch)
    return next((int(t.shape[0]) for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0), None)


class MicroBatchCheck:
    """Checks the examples of each training forward against the policy's micro-batch.

    The first batch checked must hold exactly ``micro_batch * replicas`` examples; a later one may
    hold fewer (the last batch of an epoch) but never more. A batch without a tensor of at least one
    dimension is not checked.

    Args:
        batching: The policy's batching.
        what: How the message names the caller (``"AutoprecTrainer"``).
        source: What made the batch, named in the message (``"the Trainer's train DataLoader"``).
        fix: What to change, ending the message's first part (``"build it with batch_size=2"``).
        replicas: Forward replicas one batch is split over (``torch.nn.DataParallel``'s GPUs), >= 1.
    """

    def __init__(self, batching: Batching, what: str, source: str, fix: str, replicas: int = 1) -> None:
        self.batching, self.what, self.source, self.fix = batching, what, source, fix
        self.expected = batching.micro_batch * max(1, int(replicas))
        self.checked = 0

    def reset(self) -> None:
        """The next batch checked is a first batch again (a new ``fit``)."""
        self.checked = 0

    def __call__(self, batch: Any) -> None:
        """Check one training batch.

        Raises:
            ValueError: its number of examples is not the expected one (first batch) or exceeds it
                (later batches); the message names the numbers, the policy's fields and the fix.
        """
        rows = leading_rows(batch)
        if rows is None:
            return
        first = self.checked == 0
        self.checked += 1
        if rows == self.expected or (not first and rows < self.expected):
            return
        per = (f" ({self.batching.micro_batch} per replica x {self.expected // self.batching.micro_batch})"
               if self.expected != self.batching.micro_batch else "")
        relation = "not" if first else "more than"
        raise ValueError(
            f"{self.what}: training batch {self.checked} has {rows} examples (its leading dimension), "
            f"{relation} the policy's micro-batch of {self.expected}{per}: the policy file says "
            f"{batching_fields(self.batching)}, and {self.source} gives batches of another size; "
            f"{self.fix}; {OPT_OUT}")
