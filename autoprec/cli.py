"""Command line: ``autoprec tune | train | show`` (DESIGN §1).

Exit codes: 0 success; 2 bad input (model file, policy file, arguments) with one message that
names the file and the field or entry point at fault, nothing written; 1 other failures.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

from autoprec.errors import AutoprecError

__all__ = ["main", "format_table"]


def format_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of result rows (config, tokens/s, speedup vs fp32, grad_rel_l2, peak MiB)."""
    head = "| config | tokens/s | speedup vs fp32 eager | grad_rel_l2 | peak MiB | note |"
    lines = [head, "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        g = r.get("grad_rel_l2")
        lines.append(
            f"| {r['config']} | {r['tokens_per_s']:.0f} | {r['speedup_vs_fp32']:.2f}x | "
            f"{'inf' if g is None else f'{g:.2e}'} | {r.get('peak_bytes', 0) / 2**20:.1f} | {r.get('error') or ''} |"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autoprec", description="Mixed-precision autotuner for PyTorch training.")
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("tune", help="search for the fastest policy within a drift budget")
    t.add_argument("model", help="model file (build_model, get_batch; DESIGN §2)")
    t.add_argument("--trials", type=int, default=None, help="finished trials the study should hold (default 20)")
    t.add_argument("--timeout", type=float, default=None, help="stop sampling after S seconds")
    t.add_argument("--max-drift", default="auto", help="'auto' (torch.autocast's grad_rel_l2) or a number")
    t.add_argument("--device", default="auto", help="auto | cpu | cuda")
    t.add_argument("--out", default="policy.json", help="policy file to write (default policy.json)")
    t.add_argument("--storage", default=None, help="Optuna storage URL (default: SQLite beside --out)")
    t.add_argument("--study-name", default=None)
    t.add_argument("--no-compile", action="store_true", help="measure eagerly, no torch.compile")
    t.add_argument("--dtypes", default="auto",
                   help="low dtypes to search: 'auto' (those the device runs faster than fp32, measured) "
                        "or a list such as bf16,fp16")
    t.add_argument("--seed", type=int, default=0)

    r = sub.add_parser("train", help="train with a policy")
    r.add_argument("model")
    r.add_argument("--policy", required=True, help="policy JSON file")
    r.add_argument("--steps", type=int, default=50)
    r.add_argument("--device", default="auto")
    r.add_argument("--no-compile", action="store_true")
    r.add_argument("--log-every", type=int, default=1)

    s = sub.add_parser("show", help="print a policy file (and per-node dtypes with --model)")
    s.add_argument("policy")
    s.add_argument("--model", default=None)
    return p


def _cmd_tune(a: argparse.Namespace) -> int:
    from autoprec.search.study import tune

    res = tune(a.model, trials=a.trials, timeout=a.timeout, max_drift=a.max_drift, device=a.device,
               storage=a.storage, study_name=a.study_name, compile=not a.no_compile, out=a.out,
               seed=a.seed, dtypes=a.dtypes)
    print()
    print(format_table(res.table))
    m = res.policy.measured
    print(f"\nchosen: {res.policy.summary()}")
    print(f"wrote {a.out}: {m['tokens_per_s']:.0f} tokens/s, {m['speedup_vs_fp32']:.2f}x fp32 eager, "
          f"grad_rel_l2 {m['grad_rel_l2']:.3g} (budget {m['drift_budget']:.3g})")
    print("time: " + ", ".join(f"{k} {v:.0f}s" for k, v in res.timings.items()))
    return 0


def _cmd_train(a: argparse.Namespace) -> int:
    from autoprec.runtime.loop import train

    res = train(a.model, a.policy, steps=a.steps, device=a.device, compile=not a.no_compile,
                log_every=a.log_every)
    print(f"final loss {res.final_loss:.4f}; {res.tokens_per_s:.0f} tokens/s; "
          f"skipped steps {res.skipped}; loss scale {res.loss_scale:g}")
    return 0 if math.isfinite(res.final_loss) else 1


def _cmd_show(a: argparse.Namespace) -> int:
    from autoprec.policy import Policy

    pol = Policy.load(a.policy)
    print(pol.to_json())
    if a.model:
        from autoprec.report import show_nodes

        print(show_nodes(pol, a.model))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``autoprec`` console script; returns the exit code."""
    args = _parser().parse_args(argv)
    t0 = time.perf_counter()
    try:
        code = {"tune": _cmd_tune, "train": _cmd_train, "show": _cmd_show}[args.cmd](args)
    except AutoprecError as e:
        print(f"autoprec {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"autoprec {args.cmd}: interrupted after {time.perf_counter() - t0:.0f}s; "
              "finished trials are kept in the study", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
