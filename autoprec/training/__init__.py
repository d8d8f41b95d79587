"""The training step: ``TrainStep``, the one step loop, the RNG rule, loss scaling, the monitor and
checkpoints (docs/architecture.md#runtime)."""
