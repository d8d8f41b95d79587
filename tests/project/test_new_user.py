"""What a new user trips over (issue 20): a list batch's positional binding named in the error, an
impossible memory budget refused before capture, one line per failed trial, quiet logs, ``show``'s
summary without ``--model``."""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from autoprec.errors import CaptureError, ModelSpecError
from autoprec.modelspec import load_model_spec, positional_binding, validate_spec

# A seq2seq-like forward whose third parameter is not ``labels``: a list [ids, mask, labels] binds
# labels to decoder_input_ids, and the embedding lookup of -100 fails (as T5's did).
SEQ2SEQ = textwrap.dedent("""
    import torch
    from torch import nn

    class Seq2Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.out = nn.Linear(8, 16)

        def forward(self, input_ids, attention_mask=None, decoder_input_ids=None, labels=None):
            h = self.emb(input_ids).mean(1, keepdim=True) + self.emb(decoder_input_ids)
            return self.out(h).float().mean()

    def build_model():
        return Seq2Seq()

    def get_batch(step, device):
        ids = torch.arange(6, device=device).reshape(2, 3)
        labels = torch.full((2, 3), -100, device=device)
        return [ids, torch.ones_like(ids), labels]

    def loss_fn(output, batch):
        return output
""")


def test_list_batch_failure_names_the_positional_mapping(tmp_path: Path) -> None:
    path = tmp_path / "model.py"
    path.write_text(SEQ2SEQ)
    with pytest.raises(ModelSpecError) as e:
        validate_spec(load_model_spec(path))
    msg = str(e.value)
    assert str(path) in msg and "IndexError" in msg
    assert "list of 3 items, passed positionally" in msg
    assert "batch[0] -> input_ids, batch[1] -> attention_mask, batch[2] -> decoder_input_ids" in msg
    assert "return a dict" in msg


def test_list_batch_capture_error_names_the_mapping() -> None:
    from autoprec.capture import capture

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(4, 2)

        def forward(self, tokens, targets):
            return self.emb(tokens).sum() + self.emb(targets).sum()

    batch = [torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), torch.zeros(1)]
    with pytest.raises(CaptureError, match=r"batch\[0\] -> tokens, batch\[1\] -> targets, batch\[2\] -> \("):
        capture(Two(), batch)


def test_positional_binding_rules() -> None:
    class VarArgs(nn.Module):
        def forward(self, x, *rest):
            return x

    assert positional_binding(VarArgs(), torch.zeros(1)) is None  # not a sequence
    assert positional_binding(VarArgs(), [torch.zeros(1)]) is None  # one item binds one way only
    text = positional_binding(VarArgs(), (1, 2, 3))
    assert text is not None and "tuple of 3 items" in text
    assert "batch[0] -> x, batch[1] -> *rest, batch[2] -> *rest" in text
    assert "VarArgs.forward(x, *rest)" in text


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_failed_trial_is_one_autoprec_line(capsys) -> None:
    """Issue 20, item 7: Optuna's two warnings per failed trial are gone; one autoprec line per
    failed trial gives the reason from ``autoprec:error``."""
    import math

    import optuna

    from autoprec.search import attrs
    from autoprec.search.trials import _run_trials

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    theirs, ours = _Records(), _Records()
    logging.getLogger("optuna").addHandler(theirs)
    log = logging.getLogger("autoprec")
    log.addHandler(ours)
    level, log.level = log.level, logging.INFO

    def objective(trial):
        trial.suggest_float("a", 0, 1)
        if trial.number == 1:
            trial.set_user_attr(attrs.ERROR, "non-finite loss\n at step 0")
            return math.nan
        return 1.0

    try:
        study = optuna.create_study()
        _run_trials(study, objective, target=3, t_end=None, progress=False)
        _run_trials(study, objective, target=4, t_end=None, progress=True)  # the filter is added once
    finally:
        logging.getLogger("optuna").removeHandler(theirs)
        log.removeHandler(ours)
        log.setLevel(level)
    assert not [m for m in theirs.lines if "failed with" in m], theirs.lines
    assert ours.lines == ["trial 1 failed: non-finite loss at step 0"]
    assert len(logging.getLogger("optuna.study._optimize").filters) == 1


def test_compile_graph_filters_inductor_mixed_dtype_warning() -> None:
    """Issue 20, item 7: Inductor's "bf16 and fp16 are mixed in the scheduler node" is filtered
    once (no compile runs here: torch.compile is lazy), other UserWarnings still show."""
    import warnings

    from autoprec.applied.compile import compile_graph

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compile_graph(nn.Linear(2, 2))
        compile_graph(nn.Linear(2, 2))
        warnings.warn("bf16 and fp16 are mixed in the scheduler node.", UserWarning, stacklevel=1)
        warnings.warn("another warning", UserWarning, stacklevel=1)
        mine = [f for f in warnings.filters if f[1] is not None and "mixed in the scheduler" in f[1].pattern]
    said = [str(w.message) for w in seen]
    assert "another warning" in said and not [m for m in said if "mixed in the scheduler" in m]
    assert len(mine) == 1
