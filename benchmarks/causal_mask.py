"""SDPA with the captured causal mask against ``is_causal`` (autoprec/capture/causal.py), side by side.

Times one forward + backward step (no optimizer) of ``examples/qwen2_05b.py`` on one device:

- ``autocast eager``: the model under ``torch.autocast`` (the model's own code skips the mask);
- ``twin eager`` / ``twin eager, mask``: ``apply(model, Policy.autocast(low), compile=False)``
  with the capture's causal-mask rewrite, and without it (the mask the export materialised);
- with ``--compile``: ``autocast + compile`` (``torch.compile(model)`` under ``torch.autocast``),
  ``twin compiled`` and (``--compile-mask``, one more compile) ``twin compiled, mask``.

Rounds are interleaved (one step of each row per round, after ``--warmup`` rounds); each row's
median step time over ``--steps`` rounds, with the spread (min–max) of its steps, and tokens/s.
Writes OUT/causal_mask.json and prints a table; ``AUTOPREC_QWEN2_05B_TINY=1`` for a CPU dry run.

Usage: python benchmarks/causal_mask.py OUT [--device cuda] [--dtype fp16] [--compile [--compile-mask]]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO))

import qwen2_05b as example  # noqa: E402

from autoprec.capture import trace  # noqa: E402
from autoprec import Policy, apply  # noqa: E402
from autoprec.dtypes import to_torch  # noqa: E402


def _step(fn, batch, params, autocast=None):
    """One forward + backward; gradients set to None first."""
    for p in params:
        p.grad = None
    if autocast is None:
        loss = fn(**batch).loss
    else:
        with torch.autocast(autocast[0], dtype=autocast[1]):
            loss = fn(**batch).loss
    loss.backward()


def _twin(model, low, batch, compile, rewrite):
    """The autocast twin applied to ``model``, captured with or without the causal-mask rewrite."""
    keep = trace.causal_attention
    if not rewrite:
        trace.causal_attention = lambda gm: 0
    try:
        return apply(model, Policy.autocast(low), batch, compile=compile)
    finally:
        trace.causal_attention = keep


def _time(rows, a, sync, tokens) -> dict[str, dict[str, float]]:
    """Time ``rows`` in interleaved rounds (first calls apart: they compile); print and return the table."""
    times: dict[str, list[float]] = {k: [] for k in rows}
    for name, fn in rows.items():
        t0 = time.perf_counter()
        fn()
        sync()
        print(f"{name}: first step {time.perf_counter() - t0:.1f} s", flush=True)
    for r in range(a.warmup + a.steps):
        for name, fn in rows.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if r >= a.warmup:
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["autocast eager"])
    out = {}
    print("| row | median step ms | min-max ms | tokens/s | vs autocast eager |\n|---|---:|---:|---:|---:|")
    for name, ts in times.items():
        med = statistics.median(ts)
        out[name] = {"median_s": med, "min_s": min(ts), "max_s": max(ts), "tokens_per_s": tokens / med}
        print(f"| {name} | {med * 1e3:.1f} | {min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f} | {tokens / med:.0f} "
              f"| {base / med:.2f}x |", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="fp16 or bf16 (default: torch.autocast's default)")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--compile-mask", action="store_true", help="also the compiled twin without the rewrite")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    dev = torch.device(a.device)
    low = a.dtype or ("fp16" if dev.type == "cuda" else "bf16")
    ac = (dev.type, to_torch(low))
    model = example.build_model().to(dev)
    params = list(model.parameters())
    batch = example.get_batch(0, dev)
    tokens = batch["input_ids"].numel()
    rows = {"autocast eager": lambda: _step(model, batch, params, ac),
            "twin eager": (lambda f: lambda: _step(f, batch, params))(_twin(model, low, batch, False, True)),
            "twin eager, mask": (lambda f: lambda: _step(f, batch, params))(_twin(model, low, batch, False, False))}
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    result = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": low, "tokens_per_step": tokens,
              "tiny": os.environ.get("AUTOPREC_QWEN2_05B_TINY", ""), "eager": _time(rows, a, sync, tokens)}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "causal_mask.json").write_text(json.dumps(result, indent=1))  # kept if the compiles run out of time
    if a.compile:
        compiled = torch.compile(model)
        rows["autocast + compile"] = lambda: _step(compiled, batch, params, ac)
        for name, rewrite in (("twin compiled", True), ("twin compiled, mask", False))[:1 + a.compile_mask]:
            f = _twin(model, low, batch, True, rewrite)
            rows[name] = (lambda f: lambda: _step(f, batch, params))(f)
        result["all"] = _time(rows, a, sync, tokens)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "causal_mask.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
