"""Where studies live and when one may be resumed: storage URLs, the checks the CLI runs on them
before any work, opening (creating or resuming) a study, and the measurement-version and
search-space stamps that refuse a study this run cannot continue (docs/architecture.md#search).

A database server (PostgreSQL, MySQL) shares one study between workers on several machines; its
running trials send Optuna heartbeats, so the trial of a worker that died anywhere is failed and
queued again (:func:`rdb_storage`).
"""

from __future__ import annotations

import inspect
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import optuna
from torch import device as torch_device
from torch import fx

from autoprec.errors import AutoprecError, SearchError
from autoprec.nodekeys import graph_fingerprint
from autoprec.search import attrs
from autoprec.search.objective import DIRECTIONS
from autoprec.search.space import SearchSpace
from autoprec.search.workers import reap_dead_trials, requeue_interrupted, requeue_trial

__all__ = ["GRACE_BEATS", "HEARTBEAT_S", "MEASURE_VERSION", "check_sqlite_file", "check_storage_url",
           "check_study", "default_storage", "default_study_name", "heartbeat_interval",
           "load_existing_study", "open_study", "precheck_study", "rdb_storage", "sqlite_path",
           "shown", "study_choices", "study_space"]

#: Version of what a trial measures and how (measure/harness.py). Bump it when a change makes old
#: trials' numbers incomparable with new ones; a study holding trials of another version is not
#: resumed. 2: a parameter saved for backward counts once in the CPU peak bytes. 3: drift is the
#: mean over K = 4 drift batches (measure/drift.py), and the constraint the DriftBudget rule
#: (search/drift_budget.py). 4: a screening trial's step times are all K drift passes', batch 0's too
#: (measure/screening.py), which the screening cut compares batch for batch.
MEASURE_VERSION = 4

#: Seconds between the heartbeats of a running trial on a database server (Optuna's
#: ``RDBStorage(heartbeat_interval=...)``); the environment variable ``AUTOPREC_HEARTBEAT_S``
#: (a positive integer) overrides it.
HEARTBEAT_S = 10
#: A running trial whose last heartbeat is this many intervals old is stale: its worker died or
#: lost the server (Optuna's ``grace_period``; Optuna's default is 2, which one slow query on a
#: busy server can exceed).
GRACE_BEATS = 6

_SQLITE = "sqlite:///"
_HEARTBEAT_ENV = "AUTOPREC_HEARTBEAT_S"
_T = TypeVar("_T")


def default_storage(out: str | os.PathLike) -> str:
    """SQLite URL of the study file beside the output: ``policy.json`` -> ``policy.optuna.db``."""
    p = Path(out)
    return f"{_SQLITE}{p.with_suffix('').as_posix()}.optuna.db"


def sqlite_path(storage: str | None) -> str | None:
    """The file of a ``sqlite:///PATH`` storage URL (None for other URLs and in-memory SQLite)."""
    if storage and storage.startswith(_SQLITE) and storage[len(_SQLITE):] not in ("", ":memory:"):
        return storage[len(_SQLITE):]
    return None


def _driver_url(url: str) -> str:
    """``postgresql://`` means psycopg2 to SQLAlchemy; where only psycopg 3 is installed (the
    ``postgres`` extra), use it (``postgresql+psycopg://``). Other URLs are returned as given."""
    if not url.startswith("postgresql://"):
        return url
    import importlib.util

    if importlib.util.find_spec("psycopg2") is None and importlib.util.find_spec("psycopg") is not None:
        return "postgresql+psycopg://" + url[len("postgresql://"):]
    return url


def shown(url: str) -> str:
    """``url`` as messages and logs show it: a database URL's password as ``***``
    (``sqlalchemy.engine.URL.render_as_string(hide_password=True)``); anything else as it is."""
    if "://" not in url or "@" not in url:
        return url
    import sqlalchemy

    try:
        return sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a URL SQLAlchemy parses: it holds no password it knows
        return url


def check_storage_url(url: str) -> None:
    """Fail before any work on a storage URL that SQLAlchemy cannot use (Optuna's RDB storage):
    an unknown dialect, a missing driver, or a server that does not answer.

    Raises:
        AutoprecError: naming the URL and the reason.
    """
    import sqlalchemy

    try:
        parsed = sqlalchemy.engine.make_url(_driver_url(url))
        parsed.get_dialect()
    except Exception as e:
        hint = f"; for a SQLite file use {_SQLITE}{url}" if "://" not in url else ""
        raise AutoprecError(f"--storage {shown(url)!r}: not a usable database URL "
                            f"({type(e).__name__}: {e}){hint}") from None
    if parsed.get_backend_name() == "sqlite":
        return  # the file is checked by check_sqlite_file (a missing one is created)
    try:  # a server database: its driver must import and the server must answer
        engine = sqlalchemy.create_engine(parsed)
        try:
            with engine.connect():
                pass
        finally:
            engine.dispose()
    except Exception as e:
        raise AutoprecError(f"--storage {shown(url)!r}: cannot connect ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})") from None
    heartbeat_interval()  # a bad AUTOPREC_HEARTBEAT_S fails now too


def heartbeat_interval() -> int:
    """Seconds between heartbeats: ``$AUTOPREC_HEARTBEAT_S``, else :data:`HEARTBEAT_S`.

    Raises:
        AutoprecError: the variable is set but not a positive integer.
    """
    raw = os.environ.get(_HEARTBEAT_ENV, "").strip()
    if not raw:
        return HEARTBEAT_S
    if not raw.isdigit() or int(raw) <= 0:
        raise AutoprecError(f"{_HEARTBEAT_ENV}={raw!r}: not a positive integer (seconds between heartbeats)")
    return int(raw)


def rdb_storage(url: str) -> str | optuna.storages.RDBStorage:
    """The Optuna storage of a URL. SQLite: the URL itself, as Optuna opens it (one machine; a
    killed worker is found by its pid, :func:`autoprec.search.workers.is_dead_worker`). A
    database server: an ``RDBStorage`` whose running trials record a heartbeat every
    :func:`heartbeat_interval` seconds; one silent for :data:`GRACE_BEATS` intervals (server
    time) is failed by the next worker that looks and queued again
    (:func:`autoprec.search.workers.requeue_trial`), so any worker re-runs it. Workers creating
    the schema of a new database at the same moment race; the loser retries.

    Raises:
        AutoprecError: a bad ``AUTOPREC_HEARTBEAT_S``.
    """
    if url.startswith("sqlite:"):
        return url
    interval = heartbeat_interval()
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # heartbeat_interval
    rdb_params = inspect.signature(optuna.storages.RDBStorage).parameters
    callback = ("heartbeat_stale_trial_callback"  # Optuna >= 4.9; failed_trial_callback before
                if "heartbeat_stale_trial_callback" in rdb_params else "failed_trial_callback")
    return _retry_schema_race(lambda: optuna.storages.RDBStorage(
        _driver_url(url), engine_kwargs={"pool_pre_ping": True}, heartbeat_interval=interval,
        grace_period=GRACE_BEATS * interval, **{callback: requeue_trial}))


def _retry_schema_race(make: Callable[[], _T], attempts: int = 6) -> _T:
    """``make()``, retried when it loses a race with another worker creating the same schema,
    study or table row (an IntegrityError, or "already exists")."""
    for attempt in range(attempts):
        try:
            return make()
        except Exception as e:
            racing = "IntegrityError" in type(e).__name__ + repr(e) or "already exists" in str(e)
            if attempt == attempts - 1 or not racing:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def check_sqlite_file(option: str, path: str) -> None:
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


def default_study_name(path: str | os.PathLike, gm: fx.GraphModule, dev: torch_device,
                       dtypes: Sequence[str] | None = None) -> str:
    """``autoprec-<model stem>-<graph fingerprint[:8]>-<device type>[-<dtypes>]-m<MEASURE_VERSION>``;
    ``<dtypes>`` only when ``--dtypes`` forces them (``dtypes``: the parsed list, sorted here).

    The name is what the command says, never what the probe measured: a re-run whose probe puts a
    kernel on the other side of the keep line resumes the same study and searches the kernels
    recorded in it (``autoprec.search.kernel_choice.adopt_study_kernels``; the probe's decision is
    stamped by :func:`check_study`). The measurement version is part of the name: after an upgrade that
    changes measurements, or with other ``--dtypes``, the same command starts a new study beside
    the old one instead of failing on it. Studies named before this rule (the kept kernels in the
    name) are not found under it: a new study starts.
    """
    forced = f"-{'-'.join(sorted(dtypes))}" if dtypes else ""
    stem = Path(str(path)).stem
    return f"autoprec-{stem}-{graph_fingerprint(gm)[:8]}-{dev.type}{forced}-m{MEASURE_VERSION}"


def precheck_study(storage: str, study_name: str, space: SearchSpace, graph: Mapping | None = None) -> None:
    """:func:`check_study` on an existing study before the baselines are measured (minutes on
    a model whose low dtype is emulated), reading only: a missing database or study passes.

    Raises:
        SearchError: as :func:`check_study`.
    """
    path = sqlite_path(storage)
    if path is not None and not os.path.isfile(path):
        return
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    rdb = rdb_storage(storage)
    try:
        if study_name in {s.study_name for s in optuna.get_all_study_summaries(rdb)}:
            check_study(optuna.load_study(study_name=study_name, storage=rdb), storage, space, stamp=False,
                        graph=graph)
    finally:
        if isinstance(rdb, optuna.storages.RDBStorage):
            rdb.engine.dispose()  # its connections; open_study opens the storage the run uses


def study_choices(storage: str, study_name: str) -> list[str] | None:
    """The kernel choices an existing study was stamped with (``SearchSpace.dtypes``), reading only;
    None when the database, the study or the stamp is missing (:func:`study_space`)."""
    old = study_space(storage, study_name)
    return list(old["dtypes"]) if old else None


def study_space(storage: str, study_name: str) -> dict | None:
    """The :data:`attrs.SPACE` stamp of an existing study, reading only: ``{"dtypes": [...]}`` and,
    stamped by autoprec since the probe's decision is recorded, ``"probe"`` (:func:`check_study`);
    None when the database, the study or the stamp is missing."""
    path = sqlite_path(storage)
    if path is not None and not os.path.isfile(path):
        return None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    rdb = rdb_storage(storage)
    try:
        if study_name not in {s.study_name for s in optuna.get_all_study_summaries(rdb)}:
            return None
        old = optuna.load_study(study_name=study_name, storage=rdb).user_attrs.get(attrs.SPACE)
        return dict(old) if old else None
    finally:
        if isinstance(rdb, optuna.storages.RDBStorage):
            rdb.engine.dispose()


def check_study(study: optuna.Study, storage: str, space: SearchSpace, stamp: bool = True,
                probe: Mapping | None = None, graph: Mapping | None = None) -> None:
    """Stamp a new study with :data:`MEASURE_VERSION`, the search space (:data:`attrs.SPACE`:
    ``{"dtypes": space.dtypes, "probe": probe}``, ``probe`` the decision that chose them: per kernel
    measured its ratio to fp32, band and verdict; JSON-ready) and the captured graph
    (:data:`attrs.GRAPH`: ``graph``, ``{"fingerprint": ..., "model": path}``); refuse to resume one
    whose trials were measured by another version (studies from before the stamp count as
    version 1), sampled from another space (e.g. other ``--dtypes``: Optuna cannot change a
    parameter's choices within a study) or measured on another graph (another model, batch shape
    or torch version under the same ``--study-name``: its trials' numbers are not this model's).

    Raises:
        SearchError: naming the study, the storage and what differs; the study is left as it is.
    """
    fix = "Pass another --study-name (or --storage) to start a new study; the old one is left as it is."
    where = f"study {study.study_name!r} in {shown(storage)}"
    have = study.user_attrs.get(attrs.MEASURE_VERSION, 1 if study.trials else MEASURE_VERSION)
    if have != MEASURE_VERSION:
        raise SearchError(
            f"{where} holds trials measured by another autoprec version (measurement version {have}, "
            f"this one {MEASURE_VERSION}); their numbers are not comparable, so it is not resumed. {fix}")
    old = study.user_attrs.get(attrs.SPACE)
    if study.trials and old is None:  # unstamped: read the dtype choices off its trials
        dists = [t.distributions.get("matmul") for t in study.trials if "matmul" in t.distributions]
        old = {"dtypes": list(dists[0].choices)} if dists else None
    if old is not None and old["dtypes"] != space.dtypes:
        raise SearchError(
            f"{where} searched the dtypes {', '.join(old['dtypes'])}; this run searches "
            f"{', '.join(space.dtypes)} (--dtypes), so it cannot resume it. {fix}")
    theirs = study.user_attrs.get(attrs.GRAPH)
    if graph is not None and theirs is not None and theirs["fingerprint"] != graph["fingerprint"]:
        raise SearchError(
            f"{where} holds trials of {theirs['model']} (captured graph {theirs['fingerprint']}); this "
            f"run's {graph['model']} captures another graph ({graph['fingerprint']}: another model, batch "
            f"shape or torch version), so those trials' numbers are not its own. {fix}")
    if stamp:  # the first worker's space stays the study's (another may have stamped meanwhile)
        if study.user_attrs.get(attrs.SPACE) is None:
            decision = {"probe": dict(probe)} if probe else {}
            study.set_user_attr(attrs.SPACE, {"dtypes": space.dtypes, **decision})
        if graph is not None and theirs is None:
            study.set_user_attr(attrs.GRAPH, dict(graph))
        study.set_user_attr(attrs.MEASURE_VERSION, MEASURE_VERSION)


def open_study(storage: str, study_name: str, seed: int = 0) -> optuna.Study:
    """Create or load (resume) the multi-objective study ``study_name`` in ``storage``
    (:func:`rdb_storage`: heartbeats on a database server).

    The sampler is Optuna's multivariate, grouped TPE (``TPESampler(seed, n_startup_trials=6,
    multivariate=True, group=True)``). Trials left RUNNING by a dead worker (a killed process of
    this host; on a database server also one whose heartbeat stopped) are marked FAIL, so a
    resumed run neither waits for nor counts them; on a database server they are queued again
    (:func:`autoprec.search.workers.reap_dead_trials`). Trials a Ctrl-C or a killed worker cut short
    (``autoprec:interrupted``) are then queued again, each once, on any storage
    (:func:`autoprec.search.workers.requeue_interrupted`).
    """
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=6, multivariate=True, group=True)
    rdb = rdb_storage(storage)
    study = _retry_schema_race(lambda: optuna.create_study(
        storage=rdb, study_name=study_name, directions=list(DIRECTIONS), sampler=sampler,
        load_if_exists=True))
    reap_dead_trials(study)
    requeue_interrupted(study)
    return study


def load_existing_study(storage: str, study_name: str | None = None) -> optuna.Study:
    """Load a study that must exist (``autoprec report``): ``study_name``, or the only study in
    ``storage`` when None. Creates nothing.

    Raises:
        AutoprecError: the URL is unusable (:func:`check_storage_url`).
        SearchError: the SQLite file does not exist, the storage holds no or several studies and
            no name was given, or no study has that name (the message lists those there).
    """
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    check_storage_url(storage)
    db = sqlite_path(storage)
    if db is not None and not os.path.isfile(db):
        raise SearchError(f"{db}: no such study database (--storage {shown(storage)})")
    rdb = rdb_storage(storage)
    names = [s.study_name for s in optuna.get_all_study_summaries(rdb)]
    if study_name is None and len(names) != 1:
        raise SearchError(f"{shown(storage)} holds {len(names)} studies; pick one with --study-name: {names}")
    name = study_name or names[0]
    if name not in names:
        raise SearchError(f"{shown(storage)}: no study named {name!r}; studies there: {names}")
    return optuna.load_study(study_name=name, storage=rdb)
