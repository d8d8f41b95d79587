"""Does eager screening rank policies as the compiled measurement does?

``autoprec tune`` measures trials eagerly and compiles only the finalists. This script measures a
set of policies both ways in one process, on the same weights and batches (``Harness``), and
reports Spearman's rank correlation between the eager and the compiled tokens/s, and whether the
eager winner is the compiled winner.

Usage::

    python benchmarks/screening_ranking.py MODEL.py OUT.json [--dtypes bf16]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from autoprec.applied.compile import compile_graph
from autoprec.device import device_name
from autoprec.measure import Harness
from autoprec.modelspec import load_model_spec
from autoprec.passes import run_pipeline
from autoprec.search.space import SearchSpace
from autoprec.training.train import make_scaler


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rho of two equally long lists (no ties expected in timings)."""
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0] * len(x)
        for pos, i in enumerate(order):
            r[i] = pos
        return r

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    d2 = sum((x - y) ** 2 for x, y in zip(ra, rb))
    return 1 - 6 * d2 / (n * (n * n - 1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--dtypes", default="bf16")
    a = ap.parse_args()
    spec = load_model_spec(a.model)
    h = Harness(spec, torch.device("cpu"), warmup=2, steps=7)
    lows = a.dtypes.split(",")
    space = SearchSpace(lows)
    params = [p for _n, p in space.baselines()] + [
        {"matmul": "fp32", "sensitive": "fp32", "follow": lows[0]},
        {"matmul": lows[0], "sensitive": "fp32", "follow": "fp32"},
    ]
    rows = []
    for p in params:
        pol = space.to_policy(p)
        gm = run_pipeline(h.graph_module, pol).graph_module
        eager = h.measure(gm, lambda pol=pol: make_scaler(pol))
        t0 = time.perf_counter()
        comp = h.measure(compile_graph(gm), lambda pol=pol: make_scaler(pol))
        rows.append({"policy": pol.summary(), "eager_tokens_per_s": eager.tokens_per_s,
                     "compiled_tokens_per_s": comp.tokens_per_s,
                     "compile_and_measure_s": time.perf_counter() - t0,
                     "eager_grad_rel_l2": eager.grad_rel_l2, "compiled_grad_rel_l2": comp.grad_rel_l2})
        print(rows[-1], flush=True)
    e = [r["eager_tokens_per_s"] for r in rows]
    c = [r["compiled_tokens_per_s"] for r in rows]
    res = {"model": a.model, "device": device_name(torch.device("cpu")), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "rows": rows, "spearman_rho": spearman(e, c),
           "eager_winner_is_compiled_winner": e.index(max(e)) == c.index(max(c))}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"spearman rho {res['spearman_rho']:.3f}; same winner: {res['eager_winner_is_compiled_winner']}")


if __name__ == "__main__":
    main()
