"""One error tree for autoprec (DESIGN §8).

Every error raised on bad user input derives from :class:`AutoprecError`, so a caller
(and the CLI, which maps them to exit code 2) can catch them in one place.
"""

from __future__ import annotations


class AutoprecError(Exception):
    """Base class of every error autoprec raises on bad input or failed numerics."""


class ModelSpecError(AutoprecError):
    """A model.py file is missing, unloadable, or lacks a required entry point."""


class CaptureError(AutoprecError):
    """The model could not be captured as a graph (torch.export and the fallback failed)."""


class PassError(AutoprecError):
    """A graph pass failed; the message names the pass and the node."""


class PolicyError(AutoprecError):
    """A policy file or object is invalid; the message names the file and the field."""


class SearchError(AutoprecError):
    """The policy search could not produce a result (e.g. no feasible policy)."""


class LossScaleError(AutoprecError):
    """Dynamic loss scaling cannot recover: overflow persists at the minimum loss scale."""
