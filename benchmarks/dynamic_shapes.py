"""Batches whose shape changes, on ``examples/qwen2_tiny.py``: one dynamic capture vs a fixed-shape run.

Usage::

    python benchmarks/dynamic_shapes.py OUT_DIR [--batches 200] [--min-len 64] [--max-len 256]

Both runs train a fresh copy of the example's model (same seed-0 weights) with the default bf16
policy (``Policy.default("bf16")``), AdamW(lr=3e-4) and ``autoprec.training.train.TrainStep``, on
the same ``--batches`` batches of ``qwen2_tiny.BATCH_SIZE`` windows of the corpus whose lengths are
drawn uniformly in ``--min-len..--max-len`` (seeded by the batch index), one after the other in one
process:

- ``dynamic``: a pad-to-longest loader (each batch padded to its longest sequence, so nearly every
  batch has a new shape) into ``autoprec.apply(..., dynamic=True)``: one capture with dynamic batch
  and sequence dimensions, compiled with dynamic shapes.
- ``fixed``: the same windows padded to ``--max-len`` (one shape) into ``autoprec.apply(...)``.

Padding is ``attention_mask`` 0 and ``labels`` -100. Captures and compiles are counted (the
module's own counts and Dynamo's ``unique_graphs``), capture seconds are the wall time of
``apply`` (capture + passes), compile seconds the wall time of the steps that compiled minus the
run's median step (Inductor's caches are off, ``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``, so both
compile from scratch). Writes ``OUT_DIR/dynamic_shapes.json`` with ``autoprec.device.describe_machine``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time
from typing import Any

# compile from scratch in both runs (no FX graph / kernel cache from an earlier run): cold compile seconds
os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

import torch  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import qwen2_tiny  # noqa: E402

import autoprec  # noqa: E402
from autoprec._io import write_json  # noqa: E402
from autoprec.device import describe_machine  # noqa: E402
from autoprec.training.train import TrainStep  # noqa: E402


def windows(step: int, lengths: tuple[int, int]) -> list[torch.Tensor]:
    """``BATCH_SIZE`` windows of the training split, of lengths drawn in ``lengths`` (seed ``step``)."""
    data = qwen2_tiny.corpus_split(heldout=False)
    gen = torch.Generator().manual_seed(10_000 + step)
    lens = torch.randint(lengths[0], lengths[1] + 1, (qwen2_tiny.BATCH_SIZE,), generator=gen).tolist()
    starts = torch.randint(0, len(data) - lengths[1], (len(lens),), generator=gen).tolist()
    return [data[s:s + n].long() for s, n in zip(starts, lens)]


def pad(seqs: list[torch.Tensor], to: int) -> dict[str, torch.Tensor]:
    """``{"input_ids", "attention_mask", "labels"}`` of ``seqs`` right-padded to length ``to``."""
    ids = torch.zeros(len(seqs), to, dtype=torch.long)
    mask = torch.zeros(len(seqs), to, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def run(name: str, batches: list[dict[str, torch.Tensor]], example: dict[str, torch.Tensor],
        dynamic: bool) -> dict[str, Any]:
    """Train a fresh model on ``batches``; captures, compiles, their seconds and the step times."""
    from torch._dynamo.utils import counters

    model = qwen2_tiny.build_model()
    graphs0 = counters["stats"]["unique_graphs"]
    t0 = time.perf_counter()
    mp = autoprec.apply(model, autoprec.Policy.default("bf16"), example, dynamic=dynamic)
    capture_s = time.perf_counter() - t0
    params = list(model.parameters())
    step = TrainStep(mp, params, torch.optim.AdamW(params, lr=3e-4), lambda out, b: out.loss)
    times, losses, compiled = [], [], []
    for i, batch in enumerate(batches):
        before = counters["stats"]["unique_graphs"]
        stats, seconds = step.timed(batch)
        times.append(seconds)
        losses.append(stats.loss)
        compiled.append(counters["stats"]["unique_graphs"] != before)
        print(f"{name} step {i}: shape {tuple(batch['input_ids'].shape)} {seconds:.2f} s loss "
              f"{stats.loss:.3f}"
              + (" (compiled)" if compiled[-1] else ""), flush=True)
    steady = [t for t, c in zip(times, compiled) if not c]
    median = statistics.median(steady) if steady else float("nan")
    real = [int(b["attention_mask"].sum()) for b in batches]
    fn_stats = mp.shape_stats
    return {
        "mode": fn_stats["mode"], "captures": fn_stats["captures"], "capture_seconds": capture_s,
        "compiles": counters["stats"]["unique_graphs"] - graphs0,
        "compile_seconds": sum(t - median for t, c in zip(times, compiled) if c),
        "median_step_seconds": median, "steps": len(batches),
        "distinct_shapes": len({tuple(b["input_ids"].shape) for b in batches}),
        "padded_tokens": sum(b["input_ids"].numel() for b in batches), "real_tokens": sum(real),
        "real_tokens_per_second": (sum(r for r, c in zip(real, compiled) if not c) / sum(steady)
                                   if steady else None),
        "total_seconds": capture_s + sum(times),
        "loss_first5": statistics.mean(losses[:5]), "loss_last5": statistics.mean(losses[-5:]),
        "step_seconds": times, "compiled_steps": [i for i, c in enumerate(compiled) if c],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=pathlib.Path)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=256)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    seqs = [windows(i, (a.min_len, a.max_len)) for i in range(a.batches)]
    longest = [pad(s, max(len(x) for x in s)) for s in seqs]
    fixed = [pad(s, a.max_len) for s in seqs]
    example = fixed[0]  # the largest shape (BATCH_SIZE, max_len) bounds the dynamic ranges
    results = {"dynamic": run("dynamic", longest, example, dynamic=True),
               "fixed": run("fixed", fixed, example, dynamic=False)}
    out = {"model": "examples/qwen2_tiny.py", "policy": "Policy.default('bf16')", "batches": a.batches,
           "lengths": [a.min_len, a.max_len], "batch_size": qwen2_tiny.BATCH_SIZE,
           "torch": torch.__version__, "machine": describe_machine(torch.device("cpu")), **results}
    a.out_dir.mkdir(parents=True, exist_ok=True)
    write_json(a.out_dir / "dynamic_shapes.json", out)
    keys = ["mode", "captures", "capture_seconds", "compiles", "compile_seconds", "median_step_seconds",
            "distinct_shapes", "real_tokens_per_second", "total_seconds", "loss_first5", "loss_last5"]
    print("| | " + " | ".join(keys) + " |\n|---|" + "---:|" * len(keys))
    for name, r in results.items():
        print(f"| {name} | "
              + " | ".join(f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
