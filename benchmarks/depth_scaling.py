"""Cost against depth (issue 22): the first training step's compile, flat and with regional
compilation, and a default ``tune`` followed by ``train``, for a Qwen2 of hidden 256 (4 heads,
2 KV heads, MLP 688, 4x128 tokens of ``qwen2_tiny``'s corpus) at growing depth.

Every measurement runs in a process of its own, one after the other (never two at once), with a
fresh Inductor cache (``TORCHINDUCTOR_CACHE_DIR``) so compiles are cold, except ``train`` after
``tune``, which shares ``tune``'s cache as a user's would. Reported:

- ``first_step``: ``autoprec.apply`` (capture + passes) and the first forward+backward (Dynamo,
  AOTAutograd, Inductor) of ``Policy.default("bf16")``, flat (``regional=False``) and regional,
  plus the median step after it (8 steps; interquartile range), what the regions were and Dynamo's
  compile seconds of that first step (``compile_s``); and ``autocast``: the model itself under
  ``torch.autocast(bf16)``, compiled flat as users compile it (``tune``'s torch.autocast +
  torch.compile bar);
- ``tune``: wall seconds, the phases of its ``time:`` line, its cache line, the kernels its probe
  kept (``searched``: none means every policy is all-fp32 and nothing is searched, so two depths
  compare like for like only when both searched); then ``train --steps 3`` on the written policy:
  its first step's seconds and cache line. A depth given twice in ``--tune-layers`` is tuned
  again from a cold cache into a new study (``policy_<k>.json``, ``tune_l<layers>_<k>.log``): the
  probe's keep rule can flip between runs.

Run::

    .venv/bin/python benchmarks/depth_scaling.py --out benchmarks/results/depth_<date>
    # --layers 2 8 24 (first step) --tune-layers 4 24 (tune, then train)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

from autoprec.device import describe_machine

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")
MODEL = '''"""Qwen2 of hidden 256 with {layers} layers (benchmarks/depth_scaling.py)."""
import sys
sys.path.insert(0, {examples!r})
from qwen2_tiny import build_qwen2, make_batch


def build_model():
    return build_qwen2(hidden_size=256, num_hidden_layers={layers}, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=688)


def get_batch(step, device):
    return make_batch(step, device, batch_size=4, seq_len=128)
'''

FIRST_STEP = r'''
import json, sys, time, torch
sys.path.insert(0, sys.argv[1])
import logging
from model import build_model, get_batch
import autoprec
from autoprec.policy import Policy
from autoprec.applied.compile import compile_graph
from autoprec.applied.outputs import flat_output_graph
from autoprec.metrics import median
from autoprec.applied.regions import outline_blocks
from autoprec._torch_compat import dynamo_compile_seconds
mode = sys.argv[2]
model, batch = build_model(), get_batch(0, "cpu")
t0 = time.perf_counter()
if mode == "autocast":  # the model itself, flat, as tune's torch.autocast + torch.compile bar
    flat, compiled = None, compile_graph(model)
    def fn(**b):
        with torch.autocast("cpu", torch.bfloat16):
            return compiled(**b)
else:
    mp = autoprec.apply(model, Policy.default("bf16"), batch, compile=False, dynamic=False)
    flat = flat_output_graph(mp.graph_module)[0]
    fn = compile_graph(flat, regional=mode == "regional")
t1 = time.perf_counter()
fn(**batch)[0].backward()
t2 = time.perf_counter()
compile_s = dynamo_compile_seconds()
steps = []
for _ in range(8):
    s = time.perf_counter(); fn(**batch)[0].backward(); steps.append(time.perf_counter() - s)
steps.sort()
regions = ("flat, torch.autocast(bf16)" if flat is None else
           outline_blocks(flat)[1].describe() if mode == "regional" else "flat")
print(json.dumps({"apply_s": t1 - t0, "first_step_s": t2 - t1, "compile_s": compile_s,
                  "steady_s": median(steps), "steady_iqr_s": [steps[2], steps[6]],
                  "nodes": len(flat.graph.nodes) if flat is not None else 0, "regions": regions}))
'''


def _run(cmd: list[str], env: dict[str, str]) -> tuple[str, float]:
    """Run ``cmd``; its stdout+stderr and wall seconds (raises on a non-zero exit)."""
    start = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stderr[-3000:]}")
    return r.stdout + r.stderr, time.perf_counter() - start


def _model_dir(work: str, layers: int) -> str:
    d = os.path.join(work, f"qwen2_l{layers}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "model.py"), "w") as f:
        f.write(MODEL.format(layers=layers, examples=os.path.abspath(EXAMPLES)))
    return d


def _cold_env(work: str, name: str) -> dict[str, str]:
    return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(work, "cache", name)}


def first_steps(work: str, layers: list[int]) -> list[dict]:
    """The ``first_step`` rows, flat, regional and torch.autocast's bar per depth."""
    rows = []
    for n in layers:
        d = _model_dir(work, n)
        for mode in ("flat", "regional", "autocast"):
            out, _ = _run([sys.executable, "-c", FIRST_STEP, d, mode], _cold_env(work, f"first-{n}-{mode}"))
            row = json.loads(next(ln for ln in reversed(out.splitlines())
                                  if ln.startswith("{\"apply_s"))) | {"layers": n, "mode": mode}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


#: A probe log line's kernels kept for the search (``probe bf16: ... -> searched: bf16:fp32``).
SEARCHED = r"^\[autoprec\] probe \S+: .* -> searched: (.*)$"


def tune_then_train(work: str, layers: list[int], out: str) -> list[dict]:
    """The ``tune`` rows: default tune, then train on its policy with tune's cache; each tune's
    log goes to ``out/tune_l<layers>.log``."""
    rows = []
    for i, n in enumerate(layers):
        d = _model_dir(work, n)
        k = layers[:i].count(n)  # the k-th repeat of this depth
        env = _cold_env(work, f"tune-{n}-{k}")
        policy = os.path.join(d, f"policy_{k}.json" if k else "policy.json")  # its own study too
        log, wall = _run([sys.executable, "-m", "autoprec.cli", "tune", os.path.join(d, "model.py"),
                          "--out", policy], env)
        times = re.search(r"^time: (.*)$", log, re.M)
        with open(policy) as f:
            written = json.load(f)
        measured, baseline = written.get("measured", {}), written.get("provenance", {}).get("baseline")
        row = {"layers": n, "tune_wall_s": wall,
               "phases": ({k: float(v) for k, v in re.findall(r"(\w+) (\d+)s", times.group(1))}
                          if times else {}),
               "tune_cache": (re.search(r"^Inductor caches: .*$", log, re.M) or [""])[0],
               "vs_autocast_compiled": measured.get("speedup_vs_autocast"),
               "vs_baseline": measured.get("speedup_vs_baseline"), "baseline": baseline,
               "policy": written.get("rules", []),
               "searched": [kern for ks in re.findall(SEARCHED, log, re.M) for kern in ks.split(", ")]}
        tlog, twall = _run([sys.executable, "-m", "autoprec.cli", "train", os.path.join(d, "model.py"),
                            "--policy", policy, "--steps", "3"], env)
        first = re.search(r"first step ([\d.]+) s \(compile included\); (.*)$", tlog, re.M)
        row |= {"train_wall_s": twall, "train_first_step_s": float(first.group(1)) if first else None,
                "train_cache": first.group(2) if first else ""}
        with open(os.path.join(out, f"tune_l{n}" + (f"_{k}" if k else "") + ".log"), "w") as f:
            f.write(log.replace(work, "<work>"))  # no machine paths in committed logs
        print(json.dumps({k: v for k, v in row.items() if k != "policy"}), flush=True)
        rows.append(row)
    return rows


def _markdown(res: dict) -> str:
    lines = ["| layers | mode | nodes | apply s | first step s | apply+first s | compile s | steady s (IQR) "
             "| regions |",
             "|---:|---|---:|---:|---:|---:|---:|---|---|"]
    for r in res["first_step"]:
        lines.append(f"| {r['layers']} | {r['mode']} | {r['nodes']} | {r['apply_s']:.1f} | "
                     f"{r['first_step_s']:.1f} | {r['apply_s'] + r['first_step_s']:.1f} | "
                     f"{r.get('compile_s', float('nan')):.1f} | "
                     f"{r['steady_s']:.3f} ({r['steady_iqr_s'][0]:.3f}-{r['steady_iqr_s'][1]:.3f}) | "
                     f"{r['regions']} |")
    lines += ["",
              "| layers | tune s | searched | phases | vs the baseline to beat | vs autocast+compile "
              "| tune caches | train first step s | train caches |",
              "|---:|---:|---|---|---|---:|---|---:|---|"]
    for r in res["tune"]:
        phases = ", ".join(f"{k} {v:.0f}" for k, v in r["phases"].items())
        vs = f"{r['vs_baseline']:.2f}x {r['baseline']}" if r.get("vs_baseline") is not None else ""
        ac = f"{r['vs_autocast_compiled']:.2f}x" if r.get("vs_autocast_compiled") is not None else ""
        searched = ", ".join(r.get("searched") or []) or "nothing (all-fp32)"
        lines.append(f"| {r['layers']} | {r['tune_wall_s']:.0f} | {searched} | {phases} | {vs} | {ac} | "
                     f"{r['tune_cache']} | {r['train_first_step_s']} | {r['train_cache']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    """Measure and write ``depth.json``, ``depth.md``, ``machine.json`` and the tune logs to ``--out``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--layers", type=int, nargs="*", default=[2, 8, 24])
    ap.add_argument("--tune-layers", type=int, nargs="*", default=[4, 24])
    ap.add_argument("--work", help="keep the model folders, studies and Inductor caches here "
                                   "(default: a temporary folder, removed)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "machine.json"), "w") as f:
        json.dump(describe_machine(torch.device("cpu")), f, indent=2)
    with (contextlib.nullcontext(a.work) if a.work else tempfile.TemporaryDirectory()) as work:
        os.makedirs(work, exist_ok=True)
        res = {"first_step": first_steps(work, a.layers), "tune": tune_then_train(work, a.tune_layers, a.out)}
    with open(os.path.join(a.out, "depth.json"), "w") as f:
        json.dump(res, f, indent=2)
    with open(os.path.join(a.out, "depth.md"), "w") as f:
        f.write(_markdown(res))
    print(_markdown(res))


if __name__ == "__main__":
    main()
