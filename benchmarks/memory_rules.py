"""Why the harness and ``bench --nproc`` count CPU memory by different rules (autoprec.measure.memory).

One process, one small MLP (``--blocks`` residual blocks LayerNorm → Linear(d, 4d) → GELU →
Linear(4d, d), batch ``--batch`` × ``--seq`` tokens), trained eagerly and compiled with
``autoprec.applied.compile.compile_graph``. Per variant, after one untimed step (the compile):

- ``saved``: :class:`autoprec.measure.memory.SavedBytes` of one forward (the harness's rule),
  ``grads``: the gradient bytes, ``state``: AdamW's state bytes (``optimizer_state_bytes``);
- ``heap``: :class:`autoprec.measure.memory.PeakBytes`' CPU span (bench --nproc's rule) over one
  forward + backward from ``grad = None``, ``ops``: the ATen ops its dispatch mode saw, and
  ``grad_fn_under_span``: the output's ``grad_fn`` there (``CompiledFunctionBackward`` only when the
  compiled graph ran; outside the span: ``grad_fn``);
- ``compiled_under_span``: a fresh ``compile_graph`` (after ``torch._dynamo.reset()``) whose first
  call runs inside the span: the compiles Dynamo made there (``autoprec.device.compile_count``), the
  ops the mode saw, and ``grad_fn_after_span``/``compiles_after_span`` of its next call, outside.

Run::

    .venv/bin/python benchmarks/memory_rules.py --out benchmarks/results/memory_rules_<date>.json
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

from autoprec._io import write_json
from autoprec.applied.compile import compile_graph
from autoprec.device import compile_count, describe_machine
from autoprec.measure.memory import HeapPeak, PeakBytes, SavedBytes, optimizer_state_bytes

MIB = 2**20


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class CountingHeapPeak(HeapPeak):
    """:class:`HeapPeak` that also counts the ATen ops it sees."""

    def __enter__(self) -> CountingHeapPeak:
        self.ops = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def forward_backward(fn, params, x) -> str:
    """One forward + backward from ``grad = None``; returns the output's ``grad_fn`` class name
    (``CompiledFunctionBackward`` when the compiled graph ran, an eager op's otherwise)."""
    for p in params:
        p.grad = None
    y = fn(x)
    y.pow(2).mean().backward()
    return type(y.grad_fn).__name__


def heap_span(fn, params, x) -> dict[str, float]:
    """PeakBytes' CPU rule over one forward + backward, with the ops its mode saw and the compiles."""
    meter = PeakBytes(torch.device("cpu"))
    mode = CountingHeapPeak()
    before = compile_count()
    with mode:  # what PeakBytes.span does on CPU, with the op count kept
        ran = forward_backward(fn, params, x)
    meter.peak = max(mode.peak - mode.base, 0)
    return {"heap_mib": meter.peak / MIB, "ops": mode.ops, "compiles": compile_count() - before,
            "grad_fn_under_span": ran}


def saved_bytes(fn, params, x) -> int:
    counter = SavedBytes(params)
    for p in params:
        p.grad = None
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        loss = fn(x).pow(2).mean()
    loss.backward()
    return counter.total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(a.dim) for _ in range(a.blocks)])
    params = [p for p in model.parameters() if p.requires_grad]
    x = torch.randn(a.batch, a.seq, a.dim)
    opt = torch.optim.AdamW(params)
    forward_backward(model, params, x)
    opt.step()
    grads = sum(p.numel() * p.element_size() for p in params)
    out = {"machine": describe_machine(torch.device("cpu")), "torch": torch.__version__, "args": vars(a),
           "grads_mib": grads / MIB, "adamw_state_mib": optimizer_state_bytes(opt) / MIB, "variants": {}}
    compiled = compile_graph(model)
    for name, fn in (("eager", model), ("compiled", compiled)):
        ran = forward_backward(fn, params, x)  # the compiled one compiles here, outside any span
        row = {"grad_fn": ran, "saved_mib": saved_bytes(fn, params, x) / MIB, **heap_span(fn, params, x)}
        row["counted_mib"] = row["saved_mib"] + grads / MIB
        out["variants"][name] = row
        print(name, json.dumps(row), flush=True)
    torch._dynamo.reset()
    fresh = compile_graph(model)
    out["compiled_under_span"] = heap_span(fresh, params, x)
    before = compile_count()
    out["compiled_under_span"]["grad_fn_after_span"] = forward_backward(fresh, params, x)
    out["compiled_under_span"]["compiles_after_span"] = compile_count() - before
    print("compiled_under_span", json.dumps(out["compiled_under_span"]), flush=True)
    if a.out:
        write_json(a.out, out, indent=2)


if __name__ == "__main__":
    main()
