"""The torch.autocast + torch.compile baseline compiled flat (``torch.compile(model)``, as ``tune``
compiles it) against PyTorch's regional compilation recipe (each decoder layer compiled on its
own, ``layer.compile()``), for a Qwen2 of hidden 256 (4x128 tokens of ``qwen2_tiny``'s corpus) at
4 and 24 layers (issue 22: the flat compile is 43 s of the 24-layer tune's growth).

Per depth, one process with a fresh Inductor cache builds two copies of the model with the same
weights, compiles each (the first training step's seconds: Dynamo, AOTAutograd, Inductor) and
times their steady steps interleaved (A B A B ..., after warm-up), each step a forward and
backward under ``torch.autocast("cpu", torch.bfloat16)`` and an AdamW update. Reported: first-step
seconds, median step seconds with the interquartile range, and regional's step over flat's.

Run::

    .venv/bin/python benchmarks/autocast_regional.py --out benchmarks/results/autocast_regional_<date>
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from autoprec.device import describe_machine

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from qwen2_tiny import build_qwen2, make_batch  # noqa: E402


def _step(model: torch.nn.Module, fn, opt: torch.optim.Optimizer, batch: dict) -> float:
    """One training step under bf16 autocast; its wall seconds."""
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fn(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def measure(layers: int, steps: int) -> dict:
    """Both compiles of one depth, in this process (see the module docstring)."""
    torch.manual_seed(0)
    flat = build_qwen2(hidden_size=256, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=688)
    regional = copy.deepcopy(flat)
    for layer in regional.model.layers:
        layer.compile()
    fns = {"flat": torch.compile(flat), "regional": regional}
    models = {"flat": flat, "regional": regional}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    batches = [make_batch(k, "cpu", batch_size=4, seq_len=128) for k in range(4)]
    first = {k: _step(models[k], fns[k], opts[k], batches[0]) for k in fns}
    for k in fns:  # warm-up
        for b in batches[1:3]:
            _step(models[k], fns[k], opts[k], b)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(steps):
        for k in fns:
            times[k].append(_step(models[k], fns[k], opts[k], batches[i % len(batches)]))
    out = {"layers": layers, "first_step_s": first, "steps": steps}
    for k, ts in times.items():
        q = statistics.quantiles(ts, n=4)
        out[f"{k}_step_s"] = {"median": statistics.median(ts), "q1": q[0], "q3": q[2]}
    out["regional_over_flat_step"] = out["regional_step_s"]["median"] / out["flat_step_s"]["median"]
    return out


def main() -> None:
    """Each depth in a process of its own, with a fresh Inductor cache; ``<out>/results.json``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, nargs="+", default=[4, 24])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child: one depth, JSON on stdout
    a = p.parse_args()
    if a.one is not None:
        print(json.dumps(measure(a.one, a.steps)))
        return
    os.makedirs(a.out, exist_ok=True)
    results = []
    for n in a.layers:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="inductor-")}
        cmd = [sys.executable, __file__, "--out", a.out, "--one", str(n), "--steps", str(a.steps)]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        results.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"machine": describe_machine(torch.device("cpu")), "torch": torch.__version__,
                   "threads": torch.get_num_threads(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
