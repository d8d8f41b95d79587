"""One error tree for autoprec (docs/architecture.md#house-style).

Every error autoprec raises on bad user input or failed numerics derives from
:class:`AutoprecError`, so a caller can catch them in one place. The CLI prints the message
(no traceback) and exits with code 2 for bad input (every class here except
:class:`LossScaleError`) and code 1 for :class:`LossScaleError`, a training run that failed, not
a bad file (``autoprec/cli.py``, ``docs/architecture.md#public-api``).
"""

from __future__ import annotations


class AutoprecError(Exception):
    """Base class of every error autoprec raises on bad input or failed numerics."""


class ModelSpecError(AutoprecError):
    """A model.py file is missing, unloadable, or lacks a required entry point (CLI exit 2)."""


class CaptureError(AutoprecError):
    """The model could not be captured as a graph: ``torch.export`` failed (there is no other
    capture path), or the captured graph does not share the model's parameters (CLI exit 2)."""


class PassError(AutoprecError):
    """A graph pass failed; the message names the pass and the node (CLI exit 2)."""


class PolicyError(AutoprecError):
    """A policy file or object is invalid; the message names the file and the field (CLI exit 2)."""


class SearchError(AutoprecError):
    """The policy search could not produce a result, e.g. no feasible policy (CLI exit 2)."""


class LossScaleError(AutoprecError):
    """Dynamic loss scaling cannot recover: overflow persists at the minimum loss scale.

    Raised by a training run, not by bad input: the CLI exits with code 1 for it.
    """


class ShapeLimitError(AutoprecError, ValueError):
    """A module from ``autoprec.apply`` that keeps one graph per input shape met more shapes than
    it keeps (``MAX_SHAPES``); the message says how to give it fewer. A ``ValueError`` too (what a
    call with a shape it cannot serve raises); the CLI exits with code 2, without a traceback."""

