"""Many processes: the ranks, their batches, and DDP / FSDP2 over an applied module
(docs/architecture.md#runtime)."""
