"""A policy applied to a model: capture, the pass pipeline, compilation and the module that runs the
lowered graph (``apply``, ``MixedPrecisionModule``; docs/architecture.md#runtime)."""
