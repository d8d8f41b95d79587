"""The command drivers the CLI calls: ``train`` (and ``train --compare``), ``bench`` (and ``bench
--nproc``) and the torchrun launch of ``--nproc`` (docs/architecture.md#data-flow)."""
