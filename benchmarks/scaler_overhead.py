"""Loss-scaler overhead: autoprec's DynamicLossScaler against torch.amp.GradScaler, side by side.

Times one scaler iteration (``unscale_`` + ``step`` + ``update``, with an SGD step of lr 0 so the
parameters stay put) on the gradients of ``examples/qwen2_tiny.py``'s model (~11.9M fp32
parameters), interleaving the two scalers for ``--iters`` iterations after 5 warm-up iterations
each, and prints the median seconds of each and their ratio (with the interquartile range). Every
``--inf-every``-th iteration plants an inf in one gradient, so the skip path is timed too.

Usage: ``python benchmarks/scaler_overhead.py [--iters 40] [--inf-every 10]``; the numbers behind
the GradScaler decision in docs/architecture.md#design-choices.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autoprec.device import describe_machine  # noqa: E402
from autoprec.training.scaler import DynamicLossScaler  # noqa: E402
from examples.qwen2_tiny import build_model  # noqa: E402


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def main() -> None:
    """Run the comparison and print a JSON line of medians (seconds), IQRs and the ratio."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--inf-every", type=int, default=10)
    a = ap.parse_args()
    params = [p for p in build_model().parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.0)
    scalers = {"autoprec": DynamicLossScaler(), "GradScaler": torch.amp.GradScaler("cpu")}
    times: dict[str, list[float]] = {k: [] for k in scalers}
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=gen) * 2.0**16 for p in params]
    for i in range(5 + a.iters):
        for name, scaler in scalers.items():
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            if a.inf_every and i % a.inf_every == a.inf_every - 1:
                params[0].grad.view(-1)[0] = float("inf")
            scaler.scale(torch.ones(()))  # GradScaler sets its scale up on the first scale()
            t0 = time.perf_counter()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            if i >= 5:
                times[name].append(time.perf_counter() - t0)
    keys = ("q1_s", "median_s", "q3_s")
    out = {name: dict(zip(keys, _quartiles(ts), strict=True)) for name, ts in times.items()}
    out["ratio_autoprec_over_gradscaler"] = out["autoprec"]["median_s"] / out["GradScaler"]["median_s"]
    out["scales_equal"] = scalers["autoprec"].get_scale() == scalers["GradScaler"].get_scale()
    out["machine"] = {k: v for k, v in describe_machine(torch.device("cpu")).items() if k != "date_utc"}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
