"""Command line: ``autoprec tune | train | show | bench | report`` (DESIGN §1).

Exit codes: 0 success; 2 bad input (model file, policy file, arguments, output paths, or
budgets no policy meets) with one message that names the file and the field or entry point at
fault, nothing written; 1 other failures (e.g. training that stops with a ``LossScaleError``);
130 interrupted (Ctrl-C): finished trials stay in the study.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autoprec", description="Mixed-precision autotuner for PyTorch training.")
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("tune", help="search for the fastest policy within a drift budget")
    t.add_argument("model", help="model file (build_model, get_batch; DESIGN §2)")
    t.add_argument("--trials", type=_int_at_least(1), default=None, help="finished trials the study should hold (default 20)")
    t.add_argument("--timeout", type=_positive_float, default=None, help="stop sampling after S seconds")
    t.add_argument("--max-drift", default="auto", help="'auto' (torch.autocast's grad_rel_l2) or a number")
    t.add_argument("--max-memory", default=None, metavar="M",
                   help="memory budget for the policy's peak bytes: 'auto' (torch.autocast's, measured in this "
                        "run), '0.8x' (of FP32 eager's), or bytes ('300MiB', '2GiB'); compiled policies over "
                        "it recompute activations in backward (default: none)")
    t.add_argument("--device", default="auto", help="auto | cpu | cuda")
    t.add_argument("--out", default="policy.json", help="policy file to write (default policy.json)")
    t.add_argument("--storage", default=None, help="Optuna storage URL (default: SQLite beside --out)")
    t.add_argument("--study-name", default=None, help="Optuna study name (default: derived from the model)")
    t.add_argument("--no-compile", action="store_true", help="measure eagerly, no torch.compile")
    t.add_argument("--dtypes", default="auto",
                   help="low dtypes to search: 'auto' (those the device runs faster than fp32, measured) "
                        "or a list such as bf16,fp16")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--traj-steps", type=_int_at_least(0), default=20,
                   help="optimizer steps of the traj_rel check on finalists that lower anything (0: off)")
    t.add_argument("--finalists", type=_int_at_least(1), default=2, help="fastest feasible trials re-measured compiled")

    rp = sub.add_parser("report", help="write the report (Pareto front, trials table) of a study")
    rp.add_argument("--storage", required=True, help="Optuna storage URL, e.g. sqlite:///policy.optuna.db")
    rp.add_argument("--study-name", default=None,
                    help="study to report (default: the only study in the storage; the policy's "
                         "provenance.study names it)")
    rp.add_argument("--out", default="report", help="path stem of the files written (default: report)")

    r = sub.add_parser("train", help="train with a policy")
    r.add_argument("model", help="model file (build_model, get_batch; DESIGN §2)")
    r.add_argument("--policy", required=True, help="policy JSON file (from autoprec tune)")
    r.add_argument("--steps", type=_int_at_least(1), default=50,
                   help="total optimizer steps of the run; a resumed run continues up to this step (default 50)")
    r.add_argument("--device", default="auto", help="auto | cpu | cuda")
    r.add_argument("--no-compile", action="store_true", help="run the lowered graph eagerly, no torch.compile")
    r.add_argument("--log-every", type=_int_at_least(1), default=1, metavar="N", help="print every N-th step (default 1)")
    r.add_argument("--checkpoint", default=None, metavar="PATH",
                   help="checkpoint file written at the end (and every --checkpoint-every steps)")
    r.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint if it exists (with --compare: the unfinished run in --out-dir)")
    r.add_argument("--checkpoint-every", type=_int_at_least(0), default=0, metavar="N",
                   help="also save the checkpoint every N steps (default 0: only at the end); with --compare, "
                        "save the running configuration every N steps under --out-dir")
    r.add_argument("--log", default=None, metavar="JSONL", help="append per-step monitor records here")
    r.add_argument("--max-grad-norm", type=_positive_float, default=None, help="clip unscaled gradients to this norm")
    r.add_argument("--compare", default=None, metavar="LIST",
                   help="convergence check: also train these baselines (fp32,autocast) from the same "
                        "weights on the same batches and compare the loss curves")
    r.add_argument("--out-dir", default="convergence", help="where --compare writes JSON + PNG")

    s = sub.add_parser("show", help="print a policy file (and per-node dtypes with --model)")
    s.add_argument("policy", help="policy JSON file")
    s.add_argument("--model", default=None, help="model file: also print the dtype of each module's nodes")

    b = sub.add_parser("bench", help="time a policy side by side with fp32, autocast and pure low precision")
    b.add_argument("model", help="model file (DESIGN §2)")
    b.add_argument("--policy", required=True, help="policy JSON file")
    b.add_argument("--steps", type=_int_at_least(1), default=5, help="timed steps per configuration (median reported)")
    b.add_argument("--warmup", type=_int_at_least(0), default=2, help="untimed steps before timing")
    b.add_argument("--device", default="auto", help="auto | cpu | cuda")
    b.add_argument("--json", default=None, help="write the results as JSON here")
    b.add_argument("--md", default=None, help="write the markdown table here")
    b.add_argument("--configs", nargs="+", default=None,
                   help="subset of: fp32_eager fp32_compiled autocast_eager autocast_compiled pure_low_eager "
                        "pure_low_compiled policy_eager policy_compiled (default all)")
    b.add_argument("--max-step-ratio", type=_positive_float, default=10.0,
                   help="time a config on one step only when its step exceeds this multiple of fp32 eager's")
    b.add_argument("--skip-slow", action="store_true",
                   help="skip low-precision baselines when the device's low-dtype matmul is more than "
                        "--max-step-ratio times slower than fp32 (CPUs that emulate bf16)")
    return p


def _validate_model(path: str, device: str = "auto") -> None:
    """Load the model file and run each entry point once (one forward pass), so a bad file fails
    with a :class:`ModelSpecError` naming it before anything is written."""
    from autoprec.modelspec import load_model_spec, validate_spec
    from autoprec.search.measure import resolve_device

    spec = load_model_spec(path)
    try:
        dev = resolve_device(device)
    except ValueError as e:
        raise AutoprecError(f"--device: {e}") from None
    validate_spec(spec, dev)


def _make_parents(*paths: str | None) -> list:
    """Create the missing parent directories of ``paths``; returns those created (outermost first).

    Raises:
        AutoprecError: a parent cannot be created (a file is in the way, no permission); the
            directories created so far are removed again.
    """
    from pathlib import Path

    created = []
    for p in paths:
        if not p:
            continue
        missing = [d for d in reversed(Path(p).absolute().parents) if not d.exists()]
        for d in missing:
            try:
                d.mkdir()
            except OSError as e:
                _remove_if_empty(created)
                raise AutoprecError(f"{p}: cannot create the directory {d} ({e.strerror or e})") from None
            created.append(d)
    return created


def _check_writable(option: str, path: str, example: str = "policy.json") -> None:
    """Fail before any work when ``path`` cannot be written atomically: it is (or, ending in a
    slash, names) a directory, or its directory takes no new files (files are written to a
    temporary file there, then renamed).

    Raises:
        AutoprecError: naming the option and the path.
    """
    import tempfile

    if os.path.isdir(path) or path.endswith(("/", os.sep)):
        raise AutoprecError(f"{option} {path}: is a directory; give a file path, e.g. {os.path.join(path, example)}")
    try:
        with tempfile.NamedTemporaryFile(dir=os.path.dirname(os.path.abspath(path)), prefix=".autoprec-check-"):
            pass
    except OSError as e:
        raise AutoprecError(f"{option} {path}: cannot write there ({e.strerror or e})") from None


def _check_storage(url: str) -> None:
    """Fail before any work on a storage URL that SQLAlchemy cannot use (Optuna's RDB storage).

    Raises:
        AutoprecError: naming the URL and the reason.
    """
    import sqlalchemy

    try:
        parsed = sqlalchemy.engine.make_url(url)
        parsed.get_dialect()
    except Exception as e:
        hint = f"; for a SQLite file use sqlite:///{url}" if "://" not in url else ""
        raise AutoprecError(f"--storage {url!r}: not a usable database URL ({type(e).__name__}: {e}){hint}") from None
    if parsed.get_backend_name() == "sqlite":
        return  # the file is checked by _check_sqlite_file (a missing one is created)
    try:  # a server database: its driver must import and the server must answer
        engine = sqlalchemy.create_engine(parsed)
        try:
            with engine.connect():
                pass
        finally:
            engine.dispose()
    except Exception as e:
        raise AutoprecError(f"--storage {url!r}: cannot connect ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})") from None


def _check_sqlite_file(option: str, path: str) -> None:
    """An existing study database must be a SQLite file (empty is fine: SQLite fills it).

    Raises:
        AutoprecError: naming the option and the file.
    """
    if not os.path.exists(path):
        return
    if os.path.isdir(path):
        raise AutoprecError(f"{option}: {path} is a directory, not a SQLite study database")
    with open(path, "rb") as f:
        head = f.read(16)
    if head and head != b"SQLite format 3\x00":
        raise AutoprecError(f"{option}: {path} exists and is not a SQLite database; give another path "
                            "(autoprec never overwrites it)")


def _remove_if_empty(dirs: list) -> None:
    """Undo :func:`_make_parents` for directories a failed command left empty (innermost first)."""
    for d in reversed(dirs):
        try:
            d.rmdir()
        except OSError:
            pass


def _sqlite_path(storage: str | None) -> str | None:
    """:func:`autoprec.search.study.sqlite_path`, imported when a command needs it."""
    from autoprec.search.study import sqlite_path

    return sqlite_path(storage)


def _cmd_tune(a: argparse.Namespace) -> int:
    from autoprec.search.study import parse_max_memory

    parse_max_memory(a.max_memory)  # a bad value fails before the model is built
    if a.storage is not None:
        _check_storage(a.storage)
    _validate_model(a.model, a.device)
    created = _make_parents(a.out, _sqlite_path(a.storage))
    try:
        _check_writable("--out", a.out)  # the default study database sits beside it
        if a.storage is None:
            from autoprec.search.study import default_storage

            _check_sqlite_file("--out", _sqlite_path(default_storage(a.out)))
        elif (db := _sqlite_path(a.storage)) is not None:
            _check_sqlite_file("--storage", db)
            if not os.path.isfile(db):
                _check_writable("--storage", db, "study.db")
        return _tune(a)
    except BaseException:
        _remove_if_empty(created)
        raise


def _tune(a: argparse.Namespace) -> int:
    from autoprec.search.study import tune

    res = tune(a.model, trials=a.trials, timeout=a.timeout, max_drift=a.max_drift, device=a.device,
               storage=a.storage, study_name=a.study_name, compile=not a.no_compile, out=a.out,
               seed=a.seed, dtypes=a.dtypes, traj_steps=a.traj_steps, finalists=a.finalists,
               max_memory=a.max_memory)
    print()
    print(format_table(res.table))
    m = res.policy.measured
    print(f"\nchosen: {res.policy.summary()}")
    print(f"wrote {a.out}: {m['tokens_per_s']:.0f} tokens/s, {m['speedup_vs_fp32']:.2f}x fp32 eager, "
          f"grad_rel_l2 {m['grad_rel_l2']:.3g} (budget {m['drift_budget']:.3g}), peak {m['peak_bytes'] / 2**20:.1f} MiB"
          + (f" (budget {m['memory_budget_bytes'] / 2**20:.1f} MiB)" if "memory_budget_bytes" in m else ""))
    print("time: " + ", ".join(f"{k} {v:.0f}s" for k, v in res.timings.items()))
    return 0


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
    if a.resume and a.checkpoint is None and a.compare is None:
        print("autoprec train: error: --resume needs --checkpoint PATH", file=sys.stderr)
        return 2
    from autoprec.policy import Policy

    Policy.load(a.policy)  # a bad policy file fails before the model is built
    _validate_model(a.model, a.device)
    if a.compare is not None:
        with _naming_policy(a.policy):
            return _cmd_compare(a)
    from autoprec.runtime.loop import train

    with _naming_policy(a.policy):
        res = train(a.model, a.policy, steps=a.steps, device=a.device, compile=not a.no_compile,
                    log_every=a.log_every, checkpoint=a.checkpoint, resume=a.resume,
                    checkpoint_every=a.checkpoint_every, log_path=a.log, max_grad_norm=a.max_grad_norm)
    print(f"final loss (mean of last {min(5, len(res.losses))} steps) {res.final_loss:.4f}; "
          f"{res.tokens_per_s:.0f} tokens/s; "
          f"skipped steps {res.skipped}; loss scale {res.loss_scale:g}")
    return 0 if math.isfinite(res.final_loss) else 1


def _cmd_compare(a: argparse.Namespace) -> int:
    """``autoprec train --compare fp32,autocast``: convergence check against the baselines."""
    from autoprec.runtime.compare import BASELINES, compare

    names = [n.strip() for n in a.compare.split(",") if n.strip()]
    bad = [n for n in names if n not in BASELINES]
    if bad:
        print(f"autoprec train: error: --compare: unknown baseline {bad[0]!r}; valid: {', '.join(BASELINES)}",
              file=sys.stderr)
        return 2
    res = compare(a.model, a.policy, a.steps, baselines=names, device=a.device, compile=not a.no_compile,
                  out_dir=a.out_dir, log_every=a.log_every, checkpoint_every=a.checkpoint_every,
                  resume=a.resume)
    print(f"\n{'config':10s} {'max rel dev vs fp32':>20s} {'held-out loss':>14s} {'s/step':>8s} {'skipped':>8s}")
    for name in res.curves:
        print(f"{name:10s} {res.max_rel_dev[name]:20.3e} {res.heldout_loss[name]:14.4f} "
              f"{res.seconds_per_step[name]:8.3f} {res.skipped[name]:8d}")
    print(f"wrote {a.out_dir}/convergence.json and {a.out_dir}/convergence.png")
    return 0 if all(math.isfinite(x) for x in res.curves["policy"]) else 1


def _cmd_report(a: argparse.Namespace) -> int:
    import optuna

    from autoprec.errors import SearchError
    from autoprec.report import write_report

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    _check_storage(a.storage)
    db = _sqlite_path(a.storage)
    if db is not None and not os.path.isfile(db):
        raise SearchError(f"{db}: no such study database (--storage {a.storage})")
    names = [s.study_name for s in optuna.get_all_study_summaries(a.storage)]
    if a.study_name is None and len(names) != 1:
        raise SearchError(f"{a.storage} holds {len(names)} studies; pick one with --study-name: {names}")
    name = a.study_name or names[0]
    if name not in names:
        raise SearchError(f"{a.storage}: no study named {name!r}; studies there: {names}")
    study = optuna.load_study(study_name=name, storage=a.storage)
    _make_parents(a.out)
    for p in write_report(study, a.out):
        print(f"wrote {p}")
    return 0


def _cmd_show(a: argparse.Namespace) -> int:
    from autoprec.policy import Policy

    pol = Policy.load(a.policy)
    if a.model:
        from autoprec.report import show_nodes

        _validate_model(a.model, "cpu")
        with _naming_policy(a.policy):
            nodes = show_nodes(pol, a.model)
    print(pol.to_json())
    if a.model:
        print(nodes)
    return 0


def _cmd_bench(a: argparse.Namespace) -> int:
    from pathlib import Path

    from autoprec.bench import format_bench_table, run_bench

    _validate_model(a.model, a.device)
    try:
        with _naming_policy(a.policy):
            res = run_bench(a.model, a.policy, steps=a.steps, warmup=a.warmup, device=a.device, configs=a.configs,
                            max_step_ratio=a.max_step_ratio, skip_slow=a.skip_slow, json_path=a.json)
    except ValueError as e:
        print(f"autoprec bench: error: {e}", file=sys.stderr)
        return 2
    table = format_bench_table(res)
    print()
    print(table)
    if a.json:
        print(f"wrote {a.json}")
    if a.md:
        Path(a.md).parent.mkdir(parents=True, exist_ok=True)
        Path(a.md).write_text(table + "\n")
        print(f"wrote {a.md}")
    return 0


_COMMANDS = {"tune": _cmd_tune, "train": _cmd_train, "show": _cmd_show, "report": _cmd_report,
             "bench": _cmd_bench}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``autoprec`` console script; returns the exit code."""
    args = _parser().parse_args(argv)
    with warnings.catch_warnings():  # the caller's filters and formatwarning come back on return
        # torch.export's pytree deprecation notice is noise for users of the CLI.
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    from autoprec._interrupt import catch_sigint, interrupted
    from autoprec.errors import LossScaleError

    t0 = time.perf_counter()
    plain = warnings.formatwarning

    def formatwarning(message, category, filename, lineno, line=None):
        """autoprec's own warnings (about the user's files) read as CLI messages, no source line."""
        text = str(message)
        if text.startswith("autoprec: "):
            return f"autoprec {args.cmd}: warning: {text[len('autoprec: '):]}\n"
        return plain(message, category, filename, lineno, line)

    warnings.formatwarning = formatwarning
    try:
        with catch_sigint():
            code = _COMMANDS[args.cmd](args)
    except Exception as e:
        if not interrupted():  # else: an error on the way out of an interrupt (reported below)
            if isinstance(e, AutoprecError):
                print(f"autoprec {args.cmd}: error: {e}", file=sys.stderr)
                return 1 if isinstance(e, LossScaleError) else 2
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
            "train": "; with --checkpoint, --resume continues from the last checkpoint"}.get(args.cmd, "")
    print(f"autoprec {args.cmd}: interrupted after {time.perf_counter() - t0:.0f}s{kept}", file=sys.stderr)
    return 130


if __name__ == "__main__":
    sys.exit(main())
