"""Policy search: search space, measurements, the Optuna study (docs/architecture.md#data-flow,
#measurements)."""
