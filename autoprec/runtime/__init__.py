"""Runtime pieces used while training: loss scaling, monitoring, applying a policy
(docs/architecture.md#runtime)."""
