"""Where people train: adapters for Hugging Face ``Trainer`` (:mod:`.transformers`) and Lightning
(:mod:`.lightning`). Each imports its library only when used; install the ``transformers`` or
``lightning`` extra (docs/architecture.md#runtime)."""
