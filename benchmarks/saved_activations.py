"""Saved activations in low precision: which PyTorch machinery works on compiled training graphs (issue 14).

One process, side by side, on a Qwen2 stand-in of ``examples/qwen2_tiny.py`` (same builder and
batches; ``--layers``/``--hidden`` shrink it so the compiles fit a 2-core CPU): per variant one
training step's saved-activation bytes (the harness's CPU memory rule: distinct non-parameter
storages saved for backward, counted by an outer ``saved_tensors_hooks`` pair,
docs/architecture.md#measurements), the heap growth from before forward to after it (glibc
``mallinfo2``: what forward leaves alive for backward, a check independent of hooks), the median
step time (forward+backward, after warm-up) and ``grad_rel_l2`` against the eager fp32 graph.

Variants: (a) fp32 compiled; (b) bf16 storage / fp32 compute casts before each matmul, default
partitioner and with the ``ban_recompute_*`` knobs off; (c) Inductor's
``activation_quantization_aten_pass``; (d) ``saved_tensors_hooks``: Python hooks around the
compiled call, and ``autoprec.applied.saved`` (inlined GraphModule hooks) compiled and eager.

Run::

    .venv/bin/python benchmarks/saved_activations.py --out benchmarks/results/saved_activations_<date>
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import qwen2_tiny  # noqa: E402

import autoprec  # noqa: E402
from autoprec.applied.apply import MixedPrecisionModule
from autoprec.applied.compile import INDUCTOR_OPTIONS  # noqa: E402
from autoprec.applied.outputs import flat_output_graph, rebuild  # noqa: E402
from autoprec.device import describe_machine, heap_bytes  # noqa: E402
from autoprec.measure import SavedBytes  # noqa: E402
from autoprec.metrics import grad_rel_l2  # noqa: E402
from autoprec.nodemeta import meta_of  # noqa: E402
from autoprec.policy import Policy  # noqa: E402

MIB = 2**20


class Counter(SavedBytes):
    """The harness's rule (:class:`autoprec.measure.memory.SavedBytes`), with the bytes per dtype and
    the count of saved tensors holding ±inf/NaN (e.g. attention masks)."""

    def __init__(self, params) -> None:
        super().__init__(list(params))
        self.dtypes: dict[str, int] = {}
        self.nonfinite = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        before = self.total
        super().pack(t)
        if self.total > before:  # a storage not counted yet
            name = str(t.dtype).replace("torch.", "")
            self.dtypes[name] = self.dtypes.get(name, 0) + self.total - before
            if t.is_floating_point() and not bool(torch.isfinite(t.float()).all()):
                self.nonfinite += 1
        return t


def casts_before_matmuls(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """(b): x -> x.to(bf16) -> .to(fp32) on each linear's activation input (bf16 storage, fp32 compute)."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.linear.default:
            x = node.args[0]
            with gm.graph.inserting_before(node):
                low = gm.graph.call_function(torch.ops.aten._to_copy.default, (x,), {"dtype": torch.bfloat16})
                up = gm.graph.call_function(torch.ops.aten._to_copy.default, (low,), {"dtype": torch.float32})
            node.replace_input_with(x, up)
    gm.recompile()
    return gm


def python_hooks() -> Any:
    """(d1): plain Python hooks: every fp32 saved tensor -> bf16 (no node identity at run time),
    chained into the outer (counting) pair so the counter sees the packed tensors."""
    outer = torch._C._autograd._top_saved_tensors_default_hooks(True)

    def pack(t):
        low = (t.to(torch.bfloat16) if t.dtype == torch.float32 and not isinstance(t, torch.nn.Parameter)
               else t)
        return (t.dtype, outer[0](low) if outer else low)

    def unpack(p):
        low = outer[1](p[1]) if outer else p[1]
        return low.to(p[0])

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def marked(model, gm, saved: str, compile: bool) -> MixedPrecisionModule:
    """(d2/d3): autoprec.applied.saved with every float node's output marked ``saved``."""
    for n in gm.graph.nodes:
        if n.op == "call_function":
            meta_of(n).saved = saved
    return MixedPrecisionModule(model, gm, Policy.fp32(), {}, compile)


def step(fn, params, batch, counter: Counter | None, ctx: Any = None) -> tuple[float, list[torch.Tensor],
                                                                               int]:
    """One forward+backward; returns loss, gradients and the heap growth over forward (bytes)."""
    for p in params:
        p.grad = None
    hooks = (torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t) if counter is not None
             else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    before = heap_bytes()
    with hooks:
        if ctx is not None:
            with ctx():
                out = fn(**batch)
        else:
            out = fn(**batch)
    held = heap_bytes() - before
    out.loss.backward()
    return float(out.loss), [p.grad.detach().clone() for p in params], held


def measure(name, fn, params, batch, ref, ctx=None, steps: int = 5) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        step(fn, params, batch, None, ctx)  # compiles
    except Exception as e:  # noqa: BLE001 - a variant that does not run is a result
        return {"variant": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    first = time.perf_counter() - t0
    counter = Counter(params)
    loss, grads, held = step(fn, params, batch, counter, ctx)
    times = []
    for _ in range(steps + 1):
        t = time.perf_counter()
        step(fn, params, batch, None, ctx)
        times.append(time.perf_counter() - t)
    row = {"variant": name, "saved_MiB": counter.total / MIB, "saved_by_dtype_MiB":
           {k: v / MIB for k, v in counter.dtypes.items()}, "saved_nonfinite_tensors": counter.nonfinite,
           "forward_heap_growth_MiB": held / MIB,
           "step_s": statistics.median(times[1:]), "first_call_s": first,
           "grad_rel_l2": grad_rel_l2(grads, ref[1]) if ref else 0.0, "loss": loss}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = qwen2_tiny.build_qwen2(hidden_size=args.hidden, num_hidden_layers=args.layers,
                                   num_attention_heads=8, num_key_value_heads=4,
                                   intermediate_size=int(args.hidden * 2.6875))
    params = [p for p in model.parameters() if p.requires_grad]
    batch = qwen2_tiny.get_batch(0, "cpu")
    base = autoprec.apply(model, Policy.fp32(), batch, compile=False, dynamic=False).graph_module

    def graph():  # a fresh flat copy of the fp32 graph on the model's Parameters
        flat, spec = flat_output_graph(base)
        return flat, (lambda f: (lambda **kw: rebuild(f(**kw), spec)))

    def compiled(gm, wrap, **opts):
        torch._dynamo.reset()
        return wrap(torch.compile(gm, backend="inductor", options={**INDUCTOR_OPTIONS, **opts}))

    flat, wrap = graph()
    ref = step(wrap(flat), params, batch, None)
    rows = [measure("eager fp32 graph", wrap(flat), params, batch, ref)]
    flat, wrap = graph()
    rows.append(measure("(a) fp32 compiled", compiled(flat, wrap), params, batch, ref))
    flat, wrap = graph()
    rows.append(measure("(b) bf16 casts before matmuls, default partitioner",
                        compiled(casts_before_matmuls(flat), wrap), params, batch, ref))
    knobs = {k: False for k in ("ban_recompute_materialized_backward", "ban_recompute_used_far_apart",
                                "ban_recompute_long_fusible_chains", "ban_recompute_not_in_allowlist")}
    flat, wrap = graph()
    fn = compiled(casts_before_matmuls(flat), wrap)
    rows.append(measure("(b) bf16 casts, ban_recompute_materialized_backward=False", fn, params, batch, ref,
                        ctx=lambda: torch._functorch.config.patch(ban_recompute_materialized_backward=False)))
    flat, wrap = graph()
    fn = compiled(casts_before_matmuls(flat), wrap)
    rows.append(measure("(b) bf16 casts, all ban_recompute_* (but reductions) False", fn, params, batch, ref,
                        ctx=lambda: torch._functorch.config.patch(**knobs)))
    for scaling in (True, None):
        quant = {"quant_type": "torch.float8_e5m2", "allowed_dtypes": "torch.float32", "size_in_mb": 0.0,
                 "exclude_primals": True, **({"use_scaling": scaling} if scaling is not None else {})}
        flat, wrap = graph()
        fn = compiled(flat, wrap, post_grad_fusion_options={"activation_quantization_aten_pass": quant})
        rows.append(measure(f"(c) activation_quantization_aten_pass fp8_e5m2, use_scaling={scaling}",
                            fn, params, batch, ref))
    flat, wrap = graph()
    rows.append(measure("(d) Python saved_tensors_hooks (fp32->bf16) around compiled", compiled(flat, wrap),
                        params, batch, ref, ctx=python_hooks))
    rows.append(measure("(d) Python saved_tensors_hooks (fp32->bf16), eager graph", wrap(graph()[0]), params,
                        batch, ref, ctx=python_hooks))
    for saved in ("bf16", "fp8_e5m2"):
        for comp in (True, False):
            torch._dynamo.reset()
            mp = marked(model, base, saved, comp)
            rows.append(measure(f"(d) autoprec.applied.saved {saved}, {'compiled' if comp else 'eager'}",
                                mp, params, batch, ref))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "saved_activations.json"), "w") as f:
        json.dump({"torch": torch.__version__, "model": {"layers": args.layers, "hidden": args.hidden,
                   "batch": list(batch["input_ids"].shape)}, "machine": describe_machine(torch.device("cpu")),
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
