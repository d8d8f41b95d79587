"""Policy search: search space, measurements, the Optuna study (DESIGN §1, §5)."""
