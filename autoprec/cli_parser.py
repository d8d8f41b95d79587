"""The ``autoprec`` command line's arguments: subcommands, options, and the argparse types that
validate counts and durations (argparse names the option and exits 2 on a bad value)."""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence

from autoprec.policy.compile_options import COMPILE_VARIANTS

__all__ = ["build_parser"]


#: Options whose value may start with a dash: a negative ``--max-memory`` such as ``-1GiB``, which
#: argparse would take for an option ("expected one argument") instead of handing it to the command,
#: whose message names the value and that it must be positive.
_DASH_VALUE_OPTIONS: tuple[str, ...] = ("--max-memory",)


class _Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` that passes a value starting with a dash and a digit or ``.``
    (``-1GiB``, ``-0.5x``) to an option of :data:`_DASH_VALUE_OPTIONS` before it, as
    ``--max-memory=-1GiB`` would; its subcommand parsers are of this class too."""

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        """``argparse.ArgumentParser.parse_known_args`` on ``args`` (default ``sys.argv[1:]``)
        with each ``OPTION -VALUE`` pair joined into ``OPTION=-VALUE`` (none after ``--``)."""
        rest = list(sys.argv[1:] if args is None else args)
        joined: list[str] = []
        while rest:
            tok = rest.pop(0)
            if tok == "--":
                joined += [tok, *rest]
                break
            if tok in _DASH_VALUE_OPTIONS and rest and re.match(r"-[0-9.]", rest[0]):
                tok = f"{tok}={rest.pop(0)}"
            joined.append(tok)
        return super().parse_known_args(joined, namespace)


def _int_at_least(low: int):
    """argparse type: an int ≥ ``low`` (argparse names the option and exits 2 otherwise)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be ≥ {low}, got {v}")
        return v
    return parse


def _positive_float(text: str) -> float:
    """argparse type: a finite float > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return v


def _add_strict_timing(p: argparse.ArgumentParser) -> None:
    """``--strict-timing`` (tune and bench): a busy machine is an error, not a warning."""
    p.add_argument("--strict-timing", action="store_true",
                   help="exit 2 instead of warning when the machine is busy (other processes use over half "
                        "a core, or a calibration matmul runs 1.5x slower): its timings are unreliable")


def _add_train(sub: argparse._SubParsersAction) -> None:
    """The ``train`` subcommand's arguments."""
    r = sub.add_parser("train", help="train with a policy")
    r.add_argument("model", help="model file defining build_model() and get_batch(step, device)")
    r.add_argument("--policy", required=True, help="policy JSON file (from autoprec tune)")
    r.add_argument("--steps", type=_int_at_least(1), default=50,
                   help="total optimizer steps of the run; a resumed run continues up to this step "
                        "(default 50)")
    _add_device(r)
    r.add_argument("--no-compile", action="store_true",
                   help="run the lowered graph eagerly, no torch.compile")
    r.add_argument("--log-every", type=_int_at_least(1), default=1, metavar="N",
                   help="print every N-th step (default 1)")
    r.add_argument("--checkpoint", default=None, metavar="PATH",
                   help="checkpoint file written at the end (and every --checkpoint-every steps)")
    r.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint if it exists (with --compare: the unfinished run "
                        "in --out-dir)")
    r.add_argument("--checkpoint-every", type=_int_at_least(0), default=0, metavar="N",
                   help="also save the checkpoint every N steps (default 0: only at the end); with "
                        "--compare, save the running configuration every N steps under --out-dir")
    r.add_argument("--seed", type=int, default=0, metavar="N",
                   help="seed of torch's and Python's global generators before step 0 (dropout, sampling), "
                        "so the same command trains the same numbers; a resumed run keeps its checkpoint's "
                        "state (default 0)")
    r.add_argument("--log", default=None, metavar="JSONL", help="append per-step monitor records here")
    r.add_argument("--max-grad-norm", type=_positive_float, default=None,
                   help="clip unscaled gradients to this norm")
    r.add_argument("--force", action="store_true",
                   help="train with a policy none of whose rules matches a node of this model (a policy of "
                        "another model), which is refused otherwise")
    r.add_argument("--compare", default=None, metavar="LIST",
                   help="convergence check: also train these baselines (fp32,autocast) from the same "
                        "weights on the same batches and compare the loss curves")
    r.add_argument("--out-dir", default="convergence",
                   help="where --compare writes JSON + PNG (default convergence)")
    r.add_argument("--nproc", type=_int_at_least(1), default=1, metavar="N",
                   help="train on N ranks of this machine under DDP (torchrun; gloo on CPU, NCCL on CUDA): "
                        "rank r at step k trains on get_batch(k*N + r); rank 0 logs and "
                        "checkpoints (default 1)")


def _add_memory_options(t: argparse.ArgumentParser) -> None:
    """``tune``'s ``--max-memory`` and ``--global-batch``."""
    t.add_argument("--max-memory", default=None, metavar="M",
                   help="memory budget for the policy's peak bytes: 'auto' (torch.autocast's, measured in "
                        "this run), '0.8x' (of FP32 eager's), '90%%' (of the device's memory) or bytes "
                        "('300MiB', '2GiB'); compiled policies over it save activations in bf16 or recompute "
                        "them in backward (default: none; with --global-batch on CUDA, 90%% of the device's)")
    t.add_argument("--global-batch", type=_int_at_least(1), default=None, metavar="N",
                   help="examples per optimizer step (the model file's batch unit): search the micro-batch "
                        "dividing it with the policy, within --max-memory, and write it with its gradient "
                        "accumulation (default: the model file's batch, no search)")


def _add_device(p: argparse.ArgumentParser) -> None:
    """``--device`` of ``tune``, ``train`` and ``bench`` (:func:`autoprec.device.resolve_device`)."""
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (default auto: cuda where available)")


def _add_bench_batch_options(b: argparse.ArgumentParser) -> None:
    """``bench``'s ``--global-batch`` and ``--max-memory`` (a comparison at a global batch)."""
    b.add_argument("--global-batch", type=_int_at_least(1), default=None, metavar="N",
                   help="compare at a global batch of N examples: the policy at its micro-batch, fp32 + "
                        "torch.compile and torch.autocast + torch.compile each at the largest micro-batch "
                        "within --max-memory, tokens/s per optimizer step")
    b.add_argument("--max-memory", default=None, metavar="M",
                   help="with --global-batch: the memory budget per micro-step (bytes like '2GiB', '90%%' "
                        "of the device's memory, '0.8x' fp32 eager's peak or 'auto' torch.autocast eager's, "
                        "both at the model file's batch; default: none)")
    b.add_argument("--no-compile", action="store_true",
                   help="with --global-batch: every side eager (fp32, torch.autocast, the policy), no "
                        "torch.compile (a quick check; the baseline to beat is compiled)")


def _add_bench(sub: argparse._SubParsersAction) -> None:
    """The ``bench`` subcommand and its options."""
    b = sub.add_parser("bench", help="time a policy side by side with fp32, autocast and pure low precision")
    b.add_argument("model", help="model file defining build_model() and get_batch(step, device)")
    b.add_argument("--policy", required=True, help="policy JSON file")
    b.add_argument("--steps", type=_int_at_least(1), default=None,
                   help="timed steps per configuration, at least: the interleaved rounds go on until the "
                        "band is narrow (median reported; default 5)")
    b.add_argument("--warmup", type=_int_at_least(0), default=None,
                   help="untimed steps before timing (default 2)")
    _add_device(b)
    b.add_argument("--json", default=None, help="write the results as JSON here")
    b.add_argument("--md", default=None, help="write the markdown table here")
    b.add_argument("--configs", nargs="+", default=None,
                   help="subset of: fp32_eager fp32_compiled autocast_eager autocast_compiled pure_low_eager "
                        "pure_low_compiled policy_eager policy_compiled (default all; fp32_eager, the "
                        "reference, is always measured)")
    b.add_argument("--max-step-ratio", type=_positive_float, default=None,
                   help="stop timing a config after two steps over this multiple of fp32 eager's step (or "
                        "one over 4x that) and report its last step (default 10)")
    b.add_argument("--skip-slow", action="store_true",
                   help="skip low-precision baselines when the device's low-dtype matmul is more than "
                        "--max-step-ratio times slower than fp32 (CPUs that emulate bf16)")
    _add_strict_timing(b)
    b.add_argument("--force", action="store_true",
                   help="measure a policy none of whose rules matches a node of this model (a policy of "
                        "another model), which is refused otherwise")
    _add_bench_batch_options(b)
    b.add_argument("--nproc", type=_int_at_least(1), default=1, metavar="N",
                   help="measure on N ranks of this machine (torchrun; gloo on CPU, NCCL on CUDA) instead: "
                        "DDP and FSDP2, gradients reduced in fp32 and bf16; step time, grad_rel_l2 against "
                        "fp32 reduction and per-rank peak bytes beside the predicted ones (default 1)")


def build_parser() -> argparse.ArgumentParser:
    """The ``autoprec`` argument parser: one subcommand per command, numbers validated by type."""
    p = _Parser(prog="autoprec",
                description="Mixed-precision autotuner for PyTorch training.")
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("tune", help="search for the fastest policy within a drift budget")
    t.add_argument("model", help="model file defining build_model() and get_batch(step, device)")
    t.add_argument("--trials", type=_int_at_least(1), default=None,
                   help="finished trials the study should hold (default 20)")
    t.add_argument("--timeout", type=_positive_float, default=None, help="stop sampling after S seconds")
    t.add_argument("--max-drift", default="auto",
                   help="'auto' (not worse than torch.autocast's grad_rel_l2 beyond noise: a paired t-test "
                        "over 4 batches) or a number (a hard limit on the mean)")
    _add_memory_options(t)
    _add_device(t)
    t.add_argument("--out", default="policy.json", help="policy file to write (default policy.json)")
    t.add_argument("--storage", default=None, help="Optuna storage URL (default: SQLite beside --out)")
    t.add_argument("--study-name", default=None, help="Optuna study name (default: derived from the model)")
    t.add_argument("--no-compile", action="store_true", help="measure eagerly, no torch.compile")
    t.add_argument("--compile-variants", choices=COMPILE_VARIANTS, default="flat",
                   help="time the chosen policy against its compile variants, one compile each, and write "
                        "the fastest's compile options: 'flat' (default: one flat graph, where it compiled "
                        "repeated blocks as regions), 'all' (also fp32 intermediates, where it lowers "
                        "anything) or 'none'")
    t.add_argument("--dtypes", default="auto",
                   help="low dtypes to search: 'auto' (those with a kernel measured within 10%% of fp32's "
                        "time here, natively or as storage with fp32 compute; fp8: faster) or a list such "
                        "as bf16,fp16")
    t.add_argument("--seed", type=int, default=0, help="the Optuna sampler's seed (default 0)")
    t.add_argument("--traj-steps", type=_int_at_least(0), default=20,
                   help="optimizer steps of the traj_rel check on the chosen policy, when it lowers "
                        "anything (0: off)")
    t.add_argument("--finalists", type=_int_at_least(1), default=2,
                   help="fastest feasible trials re-measured compiled (a trial clearly slower than "
                        "the K-th so far stops its screening early)")
    _add_strict_timing(t)

    rp = sub.add_parser("report", help="write the report (Pareto front, trials table) of a study")
    rp.add_argument("--storage", required=True, help="Optuna storage URL, e.g. sqlite:///policy.optuna.db")
    rp.add_argument("--study-name", default=None,
                    help="study to report (default: the only study in the storage; the policy's "
                         "provenance.study names it)")
    rp.add_argument("--out", default="report", help="path stem of the files written (default: report)")

    _add_train(sub)

    s = sub.add_parser("show", help="summarise a policy file (and per-node dtypes with --model)")
    s.add_argument("policy", help="policy JSON file")
    s.add_argument("--model", default=None, help="model file: also print the dtype of each module's nodes")
    s.add_argument("--json", action="store_true", help="print the policy file's JSON instead of the summary")

    _add_bench(sub)
    return p
