"""Training monitor: per-step numbers, a JSONL log, and the diagnosis of non-finite values
(docs/architecture.md#runtime).

:class:`Monitor` records, for every optimizer step, the loss, the loss scale used, whether the step was
skipped, the (unscaled) gradient L2 norm, the number of non-finite gradient elements and the throughput;
it appends each record as one JSON object per line to a JSONL file and summarises the run (overflow
steps, skip rate). Non-finite floats are written as the strings ``"inf"``, ``"-inf"`` and ``"nan"``, so
every line is strict JSON (``json.loads`` with no ``NaN`` extension; RFC 8259 has no inf/NaN).

:func:`first_nonfinite_node` re-runs a forward pass through an instrumented
:class:`torch.fx.Interpreter` (``autoprec.passes.diagnose``) and returns the stable key
(``NodeMeta.key``, docs/architecture.md#node-keys-and-op-classes) of the first node whose
floating output holds an inf or NaN. :meth:`Monitor.diagnoser` wraps it as the zero-argument ``diagnose``
callable of :class:`~autoprec.training.scaler.DynamicLossScaler`, so a ``LossScaleError`` at the scale
floor names that node.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from torch import fx

from autoprec._io import atomic_write, json_safe  # json_safe re-exported: the package's one non-finite rule
from autoprec.capture import InputShapes
from autoprec.metrics import median
from autoprec.modelspec import split_batch
from autoprec.nodemeta import read_meta
from autoprec.passes.diagnose import first_nonfinite_node as _first_nonfinite_in_graph
from autoprec.source import node_source

__all__ = ["Monitor", "StepRecord", "first_nonfinite_node", "json_safe", "read_jsonl", "tokens_per_s"]


def first_nonfinite_node(gm: fx.GraphModule, batch: Any) -> str | None:
    """The key of the first node (graph order) whose floating output has an inf or NaN on ``batch``.

    Runs the forward pass eagerly, node by node, under ``torch.no_grad`` (no compile, no backward);
    it stops at the first bad node.

    Args:
        gm: A captured or lowered graph, e.g. ``MixedPrecisionModule.graph_module``.
        batch: A batch as ``get_batch`` returns it: a mapping (called as ``gm(**batch)``), a tuple or
            list (``gm(*batch)``), or a single tensor (``gm(batch)``).

    Returns:
        ``NodeMeta.key`` (e.g. ``"proj/linear#0"``; the FX name for nodes without a
        key, such as inputs), or ``None`` when every floating value of the forward pass is finite
        (then the non-finite gradients, if any, arise in the backward pass).

    Raises:
        ValueError: a tensor of ``batch`` has another shape than the graph was captured for (the
            message names the input and both shapes).
    """
    args, kwargs = split_batch(batch)
    InputShapes(gm, what="the graph_module").check(args, kwargs)
    return _first_nonfinite_in_graph(gm, *args, **kwargs)


@dataclass
class StepRecord:
    """One optimizer step as the monitor logs it.

    Attributes:
        step: Optimizer step index (0-based, counts skipped steps).
        loss: Unscaled loss (fp32 value as a Python float; may be inf/NaN).
        loss_scale: Loss scale used for this step (1.0 without a scaler).
        skipped: True if the optimizer step was skipped (non-finite gradients).
        grad_norm: L2 norm of the unscaled gradients over all parameters (inf if any is non-finite).
        nonfinite_grads: Number of inf/NaN gradient elements.
        tokens_per_s: Tokens (or samples) per second of this step's wall-clock time (0 if unknown).
        seconds: Wall-clock seconds of the step.
        first_nonfinite_node: Key of the first forward node with a non-finite output, when the step
            was diagnosed (only on overflow steps, see :class:`Monitor`), else None.
    """

    step: int
    loss: float
    loss_scale: float
    skipped: bool
    grad_norm: float
    nonfinite_grads: int
    tokens_per_s: float = 0.0
    seconds: float = 0.0
    first_nonfinite_node: str | None = None


def _drop_from(path: Path, step: int) -> None:
    """Rewrite the JSONL log ``path`` (atomically) without its step records of ``step`` or later;
    other lines are kept as they are, except a last line cut short by a killed run (not JSON)."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)

    def keep(i: int, line: str) -> bool:
        try:
            rec = json.loads(line)
        except ValueError:
            return i < len(lines) - 1  # a half-written last line: the killed run's
        return not (isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] >= step)

    kept = [ln if ln.endswith("\n") else ln + "\n" for i, ln in enumerate(lines) if keep(i, ln)]
    if len(kept) != len(lines):
        atomic_write(path, lambda f: f.writelines(kept))


class Monitor:
    """Per-step training monitor with a JSONL log and non-finite diagnosis.

    Args:
        path: JSONL file to append one line per step to (parent directories are created; an existing
            file is appended to, e.g. on resume), or None to keep records in memory only.
        resume_from: The step a resumed run starts at (its checkpoint's): the lines of an existing
            ``path`` from that step on, which the interrupted run wrote after its last checkpoint
            and the resumed run redoes, are dropped first (the file is rewritten atomically), so each
            step has one line. None (default): nothing is dropped.
        graph_module: The (lowered) graph the model runs, used to diagnose overflow steps; None
            disables diagnosis.
        diagnose_overflows: Diagnose each step with non-finite gradients (re-runs the forward pass
            through an interpreter: costs about one eager forward per overflow step). Only the
            first ``max_diagnoses`` overflow steps are diagnosed.
        max_diagnoses: Upper bound on diagnosed steps per run (default 3: each costs an eager
            forward, and the first overflows name the node; later ones at the same node add nothing).

    Each line of the log is a :class:`StepRecord` as JSON: ``step``, ``loss``, ``loss_scale``,
    ``skipped``, ``grad_norm`` (unscaled L2 norm), ``nonfinite_grads`` (count), ``tokens_per_s``,
    ``seconds`` (wall clock of the step) and ``first_nonfinite_node``.

    Raises:
        OSError: ``path``'s directory cannot be created or the file opened for appending.

    Example (``TrainStep`` from :mod:`autoprec.training.train`: one optimizer step, its stats)::

        step = TrainStep(mp, list(model.parameters()), optimizer, loss_fn, scaler=make_scaler(policy))
        mon = Monitor("run/log.jsonl", graph_module=mp.graph_module)
        stats = step(batch)
        mon.record(i, stats, tokens=4096, seconds=dt, batch=batch)
        print(mon.summary())
    """

    def __init__(self, path: str | os.PathLike | None = None, graph_module: fx.GraphModule | None = None,
                 diagnose_overflows: bool = True, max_diagnoses: int = 3,
                 resume_from: int | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self.graph_module = graph_module
        self.diagnose_overflows = diagnose_overflows
        self.max_diagnoses = max_diagnoses
        self.records: list[StepRecord] = []
        self.last_batch: Any = None
        self._diagnosed = 0
        self._file: IO[str] | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume_from is not None and self.path.is_file():
                _drop_from(self.path, resume_from)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    # -------------------------------------------------------------------------- recording
    def record(self, step: int, stats: Any, tokens: int = 0, seconds: float = 0.0,
               batch: Any = None) -> StepRecord:
        """Record one step and append it to the JSONL log.

        Args:
            step: Optimizer step index.
            stats: A :class:`~autoprec.training.train.StepStats` (``loss``, ``skipped``, ``loss_scale``,
                ``grad_norm``, ``nonfinite_grads``).
            tokens: Tokens (or samples) the step processed, for tokens/s.
            seconds: Wall-clock seconds the step took.
            batch: The step's batch; kept for :meth:`diagnoser` and used to diagnose an overflow step.

        Returns:
            The :class:`StepRecord` written.
        """
        if batch is not None:
            self.last_batch = batch
        rec = StepRecord(step=int(step), loss=float(stats.loss), loss_scale=float(stats.loss_scale),
                         skipped=bool(stats.skipped), grad_norm=float(stats.grad_norm),
                         nonfinite_grads=int(stats.nonfinite_grads),
                         tokens_per_s=(tokens / seconds) if tokens and seconds > 0 else 0.0,
                         seconds=float(seconds))
        overflow = rec.nonfinite_grads > 0 or not math.isfinite(rec.loss)
        if (overflow and self.diagnose_overflows and self.graph_module is not None and batch is not None
                and self._diagnosed < self.max_diagnoses):
            self._diagnosed += 1
            rec.first_nonfinite_node = first_nonfinite_node(self.graph_module, batch)
        self.records.append(rec)
        if self._file is not None:
            self._file.write(json.dumps(json_safe(asdict(rec)), allow_nan=False) + "\n")
            self._file.flush()
        return rec

    def diagnoser(self) -> Callable[[], str | None]:
        """A zero-argument callable for ``DynamicLossScaler(diagnose=...)``.

        It re-runs :attr:`last_batch` through :func:`first_nonfinite_node` on :attr:`graph_module`.
        The scaler raises inside ``update()``, before the step is recorded, so a training loop sets
        ``monitor.last_batch = batch`` before each step (``autoprec.commands.train`` does, through
        :func:`~autoprec.training.steps.run_steps`'s ``before`` hook). Its ``source_of`` attribute is
        :meth:`source_of`, with which the scaler's error names the model's line of the node.

        Raises:
            ValueError: the monitor has no ``graph_module``.
        """
        if self.graph_module is None:
            raise ValueError("Monitor.diagnoser() needs a graph_module (e.g. "
                             "MixedPrecisionModule.graph_module)")

        def diagnose() -> str | None:
            if self.last_batch is None:
                return None
            return first_nonfinite_node(self.graph_module, self.last_batch)

        diagnose.source_of = self.source_of  # type: ignore[attr-defined]  # the scaler's message names the line
        return diagnose

    # -------------------------------------------------------------------------- summary
    def summary(self) -> dict[str, Any]:
        """Run summary (JSON-safe values).

        Returns:
            ``steps``, ``overflow_steps`` (steps with non-finite gradients or loss), ``skipped_steps``,
            ``skip_rate`` (skipped / steps, 0 for no steps), ``first_nonfinite_nodes`` (distinct
            diagnosed keys, in order), ``final_loss_scale``, ``max_grad_norm`` (over finite norms),
            ``median_tokens_per_s`` (mean tokens per step / :func:`autoprec.metrics.median` of the
            step seconds, over the steps after the first, which may include compilation: the
            throughput rule of ``tune`` and ``bench``).
        """
        recs = self.records
        n = len(recs)
        overflow = [r for r in recs if r.nonfinite_grads > 0 or not math.isfinite(r.loss)]
        skipped = sum(r.skipped for r in recs)
        keys: list[str] = []
        for r in recs:
            if r.first_nonfinite_node is not None and r.first_nonfinite_node not in keys:
                keys.append(r.first_nonfinite_node)
        norms = [r.grad_norm for r in recs if math.isfinite(r.grad_norm)]
        timed = [r for r in recs[1:] if r.tokens_per_s > 0] or [r for r in recs if r.tokens_per_s > 0]
        return json_safe({
            "steps": n, "overflow_steps": len(overflow), "skipped_steps": skipped,
            "skip_rate": skipped / n if n else 0.0, "first_nonfinite_nodes": keys,
            "final_loss_scale": recs[-1].loss_scale if recs else None,
            "max_grad_norm": max(norms) if norms else None,
            "median_tokens_per_s": tokens_per_s(timed),
        })

    def source_of(self, key: str) -> str | None:
        """The model's source line that made the node of :attr:`graph_module` keyed ``key``
        (:func:`autoprec.source.node_source`), or None (no graph, no such node, no line)."""
        nodes = self.graph_module.graph.nodes if self.graph_module is not None else []
        return next((node_source(n) for n in nodes if read_meta(n).key == key), None)

    def close(self) -> None:
        """Close the JSONL file (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Monitor:  # noqa: PYI034 - Python 3.10 has no typing.Self
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read a monitor log back: one dict per line, ``"inf"``/``"-inf"``/``"nan"`` strings turned into floats
    for the numeric fields."""
    out = []
    numeric = ("loss", "loss_scale", "grad_norm", "tokens_per_s", "seconds")
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                for k in numeric:
                    if isinstance(d.get(k), str):
                        d[k] = float(d[k])
                out.append(d)
    return out


def tokens_per_s(records: list[StepRecord]) -> float:
    """Throughput of ``records``: mean tokens per step / the median step seconds
    (:func:`autoprec.metrics.median`), the rule the harness uses (docs/architecture.md#measurements);
    0.0 for no records. Tokens per step are read back as ``tokens_per_s * seconds``."""
    if not records:
        return 0.0
    tokens = sum(r.tokens_per_s * r.seconds for r in records) / len(records)
    return tokens / median([r.seconds for r in records])
