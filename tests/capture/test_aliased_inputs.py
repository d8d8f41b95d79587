"""Inputs of the example batch that alias one another are captured as distinct placeholders: the
causal-LM idiom ``{"input_ids": ids, "labels": ids}`` was captured reading ``input_ids`` for both,
so a later batch with other labels was embedded from its labels (a silently wrong loss) or, with
-100 padding, raised an index error."""

from __future__ import annotations

import torch
from torch import nn

import autoprec
from autoprec.capture import capture
from autoprec.capture.export import distinct_inputs


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)

    def forward(self, input_ids, labels):
        logits = self.head(self.emb(input_ids))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def test_aliased_ids_and_labels_are_two_placeholders_and_later_batches_are_right():
    torch.manual_seed(0)
    model, ids = TinyLM(), torch.randint(0, 32, (2, 8))
    gm = capture(model, {"input_ids": ids, "labels": ids})
    assert len([n for n in gm.graph.nodes if n.op == "placeholder" and "labels" in n.name]) == 1
    mp = autoprec.apply(model, autoprec.Policy.fp32(), {"input_ids": ids, "labels": ids}, compile=False)
    other = torch.randint(0, 32, (2, 8))
    padded = other.clone()
    padded[:, 5:] = -100
    for labels in (ids, other, padded):
        b = {"input_ids": ids, "labels": labels}
        torch.testing.assert_close(mp(**b), model(**b), rtol=1e-6, atol=1e-6)


def test_distinct_inputs_copies_only_what_shares_storage():
    a, b = torch.arange(6), torch.ones(3)
    view = a[1:]
    (x, y), kw = distinct_inputs((a, b), {"again": a, "view": view, "n": 3})
    assert x is a and y is b and kw["n"] == 3
    for t, src in ((kw["again"], a), (kw["view"], view)):
        assert t is not src and torch.equal(t, src)
        assert t.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
