"""Command line: ``autoprec tune | train | show | bench | report`` (docs/architecture.md#data-flow).

Exit codes: 0 success; 2 bad input (model file, policy file, arguments, output paths, or
budgets no policy meets) with one message that names the file and the field or entry point at
fault, nothing written; 1 other failures (e.g. training that stops with a ``LossScaleError``);
130 interrupted (Ctrl-C): finished trials stay in the study.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

from autoprec.cli_parser import build_parser
from autoprec.cli_paths import (
    BENCH_MD_MARK,
    Output,
    bench_json,
    bench_table,
    jsonl_log,
    make_parents,
    output_paths,
)
from autoprec.errors import AutoprecError

__all__ = ["main"]


def _validate_model(path: str, device: str = "auto") -> tuple:
    """Load the model file and run each entry point once (one forward pass), so a bad file fails
    with a :class:`ModelSpecError` naming it before anything is written; ``(spec, model)``."""
    from autoprec.device import resolve_device
    from autoprec.modelspec import load_model_spec, validate_spec

    spec = load_model_spec(path)
    try:
        dev = resolve_device(device)
    except ValueError as e:
        raise AutoprecError(f"--device: {e}") from None
    return spec, validate_spec(spec, dev)[0]


def _cmd_tune(a: argparse.Namespace) -> int:
    from autoprec.search.budgets import check_memory_floor, parse_max_memory
    from autoprec.search.storage import check_sqlite_file, check_storage_url, default_storage, sqlite_path

    memory = parse_max_memory(a.max_memory)  # a bad value fails before the model is built
    from autoprec.policy import Policy

    Policy.check_replaceable(a.out, "--out")  # not the user's model or config
    if a.storage is not None:
        check_storage_url(a.storage)
    spec, model = _validate_model(a.model, a.device)
    check_memory_floor(memory, model, spec.make_optimizer)  # bytes below the fp32 state: before capture
    del model
    db = sqlite_path(a.storage)
    if a.storage is None:  # the default study database sits beside --out
        check_sqlite_file("--out", sqlite_path(default_storage(a.out)))
    elif db is not None:
        check_sqlite_file("--storage", db)
    with output_paths(("--out", a.out, "policy.json"),  # a new database file is written, an old one opened
                      ("--storage", db if db is not None and not os.path.isfile(db) else None, "study.db")):
        return _tune(a)


def _tune(a: argparse.Namespace) -> int:
    from autoprec._torch_compat import compile_cache_counts
    from autoprec.applied.compile import cache_report
    from autoprec.search.report import baseline_own_ratio, baseline_speed, format_table
    from autoprec.search.study import tune

    caches = compile_cache_counts()
    res = tune(a.model, trials=a.trials, timeout=a.timeout, max_drift=a.max_drift, device=a.device,
               storage=a.storage, study_name=a.study_name, compile=not a.no_compile, out=a.out,
               seed=a.seed, dtypes=a.dtypes, traj_steps=a.traj_steps, finalists=a.finalists,
               max_memory=a.max_memory, strict_timing=a.strict_timing, compile_variants=a.compile_variants,
               global_batch=a.global_batch)
    print()
    print(format_table(res.table))
    m = res.policy.measured
    print(f"\nchosen: {res.policy.summary()}")
    from autoprec.search.contest import AUTOCAST_COMPILED, AUTOCAST_EAGER

    bar = AUTOCAST_COMPILED if not a.no_compile else AUTOCAST_EAGER
    best = res.policy.provenance.get("baseline")
    speeds = [f"{m[k]:.2f}x {n}" for k, n in (("speedup_vs_autocast", bar), ("speedup_vs_fp32", "fp32 eager"))
              if k in m and k != baseline_own_ratio(m, best)]
    if best is not None and "speedup_vs_baseline" in m:  # first: the choice must not fall below it
        speeds.insert(0, baseline_speed(m, best))
    rule = res.budget.describe()
    at_global = "micro_batch_tokens_per_s" in m  # then these are the contest's, at the file's batch
    print(("the contest's choice at the model file's batch" if at_global else f"wrote {a.out}")
          + f": {m['tokens_per_s']:.0f} tokens/s, " + ", ".join(speeds)
          + f", grad_rel_l2 {m['grad_rel_l2']:.3g} (budget: {rule}), peak {m['peak_bytes'] / 2**20:.1f} MiB"
          + (f" (budget {m['memory_budget_bytes'] / 2**20:.1f} MiB)"
             if "memory_budget_bytes" in m and not at_global else ""))
    if at_global:
        from autoprec.search.report import global_batch_summary

        print(f"wrote {a.out}: {global_batch_summary(res.policy)}")
    print("time: " + ", ".join(f"{k} {v:.0f}s" for k, v in res.timings.items()))
    print(cache_report(caches))
    return 0


def _policy_batching(path: str):
    """The ``batching`` of the policy file at ``path``, or None (none, or a file ``bench`` refuses
    later with its own message)."""
    from autoprec.errors import PolicyError
    from autoprec.policy import Policy

    try:
        return Policy.load(path).batching
    except PolicyError:
        return None


def _bench_batching_note(a: argparse.Namespace, nproc: bool) -> None:
    """``bench``'s note (stderr) on a policy whose ``batching`` (``tune --global-batch``) it does not run,
    the one home of its text: in one process without ``--global-batch`` it runs the model file's batch,
    and under ``--nproc`` (``nproc``) each rank does, without accumulation. Printed once: by the
    process the user started (not by the ranks ``--nproc`` starts; rank 0 of the user's own torchrun)."""
    from autoprec.commands.launch import launched_rank
    from autoprec.distributed.ranks import ranks_from_env

    if a.global_batch is not None or launched_rank() or not ranks_from_env().lead:
        return
    if (batching := _policy_batching(a.policy)) is None:
        return
    g = batching.global_batch
    runs = (f"bench --nproc runs the model file's batch on each rank, without accumulation (bench "
            f"--global-batch {g}, in one process, compares at the policy's)" if nproc else
            f"this bench runs the model file's batch (pass --global-batch {g} to compare at the policy's)")
    print(f"autoprec bench: note: {a.policy} trains at {batching.describe()}; {runs}", file=sys.stderr)


def _naming_policy(policy_path: str):
    """Context manager: a :class:`PassError` (the policy does not fit this model) is re-raised with
    the policy file's path in front."""
    import contextlib

    from autoprec.errors import PassError

    @contextlib.contextmanager
    def ctx():
        try:
            yield
        except PassError as e:
            if str(e).startswith(f"{policy_path}:"):
                raise
            raise PassError(f"{policy_path}: {e}") from e

    return ctx()


def _cmd_train(a: argparse.Namespace) -> int:
    if a.compare is not None and a.checkpoint is not None:
        print("autoprec train: error: --checkpoint does not apply to --compare, which keeps its progress "
              "in --out-dir (use --checkpoint-every N and --resume)", file=sys.stderr)
        return 2
    if a.compare is not None and a.log is not None:  # it wrote nothing, without a word
        print("autoprec train: error: --log does not apply to --compare, which writes every configuration's "
              "losses to --out-dir's convergence.json", file=sys.stderr)
        return 2
    if a.resume and a.checkpoint is None and a.compare is None:
        print("autoprec train: error: --resume needs --checkpoint PATH", file=sys.stderr)
        return 2
    if a.checkpoint_every and a.checkpoint is None and a.compare is None:  # it saved nothing, silently
        print("autoprec train: error: --checkpoint-every needs --checkpoint PATH (where to save)",
              file=sys.stderr)
        return 2
    out_dir = a.out_dir if a.compare is not None else None
    out_dir = os.path.join(out_dir, "convergence.json") if out_dir else out_dir  # '' is refused
    with output_paths(("--checkpoint", a.checkpoint, "ckpt.pt"),  # before the steps, not at the first save
                      Output("--log", a.log, "train.jsonl", jsonl_log, "a JSONL log (a JSON object a line)"),
                      ("--out-dir", out_dir, "convergence.json")):
        return _train(a)


def _train(a: argparse.Namespace) -> int:
    """``autoprec train`` once its options are checked and its output paths are writable."""
    from autoprec.commands.train import check_checkpoint, report, train
    from autoprec.distributed.ranks import ranks_from_env
    from autoprec.policy import Policy

    policy = Policy.load(a.policy)  # a bad policy file fails before the model is built
    if a.compare is None:  # a checkpoint to refuse, or a finished run: before the model is built
        with _naming_policy(a.policy):
            ranks = ranks_from_env()  # --nproc N: the launcher's N ranks (a torchrun rank: its job's)
            done = check_checkpoint(a.checkpoint, a.resume, a.policy, policy, a.steps, quiet=not ranks.lead,
                                    world=a.nproc if a.nproc > 1 else ranks.world)
        if done is not None:
            return report(done)
    _validate_model(a.model, a.device)
    if a.nproc > 1:
        if a.compare is not None:
            print("autoprec train: error: --compare runs in one process; drop --nproc", file=sys.stderr)
            return 2
        from autoprec.commands.launch import launch

        return launch(a.cmd, a.argv, a.nproc)
    if a.compare is not None:
        with _naming_policy(a.policy):
            return _cmd_compare(a)
    with _naming_policy(a.policy):
        res = train(a.model, a.policy, steps=a.steps, device=a.device, compile=not a.no_compile,
                    log_every=a.log_every, checkpoint=a.checkpoint, resume=a.resume,
                    checkpoint_every=a.checkpoint_every, log_path=a.log, max_grad_norm=a.max_grad_norm,
                    force=a.force, seed=a.seed)
    return report(res)


def _cmd_compare(a: argparse.Namespace) -> int:
    """``autoprec train --compare fp32,autocast``: convergence check against the baselines."""
    from autoprec.commands.compare import BASELINES, compare, summary_table

    names = [n.strip() for n in a.compare.split(",") if n.strip()]
    bad = [n for n in names if n not in BASELINES]
    if bad:
        print(f"autoprec train: error: --compare: unknown baseline {bad[0]!r}; valid: {', '.join(BASELINES)}",
              file=sys.stderr)
        return 2
    res = compare(a.model, a.policy, a.steps, baselines=names, device=a.device, compile=not a.no_compile,
                  out_dir=a.out_dir, log_every=a.log_every, checkpoint_every=a.checkpoint_every,
                  resume=a.resume, seed=a.seed, max_grad_norm=a.max_grad_norm)
    print(f"\n{summary_table(res)}")
    print(f"wrote {a.out_dir}/convergence.json and {a.out_dir}/convergence.png")
    return 0 if all(math.isfinite(x) for x in res.curves["policy"]) else 1


def _cmd_report(a: argparse.Namespace) -> int:
    from autoprec.search.report import report_study
    from autoprec.search.storage import load_existing_study

    study = load_existing_study(a.storage, a.study_name)
    make_parents(a.out)
    for p in report_study(study, a.out):
        print(f"wrote {p}")
    return 0


def _cmd_show(a: argparse.Namespace) -> int:
    """``autoprec show P.json [--model M] [--json]``: the policy's summary (with ``--model``, plus
    the dtypes per module and the nodes each rule matches); ``--json``: the file's JSON."""
    from autoprec.policy import Policy
    from autoprec.search.report import policy_summary

    pol = Policy.load(a.policy)
    if a.json:
        print(pol.to_json())
        return 0
    if note := pol.edited_note(a.policy):
        print(f"autoprec show: note: {note}", file=sys.stderr)
    if a.model:
        from autoprec.search.report import show_nodes

        _validate_model(a.model, "cpu")
        with _naming_policy(a.policy):
            nodes = show_nodes(pol, a.model)
        print(policy_summary(pol, a.policy, rules=False))
        print(nodes)
    else:
        print(policy_summary(pol, a.policy))
    return 0


def _cmd_bench(a: argparse.Namespace) -> int:
    # before the timing; an existing file only when bench wrote it (--json model.py replaced the model)
    with output_paths(Output("--json", a.json, "bench.json", bench_json, "a bench JSON file"),
                      Output("--md", a.md, "bench.md", bench_table, f"a bench table ({BENCH_MD_MARK})")):
        return _bench(a)


def _bench(a: argparse.Namespace) -> int:
    """``autoprec bench`` once its output paths are writable."""
    from autoprec.commands.bench import format_bench_table, run_bench

    _validate_model(a.model, a.device)
    from autoprec.distributed.ranks import ranks_from_env

    if a.nproc > 1 or ranks_from_env().world > 1:  # the launcher, or one of its ranks (torchrun)
        return _cmd_bench_dist(a)
    if a.max_memory is not None and a.global_batch is None:
        print("autoprec bench: error: --max-memory needs --global-batch N (the budget picks each side's "
              "micro-batch)", file=sys.stderr)
        return 2
    if a.no_compile and a.global_batch is None:
        print("autoprec bench: error: --no-compile goes with --global-batch N; without it pick eager rows "
              "with --configs (fp32_eager policy_eager ...)", file=sys.stderr)
        return 2
    _bench_batching_note(a, nproc=False)
    if a.global_batch is not None:
        from autoprec.commands.bench_batch import format_batch_table, run_batch_bench

        if _refuse_unread(a, "--global-batch", "each side's micro-batch and timing follow tune's micro-batch "
                          "search", ("configs", "steps", "warmup", "skip_slow")):
            return 2
        with _naming_policy(a.policy):
            res = run_batch_bench(a.model, a.policy, a.global_batch, a.max_memory, device=a.device,
                                  json_path=a.json, compile=not a.no_compile, strict_timing=a.strict_timing,
                                  force=a.force, **_given(a, "max_step_ratio"))
        table = format_batch_table(res)
        print("\n" + table)
        if a.md:
            _write_md(a.md, table)
        return 0
    try:
        with _naming_policy(a.policy):
            res = run_bench(a.model, a.policy, device=a.device, configs=a.configs, skip_slow=a.skip_slow,
                            json_path=a.json, strict_timing=a.strict_timing, force=a.force,
                            **_given(a, "steps", "warmup", "max_step_ratio"))
    except ValueError as e:
        print(f"autoprec bench: error: {e}", file=sys.stderr)
        return 2
    table = format_bench_table(res)
    print()
    print(table)
    if a.json:
        print(f"wrote {a.json}")
    if a.md:
        _write_md(a.md, table)
        print(f"wrote {a.md}")
    from autoprec.commands.bench_table import failed_rows

    if failed := failed_rows(res):  # a configuration that could not be measured: exit 1
        print("autoprec bench: error: " + "; ".join(f"{n} failed ({e})" for n, e in failed.items()),
              file=sys.stderr)
        return 1
    return 0


def _write_md(path: str, table: str) -> None:
    """Write ``bench --md``'s table to ``path`` atomically (a whole file or the one before), after
    :data:`~autoprec.cli_paths.BENCH_MD_MARK`, by which a rerun may replace it."""
    from autoprec._io import atomic_write

    atomic_write(path, lambda f: f.write(f"{BENCH_MD_MARK}\n{table}\n"))


def _given(a: argparse.Namespace, *names: str) -> dict[str, Any]:
    """The options among ``names`` given on the command line (parsed ``None`` when not), as keyword
    arguments: the function called keeps the one home of their defaults."""
    return {n: getattr(a, n) for n in names if getattr(a, n) is not None}


def _refuse_unread(a: argparse.Namespace, mode: str, why: str, names: tuple[str, ...]) -> bool:
    """Print ``bench``'s refusal of the options among ``names`` that were given but that ``mode``
    (``--global-batch``, ``--nproc``) does not read, and return True; False when none was given:
    an option accepted and ignored would let a user believe it applied."""
    given = [f"--{n.replace('_', '-')}" for n in names if getattr(a, n) not in (None, False)]
    if given:
        print(f"autoprec bench: error: {', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply "
              f"with {mode} ({why}): drop {'it' if len(given) == 1 else 'them'}", file=sys.stderr)
    return bool(given)


def _cmd_bench_dist(a: argparse.Namespace) -> int:
    """``autoprec bench --nproc N``: start N ranks (torchrun); on each rank, measure
    (autoprec.commands.bench_dist)."""
    if a.configs is not None:
        print("autoprec bench: error: --configs names one-process configurations; with --nproc the rows are "
              "DDP and FSDP2 with fp32 and bf16 gradient reduction (drop --configs)", file=sys.stderr)
        return 2
    given = [o for o, v in (("--global-batch", a.global_batch), ("--max-memory", a.max_memory))
             if v is not None]
    if given:  # else ignored: every rank runs the model file's batch
        print(f"autoprec bench: error: {' and '.join(given)}: a comparison at a global batch, in one "
              "process; with --nproc every rank runs the model file's batch (drop --nproc, or "
              f"{'them' if given[1:] else 'it'})", file=sys.stderr)
        return 2
    if _refuse_unread(a, "--nproc", "its rows are eager DDP and FSDP2 steps, without a load check or a slow-"
                      "step limit", ("strict_timing", "skip_slow", "max_step_ratio", "no_compile")):
        return 2
    _bench_batching_note(a, nproc=True)
    if a.nproc > 1:
        from autoprec.commands.launch import launch

        return launch(a.cmd, a.argv, a.nproc)

    from autoprec.commands.bench_dist import format_dist_table, run_bench_dist

    with _naming_policy(a.policy):
        res = run_bench_dist(a.model, a.policy, **_given(a, "steps", "warmup"), device=a.device,
                             json_path=a.json, force=a.force)
    if res is None:  # not rank 0
        return 0
    table = format_dist_table(res)
    print()
    print(table)
    if a.md:
        _write_md(a.md, table)
    for path in (a.json, a.md):
        if path:
            print(f"wrote {path}")
    return 0


_COMMANDS = {"tune": _cmd_tune, "train": _cmd_train, "show": _cmd_show, "report": _cmd_report,
             "bench": _cmd_bench}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``autoprec`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what train --nproc relaunches on each rank
    # autoprec's INFO lines (e.g. "capturing ... with use_cache=False") on stderr, for this call only
    log, handler = logging.getLogger("autoprec"), logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[autoprec] %(message)s"))
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings():  # the caller's filters and formatwarning come back on return
            # torch.export's pytree deprecation notice is noise for users of the CLI.
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            if not _speaks():  # under --nproc, rank 0 speaks for all: the others' copies are noise
                warnings.filterwarnings("ignore", message="autoprec: ")
                log.setLevel(logging.WARNING)
            return _main(args)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def _speaks() -> bool:
    """Whether this process prints autoprec's warnings and log lines: not a rank other than 0 that
    ``--nproc`` started (:func:`autoprec.commands.launch.launched_rank`)."""
    from autoprec.commands.launch import launched_rank

    return not launched_rank() or os.environ.get("RANK", "0") == "0"


def _main(args: argparse.Namespace) -> int:
    from autoprec._interrupt import catch_sigint, interrupted
    from autoprec.commands.launch import launched_rank, peer_left, record_rank_error
    from autoprec.errors import LossScaleError

    t0 = time.perf_counter()
    plain = warnings.formatwarning
    shown: set[str] = set()

    def formatwarning(message, category, filename, lineno, line=None):
        """autoprec's own warnings (about the user's files) read as CLI messages, no source line, each
        once per command (bench applies a policy once per row; the "once" filter would not do: the
        registry it keeps is cleared whenever filters change, as each capture's do); one about a
        rule of the policy names the policy file (``P.json: rules[2] ... matches no node``)."""
        text = str(message)
        if text.startswith("autoprec: "):
            if text in shown:
                return ""  # showwarning writes nothing
            shown.add(text)
            text = text[len("autoprec: "):]
            policy = getattr(args, "policy", None)  # train, bench, show
            if policy and text.startswith("policy rules["):
                text = f"{policy}: {text[len('policy '):]}"
            return f"autoprec {args.cmd}: warning: {text}\n"
        return plain(message, category, filename, lineno, line)

    warnings.formatwarning = formatwarning
    try:
        with catch_sigint():
            code = _COMMANDS[args.cmd](args)
    except Exception as e:
        if not interrupted():  # else: an error on the way out of an interrupt (reported below)
            if isinstance(e, AutoprecError):
                if not record_rank_error(e):  # under --nproc the launcher prints it, once
                    print(f"autoprec {args.cmd}: error: {e}", file=sys.stderr)
                return 1 if isinstance(e, LossScaleError) else 2
            if launched_rank() and peer_left(e) and record_rank_error(e, peer=True):
                return 1  # another rank failed and left: the launcher names it, not this echo
            raise
    except KeyboardInterrupt:
        pass
    else:
        if not interrupted():
            return code
        # Ctrl-C came but Python swallowed it (e.g. in a weakref callback) and the command ran on:
        # its files are complete (written atomically), but the user asked it to stop
    finally:
        warnings.formatwarning = plain
    kept = {"tune": "; finished trials are kept in the study (re-run the command to resume)",
            "train": ("; finished configurations (with --checkpoint-every, the running one's last "
                      "checkpoint) are kept under --out-dir's compare_state/: the same command with --resume "
                      "continues"
                      if getattr(args, "compare", None) else
                      "; with --checkpoint, --resume continues from the last checkpoint")}.get(args.cmd, "")
    if not launched_rank():  # under --nproc the launcher says it, once
        took = time.perf_counter() - t0
        print(f"autoprec {args.cmd}: interrupted after {took:.0f}s{kept}", file=sys.stderr)
    return 130


if __name__ == "__main__":
    sys.exit(main())
