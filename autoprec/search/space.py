"""The search space: which dtypes the device runs usefully, and Optuna parameters -> Policy.

Candidates are filtered by measurement, never by a device table: :func:`probe_dtypes` times a
matmul in every dtype on the target device; a dtype that fails to run, or whose matmul is not
faster than fp32 (e.g. fp16 on a CPU without native fp16 arithmetic, measured ~100x slower),
is dropped from the space with the measured reason.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import optuna
import torch

from autoprec.device import time_matmul
from autoprec.dtypes import LOW_DTYPES, to_torch
from autoprec.metrics import median
from autoprec.ops import classify
from autoprec.policy import Policy, Rule

__all__ = ["DtypeProbe", "probe_dtypes", "SearchSpace", "BASELINES", "find_blocks", "outside_matmuls"]


@dataclass(frozen=True)
class DtypeProbe:
    """Result of timing one dtype's matmul on the device.

    Attributes:
        dtype: Policy dtype name.
        seconds: Median seconds of one ``n×n @ n×n`` matmul (inf if it failed).
        speedup: fp32 seconds / this dtype's seconds (> 1 is faster than fp32).
        usable: Whether the search may choose this dtype.
        reason: Why not, if not usable.
    """

    dtype: str
    seconds: float
    speedup: float
    usable: bool
    reason: str = ""


def probe_dtypes(device: torch.device, n: int = 512, reps: int = 5, min_speedup: float = 1.1,
                 budget_s: float = 3.0) -> dict[str, DtypeProbe]:
    """Time a square matmul per dtype on ``device``; keep the low dtypes that beat fp32.

    Args:
        device: Target device.
        n: Matrix size (512: the hidden size of the bundled example; large enough to be
            compute-bound on a CPU core, small enough to take milliseconds).
        reps: Timed repetitions (median reported).
        min_speedup: A low dtype must be at least this much faster than fp32 to be searched.
        budget_s: Wall-clock cap per dtype, so an emulated dtype costs at most this.

    Returns:
        ``{dtype name: DtypeProbe}`` for fp32 and every low dtype.
    """
    base = median(time_matmul(torch.float32, device, n, reps, budget_s))
    out = {"fp32": DtypeProbe("fp32", base, 1.0, True)}
    for name in LOW_DTYPES:
        try:
            s = median(time_matmul(to_torch(name), device, n, reps, budget_s))
        except Exception as e:  # dtype not supported by this device/build
            out[name] = DtypeProbe(name, float("inf"), 0.0, False, f"matmul failed: {type(e).__name__}: {e}")
            continue
        sp = base / s
        ok = sp >= min_speedup
        why = "" if ok else f"matmul measured {1 / sp:.1f}x slower than fp32" if sp < 1 else (
            f"matmul only {sp:.2f}x faster than fp32 (< {min_speedup})")
        out[name] = DtypeProbe(name, s, sp, ok, why)
    return out


#: Baseline parameter sets enqueued first (docs/architecture.md#data-flow): all fp32, autocast-equivalent
#: (matmuls low, sensitive fp32, the rest placed), all low except sensitive, all low.
BASELINES: tuple[tuple[str, Mapping[str, str]], ...] = (
    ("fp32", {"matmul": "fp32", "sensitive": "fp32", "follow": "fp32"}),
    ("autocast-equivalent", {"matmul": "{low}", "sensitive": "fp32", "follow": "auto"}),
    ("low-except-sensitive", {"matmul": "{low}", "sensitive": "fp32", "follow": "{low}"}),
    ("all-low", {"matmul": "{low}", "sensitive": "{low}", "follow": "{low}"}),
)


_BLOCK = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def find_blocks(gm: torch.fx.GraphModule) -> list[str]:
    """Repeated layer blocks of a captured graph, in graph order: the module path up to the first
    numeric component (``model.layers.3``, ``transformer.h.0``, ``encoder.block.1``)."""
    seen: dict[str, None] = {}
    for n in gm.graph.nodes:
        mod = n.meta.get("autoprec", {}).get("module", "")
        m = _BLOCK.match(mod)
        if m:
            seen.setdefault(m.group(1), None)
    return list(seen)


def outside_matmuls(gm: torch.fx.GraphModule, blocks: list[str]) -> list[str]:
    """Keys of ``matmul`` nodes outside every block (e.g. ``lm_head/linear#0``): few, large and
    often the most sensitive nodes, so each gets its own search parameter."""
    out = []
    for n in gm.graph.nodes:
        meta = n.meta.get("autoprec", {})
        if n.op != "call_function" or classify(n) != "matmul":
            continue
        mod = meta.get("module", "")
        if not any(mod == b or mod.startswith(b + ".") for b in blocks):
            out.append(meta["key"])
    return out


class SearchSpace:
    """Hierarchical dtype choices over the dtypes the device runs usefully.

    Levels (the number of parameters grows linearly with the number of layers):

    1. Op class: ``matmul`` and ``sensitive`` in fp32 + usable low dtypes; ``follow`` in
       ``auto`` (min-cut placement), fp32 + usable low dtypes.
    2. Per layer block: ``block:<path>`` in ``inherit`` or a dtype for that block's matmuls.
    3. Per node: ``node:<key>`` for matmul nodes outside the blocks (LM head, projections) in
       ``inherit`` or a dtype.

    Levels 2–3 exist only when a low dtype is usable (otherwise every choice is fp32).

    Args:
        low_dtypes: Usable low dtypes, fastest first (from :func:`probe_dtypes`).
        blocks: Block module paths (:func:`find_blocks`).
        nodes: Node keys with their own parameter (:func:`outside_matmuls`).
    """

    def __init__(self, low_dtypes: list[str], blocks: list[str] = (), nodes: list[str] = ()) -> None:
        self.low_dtypes = list(low_dtypes)
        # The choices in a fixed order, not by speed: a resumed study must offer the same choices
        # even when a re-run's probe orders two low dtypes the other way (Optuna refuses otherwise).
        self.dtypes = ["fp32", *sorted(self.low_dtypes, key=LOW_DTYPES.index)]
        self.blocks = list(blocks) if self.low_dtypes else []
        self.nodes = list(nodes) if self.low_dtypes else []

    @property
    def n_params(self) -> int:
        """Number of free parameters."""
        return 3 + len(self.blocks) + len(self.nodes)

    def suggest(self, trial: optuna.Trial) -> dict[str, str]:
        """Sample one parameter set."""
        p = {
            "matmul": trial.suggest_categorical("matmul", self.dtypes),
            "sensitive": trial.suggest_categorical("sensitive", self.dtypes),
            "follow": trial.suggest_categorical("follow", ["auto", *self.dtypes]),
        }
        for b in self.blocks:
            p[f"block:{b}"] = trial.suggest_categorical(f"block:{b}", ["inherit", *self.dtypes])
        for k in self.nodes:
            p[f"node:{k}"] = trial.suggest_categorical(f"node:{k}", ["inherit", *self.dtypes])
        return p

    def baselines(self) -> list[tuple[str, dict[str, str]]]:
        """Baseline parameter sets (:data:`BASELINES`) with ``{low}`` = the fastest usable low
        dtype and every block/node parameter ``inherit``."""
        rest = {f"block:{b}": "inherit" for b in self.blocks} | {f"node:{k}": "inherit" for k in self.nodes}
        if not self.low_dtypes:
            return [(BASELINES[0][0], dict(BASELINES[0][1]))]
        low = self.low_dtypes[0]
        return [(name, {k: v.format(low=low) for k, v in p.items()} | rest) for name, p in BASELINES]

    @staticmethod
    def to_policy(params: Mapping[str, str]) -> Policy:
        """Build the policy a parameter set stands for (later rules override earlier ones;
        node rules win, docs/architecture.md#policy-file)."""
        rules = [Rule(op_class="sensitive", dtype=params["sensitive"])]
        if params["follow"] != "auto":
            rules.append(Rule(op_class="follow", dtype=params["follow"]))
        for name, value in params.items():
            if value == "inherit":
                continue
            if name.startswith("block:"):
                rules.append(Rule(module=name[len("block:"):] + ".*", op_class="matmul", dtype=value))
            elif name.startswith("node:"):
                rules.append(Rule(node=name[len("node:"):], dtype=value))
        return Policy(default_dtype=params["matmul"], rules=tuple(rules))
