"""Cast count and bytes cast for the naive / paint / mincut placements on a model.py example.

Usage::

    python benchmarks/cast_placement.py [examples/qwen2_tiny.py] [--policy default|fp16]

Prints a markdown table (the one in docs/cast_placement.md). Bytes are counted at fp32 size
(4 bytes per element of each converted tensor), per forward pass, parameters included.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from autoprec.capture import capture
from autoprec.graph import PLACEMENT_MODES
from autoprec.modelspec import load_model_spec
from autoprec.nodemeta import read_meta
from autoprec.passes import run_pipeline
from autoprec.policy import Policy


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="examples/qwen2_tiny.py")
    ap.add_argument("--low", default="bf16", choices=["bf16", "fp16"])
    a = ap.parse_args(argv)
    spec = load_model_spec(a.model)
    model = spec.build_model()
    batch = spec.get_batch(0, torch.device("cpu"))
    gm = capture(model, batch)
    n_nodes = sum(n.op == "call_function" for n in gm.graph.nodes)
    policy = Policy.default(a.low)
    print(f"model: {a.model}; policy: Policy.default({a.low!r}) ({policy.summary()}); "
          f"{n_nodes} call_function nodes; torch {torch.__version__}\n")
    print("| placement | casts | bytes cast | MB | follow nodes in low precision | pipeline time (s) |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = {}
    for mode in ("naive", "paint", "mincut"):
        assert mode in PLACEMENT_MODES
        t = time.perf_counter()
        r = run_pipeline(gm, policy, mode)
        dt = time.perf_counter() - t
        low_follow = sum(
            1 for n in r.graph_module.graph.nodes
            if (read_meta(n).decided_by or "").startswith("placement:")
            and read_meta(n).dtype not in (None, "fp32")
        )
        s = r.stats
        rows[mode] = s["cast_bytes"]
        print(f"| {mode} | {s['casts']} | {s['cast_bytes']:,} | {s['cast_bytes'] / 1e6:.2f} | "
              f"{low_follow} / {s['placed']} | {dt:.2f} |")
    ok = rows["mincut"] <= rows["paint"] <= rows["naive"]
    print(f"\nmincut <= paint <= naive: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
