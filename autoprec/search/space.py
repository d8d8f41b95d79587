"""The search space: which dtypes the device runs usefully, and Optuna parameters -> Policy.

Candidates are filtered by measurement, never by a device table: :func:`probe_dtypes` times a
matmul in every dtype on the target device; a dtype that fails to run, or whose matmul is not
faster than fp32 (e.g. fp16 on a CPU without native fp16 arithmetic, measured ~100x slower),
is dropped from the space with the measured reason.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass

import optuna
import torch

from autoprec.dtypes import LOW_DTYPES, to_torch
from autoprec.policy import Policy, Rule

__all__ = ["DtypeProbe", "probe_dtypes", "SearchSpace", "BASELINES"]


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


def _time_matmul(dtype: torch.dtype, device: torch.device, n: int, reps: int, budget_s: float) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    times = []
    start = time.perf_counter()
    for _ in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        (a @ b).sum().item()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return statistics.median(times[1:] if len(times) > 1 else times)


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
    base = _time_matmul(torch.float32, device, n, reps, budget_s)
    out = {"fp32": DtypeProbe("fp32", base, 1.0, True)}
    for name in LOW_DTYPES:
        try:
            s = _time_matmul(to_torch(name), device, n, reps, budget_s)
        except Exception as e:  # dtype not supported by this device/build
            out[name] = DtypeProbe(name, float("inf"), 0.0, False, f"matmul failed: {type(e).__name__}: {e}")
            continue
        sp = base / s
        ok = sp >= min_speedup
        why = "" if ok else f"matmul measured {1 / sp:.1f}x slower than fp32" if sp < 1 else (
            f"matmul only {sp:.2f}x faster than fp32 (< {min_speedup})")
        out[name] = DtypeProbe(name, s, sp, ok, why)
    return out


#: Baseline parameter sets enqueued first (DESIGN §1): all fp32, autocast-equivalent
#: (matmuls low, sensitive fp32, the rest placed), all low except sensitive, all low.
BASELINES: tuple[tuple[str, Mapping[str, str]], ...] = (
    ("fp32", {"matmul": "fp32", "sensitive": "fp32", "follow": "fp32"}),
    ("autocast-equivalent", {"matmul": "{low}", "sensitive": "fp32", "follow": "auto"}),
    ("low-except-sensitive", {"matmul": "{low}", "sensitive": "fp32", "follow": "{low}"}),
    ("all-low", {"matmul": "{low}", "sensitive": "{low}", "follow": "{low}"}),
)


class SearchSpace:
    """Per-op-class dtype choices over the dtypes the device runs usefully.

    Parameters (Optuna categorical): ``matmul`` and ``sensitive`` in ``fp32`` + usable low
    dtypes; ``follow`` in ``auto`` (min-cut placement), ``fp32`` + usable low dtypes.

    Args:
        low_dtypes: Usable low dtypes, fastest first (from :func:`probe_dtypes`).
    """

    def __init__(self, low_dtypes: list[str]) -> None:
        self.low_dtypes = list(low_dtypes)
        self.dtypes = ["fp32", *self.low_dtypes]

    def suggest(self, trial: optuna.Trial) -> dict[str, str]:
        """Sample one parameter set."""
        return {
            "matmul": trial.suggest_categorical("matmul", self.dtypes),
            "sensitive": trial.suggest_categorical("sensitive", self.dtypes),
            "follow": trial.suggest_categorical("follow", ["auto", *self.dtypes]),
        }

    def baselines(self) -> list[tuple[str, dict[str, str]]]:
        """Baseline parameter sets with ``{low}`` filled in by the fastest usable low dtype."""
        if not self.low_dtypes:
            return [(BASELINES[0][0], dict(BASELINES[0][1]))]
        low = self.low_dtypes[0]
        return [(name, {k: v.format(low=low) for k, v in p.items()}) for name, p in BASELINES]

    @staticmethod
    def to_policy(params: Mapping[str, str]) -> Policy:
        """Build the policy a parameter set stands for.

        Raises:
            PolicyError: an invalid combination (cannot happen for sampled parameters).
        """
        rules = [Rule(op_class="sensitive", dtype=params["sensitive"])]
        if params["follow"] != "auto":
            rules.append(Rule(op_class="follow", dtype=params["follow"]))
        return Policy(default_dtype=params["matmul"], rules=tuple(rules))
