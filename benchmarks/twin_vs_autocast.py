"""The autocast twin against torch.autocast, eager and compiled, one factor at a time, side by side.

Times one forward + backward step (no optimizer) of ``examples/qwen2_05b.py`` (or ``--model``, a
model file with ``build_model()`` and ``get_batch(step, device)`` returning ``input_ids`` and
``labels`` for a Hugging Face causal LM) on one device. Rows
(``--rows``, in this order of cost; each compiled row is one compile):

- ``autocast_eager``: the model under ``torch.autocast`` (the model's own code skips its causal
  mask and calls SDPA with ``is_causal``);
- ``twin_eager`` / ``twin_eager_mask``: ``apply(model, Policy.autocast(low), compile=False)``, with
  the capture's causal-mask rewrite (autoprec/capture/causal.py) and without it (the mask the
  export materialised);
- ``autocast_compiled``: ``torch.compile(model)`` under ``torch.autocast`` (the bar);
- ``twin_compiled``: ``apply(...)`` as a user calls it with a policy that names no compile options
  (the example's shapes static, as ``torch.compile`` compiles a first shape; compiled as
  ``torch.compile(model)`` would: one flat graph, Inductor's defaults, so
  ``emulate_precision_casts`` off); ``twin_tuned``: the twin with the compile options
  ``tune`` records when it measured nothing else (repeated blocks as regions, emulated casts);
  ``twin_tuned_flat``: flat with emulated casts (``tune --compile-variants``'s flat variant); the
  three side by side give regional's and ``emulate_precision_casts``'s costs. (No narrower
  workaround of the region buffer bug exists to time: tests/applied/test_region_workaround.py.)
  ``twin_static``: ``dynamic=False`` with the tuned options (what ``tune`` and ``train`` compile for a
  model file whose batches keep one shape); ``twin_static_flat``: that graph compiled without
  regions; ``twin_static_mask``: ``twin_static`` without the causal-mask rewrite.

Eager rows are timed first and written (OUT/twin_vs_autocast.json), then every row again with the
compiled ones. Rounds are interleaved (one step of each row per round, after ``--warmup`` rounds);
each row's median step time over ``--steps`` rounds, with the min–max of its steps, and tokens/s.
``AUTOPREC_QWEN2_05B_TINY=1`` shrinks the model for a CPU dry run.

Usage: python benchmarks/twin_vs_autocast.py OUT [--device cuda] [--dtype fp16] [--rows ROW ...]
       [--model FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO))


from autoprec import Policy, apply  # noqa: E402
from autoprec.applied.compile import compile_graph  # noqa: E402
from autoprec.capture import trace  # noqa: E402
from autoprec.device import describe_machine, sync  # noqa: E402
from autoprec.dtypes import to_torch  # noqa: E402
from autoprec.metrics import median  # noqa: E402
from autoprec.policy import REGIONAL_EMULATED, CompileOptions  # noqa: E402

EAGER = ("autocast_eager", "twin_eager", "twin_eager_mask")
COMPILED = ("autocast_compiled", "twin_compiled", "twin_tuned", "twin_tuned_flat", "twin_static",
            "twin_static_flat", "twin_static_mask")


def _step(fn, batch, params, autocast=None) -> None:
    """One forward + backward; gradients set to None first."""
    for p in params:
        p.grad = None
    if autocast is None:
        loss = fn(**batch).loss
    else:
        with torch.autocast(autocast[0], dtype=autocast[1]):
            loss = fn(**batch).loss
    loss.backward()


def _twin(model, low, batch, compile, rewrite=True, dynamic=True, options=REGIONAL_EMULATED):
    """The autocast twin applied to ``model`` with compile ``options`` (None: no say, as a policy
    built in Python), captured with or without the causal-mask rewrite."""
    keep = trace.causal_attention
    if not rewrite:
        trace.causal_attention = lambda gm: 0
    try:
        policy = dataclasses.replace(Policy.autocast(low), compile_options=options)
        return apply(model, policy, batch, compile=compile, dynamic=dynamic)
    finally:
        trace.causal_attention = keep


def _row(name, model, low, batch, ac):
    """The module a row steps, and the autocast it steps under (None: the module casts itself)."""
    if name == "autocast_eager":
        return model, ac
    if name == "autocast_compiled":
        return torch.compile(model), ac
    if name == "twin_static_flat":
        lowered = _twin(model, low, batch, False, dynamic=False).graph_module
        return compile_graph(lowered, regional=False), None
    return {"twin_eager": lambda: _twin(model, low, batch, False),
            "twin_eager_mask": lambda: _twin(model, low, batch, False, rewrite=False),
            "twin_compiled": lambda: _twin(model, low, batch, True, options=None),
            "twin_tuned": lambda: _twin(model, low, batch, True),
            "twin_tuned_flat": lambda: _twin(model, low, batch, True, options=CompileOptions(False, True)),
            "twin_static": lambda: _twin(model, low, batch, True, dynamic=False),
            "twin_static_mask": lambda: _twin(model, low, batch, True, rewrite=False, dynamic=False),
            }[name](), None


def _time(rows, a, dev, tokens) -> dict[str, dict[str, float]]:
    """Time ``rows`` in interleaved rounds (first calls apart: they compile); print and return the table."""
    times: dict[str, list[float]] = {k: [] for k in rows}
    for name, fn in rows.items():
        t0 = time.perf_counter()
        fn()
        sync(dev)
        print(f"{name}: first step {time.perf_counter() - t0:.1f} s", flush=True)
    for r in range(a.warmup + a.steps):
        for name, fn in rows.items():
            sync(dev)
            t0 = time.perf_counter()
            fn()
            sync(dev)
            if r >= a.warmup:
                times[name].append(time.perf_counter() - t0)
    base = median(next(iter(times.values())))
    out = {}
    print("| row | median step ms | min-max ms | tokens/s | vs the first row |\n|---|---:|---:|---:|---:|")
    for name, ts in times.items():
        med = median(ts)
        out[name] = {"median_s": med, "min_s": min(ts), "max_s": max(ts), "tokens_per_s": tokens / med}
        print(f"| {name} | {med * 1e3:.1f} | {min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f} | {tokens / med:.0f} "
              f"| {base / med:.2f}x |", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="fp16 or bf16 (default: torch.autocast's default)")
    ap.add_argument("--rows", nargs="+", choices=EAGER + COMPILED, default=list(EAGER + COMPILED[:4]))
    ap.add_argument("--model", type=Path, default=REPO / "examples" / "qwen2_05b.py",
                    help="a model file with build_model() and get_batch(step, device) "
                         "(default: the GPU check's)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    spec = importlib.util.spec_from_file_location("model_file", a.model)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    dev = torch.device(a.device)
    low = a.dtype or ("fp16" if dev.type == "cuda" else "bf16")
    ac = (dev.type, to_torch(low))
    model = example.build_model().to(dev)
    params = list(model.parameters())
    batch = example.get_batch(0, dev)
    tokens = batch["input_ids"].numel()
    result = {"machine": describe_machine(dev),  # device, CPU model and flags, load
              "torch": torch.__version__, "dtype": low, "tokens_per_step": tokens,
              "tiny": os.environ.get("AUTOPREC_QWEN2_05B_TINY", "")}
    rows = {}
    for group in ([r for r in a.rows if r in EAGER], [r for r in a.rows if r in COMPILED]):
        if not group:
            continue
        for name in group:
            fn, autocast = _row(name, model, low, batch, ac)
            rows[name] = functools.partial(_step, fn, batch, params, autocast)
        result["eager" if group[0] in EAGER else "all"] = _time(rows, a, dev, tokens)
        a.out.mkdir(parents=True, exist_ok=True)  # after each group: kept if a compile runs out of time
        (a.out / "twin_vs_autocast.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
