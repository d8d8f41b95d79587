"""The search space: which kernel choices the device runs usefully, and Optuna parameters -> Policy.

Choices are kernels, not dtypes (:mod:`autoprec.search.probe`): ``"fp32"``, ``"bf16"`` (native),
``"bf16:fp32"`` (bf16 storage, fp32 compute), ``"fp16"``, ``"fp16:fp32"``, ``"fp8_e4m3"`` (fp8
matmul, fp32 storage). Only the kernels the probe kept are offered (docs/architecture.md#search):
a device without native bf16 still searches bf16 storage, computing in fp32.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

import optuna
import torch

from autoprec.dtypes import FP8_COMPUTE
from autoprec.nodekeys import block_of
from autoprec.nodemeta import read_meta
from autoprec.ops import classify
from autoprec.passes.attention import has_sdpa
from autoprec.policy import RULE_OP_CLASSES, Policy, Rule
from autoprec.search.groups import block_params, members
from autoprec.search.probe import KERNELS, kernel_fields

__all__ = ["ATTENTION_BASELINE", "SAVED_LEVERS", "SearchSpace", "BASELINES", "FP32_COMPUTE_BASELINE",
           "find_blocks", "has_attention", "outside_matmuls", "with_saved", "without_saved"]

#: The saved-activation dtypes of the memory lever, least drift first (docs/architecture.md#search):
#: a search parameter under ``tune --max-memory`` and the finalists' memory fit.
SAVED_LEVERS: tuple[str, ...] = ("bf16", "fp8_e5m2")


#: Baseline parameter sets enqueued first (docs/architecture.md#data-flow): all fp32; the autocast
#: twin (matmuls low, sensitive fp32, the rest by type promotion: ``Policy.autocast``) and its
#: neighbours, one op class moved at a time: the rest placed by min-cut, all low except sensitive,
#: all low. ``{low}`` and ``{lowf}`` are the kernel of torch.autocast's dtype (``twin_dtype``, the
#: drift budget's baseline), else the fastest kept kernel (``{lowf}``: with low-precision storage;
#: no fp8, which is for matmuls only).
BASELINES: tuple[tuple[str, Mapping[str, str]], ...] = (
    ("fp32", {"matmul": "fp32", "sensitive": "fp32", "follow": "fp32"}),
    ("autocast-twin", {"matmul": "{low}", "sensitive": "fp32", "follow": "promote"}),
    ("autocast-equivalent", {"matmul": "{low}", "sensitive": "fp32", "follow": "auto"}),
    ("low-except-sensitive", {"matmul": "{low}", "sensitive": "fp32", "follow": "{lowf}"}),
    ("all-low", {"matmul": "{low}", "sensitive": "{lowf}", "follow": "{lowf}"}),
)
#: Queued besides :data:`BASELINES` when a ``":fp32"`` kernel is kept (``{c}``: the fastest one):
#: low-precision storage at fp32 speed, the memory point of devices without native bf16.
FP32_COMPUTE_BASELINE: tuple[str, Mapping[str, str]] = (
    "low-storage fp32-compute", {"matmul": "{c}", "sensitive": "fp32", "follow": "{c}"})


#: Queued after the baselines when the graph has SDPA nodes: the autocast twin with attention as
#: explicit GEMMs (``Policy.attention = "math"``), which native low-precision GEMMs can make faster
#: than the fused kernel (measured, per device, like every other choice).
ATTENTION_BASELINE: tuple[str, Mapping[str, str]] = ("autocast-twin, math attention", {"attention": "math"})

def find_blocks(gm: torch.fx.GraphModule) -> list[str]:
    """Repeated layer blocks of a captured graph, in graph order: the module path up to the first
    numeric component (``model.layers.3``, ``transformer.h.0``, ``encoder.block.1``;
    :func:`autoprec.nodekeys.block_of`)."""
    seen: dict[str, None] = {}
    for n in gm.graph.nodes:
        block = block_of(read_meta(n).module or "")
        if block is not None:
            seen.setdefault(f"{block[0]}.{block[1]}", None)
    return list(seen)


def has_attention(gm: torch.fx.GraphModule) -> bool:
    """Whether the captured graph runs ``aten.scaled_dot_product_attention`` (then the search
    offers ``attention`` in ``fused`` / ``math``; :func:`autoprec.passes.attention.has_sdpa`)."""
    return has_sdpa(gm)


def outside_matmuls(gm: torch.fx.GraphModule, blocks: list[str]) -> list[str]:
    """Keys of ``matmul`` nodes outside every block (e.g. ``lm_head/linear#0``): few, large and
    often the most sensitive nodes, so each gets its own search parameter."""
    out = []
    for n in gm.graph.nodes:
        meta = read_meta(n)
        if n.op != "call_function" or classify(n) != "matmul":
            continue
        mod = meta.module or ""
        if not any(mod == b or mod.startswith(b + ".") for b in blocks):
            out.append(meta.key)
    return out


class SearchSpace:
    """Hierarchical kernel choices over the kernels the device runs usefully.

    Levels (the number of parameters does not grow with depth beyond
    :data:`autoprec.search.groups.MAX_BLOCK_PARAMS` per block container):

    1. Op class: ``matmul`` in fp32 + the kept kernels; ``sensitive`` in fp32 + the kept kernels
       with low-precision storage (no fp8: matmuls only); ``follow`` in ``auto`` (min-cut
       placement), ``promote`` (type promotion, as torch.autocast) + those.
    2. Per layer block, or per run of neighbouring blocks in a deep model (:mod:`autoprec.search.groups`):
       ``block:<path>`` / ``blocks:<container>.<a>-<b>`` in ``inherit`` or a kernel for the matmuls
       of that block (those blocks).
    3. Per node: ``node:<key>`` for matmul nodes outside the blocks (LM head, projections) in
       ``inherit`` or a kernel.

    Besides: ``attention`` in ``fused`` / ``math`` (``Policy.attention``) when the graph has SDPA
    nodes and a low kernel is kept; ``saved`` under a memory budget.

    Levels 2–3 exist only when a low kernel is kept (otherwise every choice is fp32).

    Args:
        low_kernels: Kept kernel choices (:data:`autoprec.search.probe.KERNELS`), fastest first
            (:meth:`autoprec.search.probe.KernelProbe.low_kernels`); a bare dtype name is its native kernel.
        blocks: Block module paths (:func:`find_blocks`).
        nodes: Node keys with their own parameter (:func:`outside_matmuls`).
        saved: The memory lever's saved dtypes (:data:`SAVED_LEVERS`), or empty.
        attention: Whether to search ``attention`` (:func:`has_attention` on the graph).
        twin_dtype: torch.autocast's low dtype name (``"fp16"``, ``"bf16"``;
            :func:`autoprec.device.autocast_dtype`), or None. The baselines (:data:`BASELINES`) use
            its kernel: the native one when kept, else the fastest kept one storing it, else the
            fastest kept kernel. torch.autocast's drift sets the budget, so its twin must compute
            as it does: a bf16 twin of an fp16 autocast (CUDA's default, where bf16 kernels are as
            fast) has ~8x its drift and is never feasible.

    Attributes:
        low_kernels: As given, fastest first (``low_dtypes`` is the same list).
        dtypes: The matmul choices in a fixed order: ``fp32`` then :data:`KERNELS` order.
        float_choices: ``dtypes`` without fp8: the choices of ``sensitive`` and ``follow``.

    Raises:
        ValueError: an unknown kernel choice (:func:`autoprec.search.probe.kernel_fields`).
    """

    def __init__(self, low_kernels: list[str], blocks: list[str] = (), nodes: list[str] = (),
                 saved: Sequence[str] = (), attention: bool = False, twin_dtype: str | None = None) -> None:
        for k in low_kernels:
            kernel_fields(k)
        self.low_kernels = list(low_kernels)
        self.twin_dtype = twin_dtype
        # The choices in a fixed order, not by speed: a resumed study must offer the same choices
        # even when a re-run's probe orders two kernels the other way (Optuna refuses otherwise).
        self.dtypes = ["fp32", *sorted(set(self.low_kernels), key=KERNELS.index)]
        self.float_choices = [c for c in self.dtypes if c != FP8_COMPUTE]
        self.blocks = list(blocks) if self.low_kernels else []
        #: The block parameters' names (:func:`autoprec.search.groups.block_params`).
        self.block_params = block_params(self.blocks)
        self.nodes = list(nodes) if self.low_kernels else []
        #: The memory lever's choices (``saved``: "none" or a saved dtype for every op class,
        #: :func:`with_saved`), searched only when given (``tune --max-memory``).
        self.saved = ["none", *saved] if saved else []
        #: ``Policy.attention``'s choices, searched when the graph has SDPA nodes and a low
        #: kernel is kept (in fp32 the explicit form is no faster than the fused kernel).
        self.attention = ["fused", "math"] if attention and self.low_kernels else []

    @property
    def low_dtypes(self) -> list[str]:
        """The kept kernel choices, fastest first (:attr:`low_kernels`; the name callers used
        when choices were dtypes)."""
        return self.low_kernels

    @property
    def n_params(self) -> int:
        """Number of free parameters."""
        return 3 + len(self.block_params) + len(self.nodes) + bool(self.saved) + bool(self.attention)

    def region_params(self) -> list[str]:
        """The parameters that lower one region each (a block, a run of blocks, an outside
        matmul node), in graph order: what the sensitivity pass measures one at a time."""
        return [*self.block_params, *(f"node:{k}" for k in self.nodes)]

    def suggest(self, trial: optuna.Trial) -> dict[str, str]:
        """Sample one parameter set."""
        p = {
            "matmul": trial.suggest_categorical("matmul", self.dtypes),
            "sensitive": trial.suggest_categorical("sensitive", self.float_choices),
            "follow": trial.suggest_categorical("follow", ["auto", "promote", *self.float_choices]),
        }
        for b in self.block_params:
            p[b] = trial.suggest_categorical(b, ["inherit", *self.dtypes])
        for k in self.nodes:
            p[f"node:{k}"] = trial.suggest_categorical(f"node:{k}", ["inherit", *self.dtypes])
        if self.saved:
            p["saved"] = trial.suggest_categorical("saved", self.saved)
        if self.attention:
            p["attention"] = trial.suggest_categorical("attention", self.attention)
        return p

    def baselines(self) -> list[tuple[str, dict[str, str]]]:
        """Baseline parameter sets (:data:`BASELINES`, then :data:`FP32_COMPUTE_BASELINE` when a
        ``":fp32"`` kernel is kept, then the twin with :data:`ATTENTION_BASELINE` when attention is
        searched) with every block/node parameter ``inherit`` and fused attention; one needing a
        low-storage kernel when only fp8 is kept, or equal to an earlier one, is left out."""
        rest = dict.fromkeys(self.region_params(), "inherit") | (
            {"saved": "none"} if self.saved else {}) | ({"attention": "fused"} if self.attention else {})
        if not self.low_kernels:
            return [(BASELINES[0][0], dict(BASELINES[0][1]) | ({"saved": "none"} if self.saved else {}))]
        floats = [k for k in self.low_kernels if k != FP8_COMPUTE]
        low = self._twin_kernel()
        fill = {"low": low or self.low_kernels[0], "lowf": low or (floats[0] if floats else None),
                "c": next((k for k in floats if k.endswith(":fp32")), None)}
        out: list[tuple[str, dict[str, str]]] = []
        for name, p in (*BASELINES, FP32_COMPUTE_BASELINE):
            if any(fill[m] is None for v in p.values() for m in re.findall(r"\{(\w+)\}", v)):
                continue
            params = {k: v.format(**fill) for k, v in p.items()} | rest
            if all(params != q for _n, q in out):
                out.append((name, params))
        twin = next((p for name, p in out if name == "autocast-twin"), None)
        if self.attention and twin is not None:
            out.append((ATTENTION_BASELINE[0], twin | ATTENTION_BASELINE[1]))
        return out

    def _twin_kernel(self) -> str | None:
        """The kept kernel of :attr:`twin_dtype` (native first, then by speed), or None."""
        same = [k for k in self.low_kernels if self.twin_dtype and kernel_fields(k)[0] == self.twin_dtype]
        return self.twin_dtype if self.twin_dtype in same else next(iter(same), None)

    def twin(self) -> dict[str, str] | None:
        """The autocast twin's parameter set (``Policy.autocast`` at torch.autocast's dtype's kernel,
        else the fastest kept one), or None when no low kernel is kept."""
        return self._baseline("autocast-twin")

    def attention_twin(self) -> dict[str, str] | None:
        """The twin with math attention (:data:`ATTENTION_BASELINE`), or None when attention is
        not searched (no SDPA in the graph, or no low kernel kept)."""
        return self._baseline(ATTENTION_BASELINE[0])

    def _baseline(self, name: str) -> dict[str, str] | None:
        return next((p for n, p in self.baselines() if n == name), None)

    @staticmethod
    def to_policy(params: Mapping[str, str]) -> Policy:
        """Build the policy a parameter set stands for (later rules override earlier ones;
        node rules win, docs/architecture.md#policy-file). A kernel choice becomes a rule's
        ``dtype`` and ``compute`` (:func:`autoprec.search.probe.kernel_fields`): ``"bf16:fp32"``
        -> ``Rule(dtype="bf16", compute="fp32")``; the ``matmul`` choice is the default dtype's
        storage plus, when it is not a native kernel of a storage dtype, a ``matmul`` rule.

        Raises:
            ValueError: an unknown kernel choice.
        """
        def rule(choice: str, **selector: str) -> Rule:
            dtype, compute = kernel_fields(choice)
            return Rule(dtype=dtype, compute=compute, **selector)

        mm_dtype, mm_compute = kernel_fields(params["matmul"])
        rules = [rule(params["matmul"], op_class="matmul")] if mm_compute or mm_dtype == FP8_COMPUTE else []
        rules.append(rule(params["sensitive"], op_class="sensitive"))
        if params["follow"] not in ("auto", "promote"):
            rules.append(rule(params["follow"], op_class="follow"))
        for name, value in params.items():
            if value == "inherit" or name in ("saved", "attention"):
                continue
            if name.startswith(("block:", "blocks:")):
                rules += [rule(value, module=f"{b}.*", op_class="matmul") for b in members(name)]
            elif name.startswith("node:"):
                rules.append(rule(value, node=name[len("node:"):]))
        default = "fp32" if mm_dtype == FP8_COMPUTE else mm_dtype
        pol = Policy(default_dtype=default, rules=tuple(rules),
                     follow_placement="promote" if params["follow"] == "promote" else "mincut",
                     attention=params.get("attention", "fused"))
        return pol if params.get("saved", "none") == "none" else with_saved(pol, params["saved"])


def without_saved(policy: Policy) -> Policy:
    """``policy`` without the rules :func:`with_saved` appends (op-class rules that set only
    ``saved``): the policy before its saved-activation memory lever."""
    lever = lambda r: (r.op_class is not None and r.saved is not None and r.node is None  # noqa: E731
                       and r.module is None and r.dtype is None and r.compute is None)
    return dataclasses.replace(policy, rules=tuple(r for r in policy.rules if not lever(r)))


def with_saved(policy: Policy, dtype: str) -> Policy:
    """``policy`` with every float node's output saved for backward as ``dtype`` (one ``saved``
    rule per op class, appended, so node rules that set ``saved`` still win); nodes already
    stored in ``dtype`` are unchanged (``assign_dtypes`` records ``saved`` only where it differs)."""
    extra = tuple(Rule(op_class=c, saved=dtype) for c in RULE_OP_CLASSES)
    return dataclasses.replace(policy, rules=policy.rules + extra)
