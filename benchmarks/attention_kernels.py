"""Fused SDPA against ``autoprec::sdpa_math`` (two explicit GEMMs, fp32 softmax): forward+backward
time per attention call at a model's shape, fp32 and bf16, eager and compiled (issue 18).

The configurations are timed in interleaved rounds (A B C D ... A B C D ...), so load that comes
and goes spreads over all of them; each reports the median milliseconds of its calls and the
bootstrap 95% band of that median (``autoprec.measure.noise.Timing.from_steps``), plus its
output's relative L2 error against float64 fused SDPA on the same inputs. The machine's CPU flags
go into ``machine.json`` beside the results.

Run::

    .venv/bin/python benchmarks/attention_kernels.py --out benchmarks/results/attention_math_<date>
    # qwen2_tiny's attention: batch 4, 8 heads (4 KV heads), 256 tokens, head dim 64 (the default)
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

from autoprec.device import describe_machine
from autoprec.kernels.attention import sdpa_math
from autoprec.measure import Timing

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _configs(compile_: bool) -> dict[str, tuple]:
    fused = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    math = lambda q, k, v: sdpa_math(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    out = {}
    for dt in DTYPES:
        out[f"fused {dt} eager"] = (fused, dt)
        out[f"math {dt} eager"] = (math, dt)
        if compile_:
            out[f"fused {dt} compiled"] = (torch.compile(fused), dt)
            out[f"math {dt} compiled"] = (torch.compile(math), dt)
    return out


def main() -> None:
    """Time every configuration and write ``attention.json``, ``attention.md``, ``machine.json``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--shape", type=int, nargs=5, default=[4, 8, 4, 256, 64],
                    metavar=("B", "H", "HKV", "S", "E"))
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    b, h, hkv, s, e = args.shape
    g = torch.Generator().manual_seed(0)
    ref_in = [torch.randn(b, n, s, e, generator=g, dtype=torch.float64) for n in (h, hkv, hkv)]
    grad = torch.randn(b, h, s, e, generator=g, dtype=torch.float64)
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=True, enable_gqa=True)
    configs = _configs(not args.no_compile)
    inputs = {dt: [t.to(d).requires_grad_() for t in ref_in] for dt, d in DTYPES.items()}
    times: dict[str, list[float]] = {name: [] for name in configs}
    err: dict[str, float] = {}
    for name, (fn, dt) in configs.items():  # warm-up (and compile) outside the timed rounds
        for _ in range(3):
            out = fn(*inputs[dt])
            out.backward(grad.to(out.dtype))
        err[name] = float((out.detach().double() - ref).norm() / ref.norm())
    for _ in range(args.rounds):
        for name, (fn, dt) in configs.items():
            t0 = time.perf_counter()
            fn(*inputs[dt]).backward(grad.to(DTYPES[dt]))
            times[name].append(time.perf_counter() - t0)
    rows = []
    for name in configs:
        t = Timing.from_steps(times[name], tokens_per_step=b * s)
        rows.append({"config": name, "ms": t.step_s * 1e3, "band_ms": [x * 1e3 for x in t.band_s],
                     "rel_l2_vs_float64": err[name], "calls": len(times[name])})
    os.makedirs(args.out, exist_ok=True)
    meta = {"shape": {"batch": b, "heads": h, "kv_heads": hkv, "seq": s, "head_dim": e}, "causal": True,
            "torch": torch.__version__, "threads": torch.get_num_threads()}
    with open(os.path.join(args.out, "attention.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "machine.json"), "w") as f:
        json.dump(describe_machine(torch.device("cpu")), f, indent=1)
    lines = [f"Attention forward+backward, shape {meta['shape']}, causal, {meta['threads']} threads, "
             f"torch {meta['torch']}; median of {args.rounds} interleaved calls, bootstrap 95% band.", "",
             "| config | ms | band ms | rel L2 vs float64 |", "|---|---:|---:|---:|"]
    lines += [f"| {r['config']} | {r['ms']:.2f} | {r['band_ms'][0]:.2f}–{r['band_ms'][1]:.2f} | "
              f"{r['rel_l2_vs_float64']:.2e} |" for r in rows]
    with open(os.path.join(args.out, "attention.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
