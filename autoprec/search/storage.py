"""Where studies live and when one may be resumed: storage URLs, the checks the CLI runs on them
before any work, opening (creating or resuming) a study, and the measurement-version and
search-space stamps that refuse a study this run cannot continue (docs/architecture.md#search).
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import optuna
from torch import device as torch_device
from torch import fx

from autoprec.errors import AutoprecError, SearchError
from autoprec.nodekeys import graph_fingerprint
from autoprec.search import attrs
from autoprec.search.objective import DIRECTIONS, is_dead_worker
from autoprec.search.space import SearchSpace

__all__ = ["MEASURE_VERSION", "check_sqlite_file", "check_storage_url", "check_study", "default_storage",
           "default_study_name", "load_existing_study", "open_study", "precheck_study", "sqlite_path"]

#: Version of what a trial measures and how (search/measure.py). Bump it when a change makes old
#: trials' numbers incomparable with new ones; a study holding trials of another version is not
#: resumed. 2: a parameter saved for backward counts once in the CPU peak bytes.
MEASURE_VERSION = 2

_SQLITE = "sqlite:///"


def default_storage(out: str | os.PathLike) -> str:
    """SQLite URL of the study file beside the output: ``policy.json`` -> ``policy.optuna.db``."""
    p = Path(out)
    return f"{_SQLITE}{p.with_suffix('').as_posix()}.optuna.db"


def sqlite_path(storage: str | None) -> str | None:
    """The file of a ``sqlite:///PATH`` storage URL (None for other URLs and in-memory SQLite)."""
    if storage and storage.startswith(_SQLITE) and storage[len(_SQLITE):] not in ("", ":memory:"):
        return storage[len(_SQLITE):]
    return None


def check_storage_url(url: str) -> None:
    """Fail before any work on a storage URL that SQLAlchemy cannot use (Optuna's RDB storage):
    an unknown dialect, a missing driver, or a server that does not answer.

    Raises:
        AutoprecError: naming the URL and the reason.
    """
    import sqlalchemy

    try:
        parsed = sqlalchemy.engine.make_url(url)
        parsed.get_dialect()
    except Exception as e:
        hint = f"; for a SQLite file use {_SQLITE}{url}" if "://" not in url else ""
        raise AutoprecError(f"--storage {url!r}: not a usable database URL ({type(e).__name__}: {e}){hint}") from None
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
        raise AutoprecError(f"--storage {url!r}: cannot connect ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})") from None


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


def default_study_name(path: str | os.PathLike, gm: fx.GraphModule, dev: torch_device, space: SearchSpace) -> str:
    """``autoprec-<model stem>-<graph fingerprint[:8]>-<device type>-<dtypes>-m<MEASURE_VERSION>``.

    The measurement version and the searched dtypes are part of the name: after an upgrade that
    changes measurements, or with other ``--dtypes``, the same command starts a new study beside
    the old one instead of failing on it (see :func:`check_study`).
    """
    return (f"autoprec-{Path(str(path)).stem}-{graph_fingerprint(gm)[:8]}-{dev.type}-"
            f"{'-'.join(space.dtypes)}-m{MEASURE_VERSION}")


def precheck_study(storage: str, study_name: str, space: SearchSpace) -> None:
    """:func:`check_study` on an existing study before the baselines are measured (minutes on
    a model whose low dtype is emulated), reading only: a missing database or study passes.

    Raises:
        SearchError: as :func:`check_study`.
    """
    path = sqlite_path(storage)
    if path is not None and not os.path.isfile(path):
        return
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if study_name not in {s.study_name for s in optuna.get_all_study_summaries(storage)}:
        return
    check_study(optuna.load_study(study_name=study_name, storage=storage), storage, space, stamp=False)


def check_study(study: optuna.Study, storage: str, space: SearchSpace, stamp: bool = True) -> None:
    """Stamp a new study with :data:`MEASURE_VERSION` and the search space; refuse to resume one
    whose trials were measured by another version (studies from before the stamp count as
    version 1) or sampled from another space (e.g. other ``--dtypes``: Optuna cannot change a
    parameter's choices within a study).

    Raises:
        SearchError: naming the study, the storage and what differs; the study is left as it is.
    """
    fix = "Pass another --study-name (or --storage) to start a new study; the old one is left as it is."
    where = f"study {study.study_name!r} in {storage}"
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
            f"{', '.join(space.dtypes)} (--dtypes, or what the probe measured as faster than fp32), "
            f"so it cannot resume it. {fix}")
    if stamp:
        study.set_user_attr(attrs.SPACE, {"dtypes": space.dtypes})
        study.set_user_attr(attrs.MEASURE_VERSION, MEASURE_VERSION)


def open_study(storage: str, study_name: str, seed: int = 0) -> optuna.Study:
    """Create or load (resume) the multi-objective study ``study_name`` in ``storage``.

    The sampler is Optuna's multivariate, grouped TPE (``TPESampler(seed, n_startup_trials=6,
    multivariate=True, group=True)``). Trials left RUNNING by a killed worker of this host (its
    process is gone) are marked FAIL and interrupted, so a resumed run neither waits for nor
    counts them.
    """
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=6, multivariate=True, group=True)
    for attempt in range(6):
        try:
            study = optuna.create_study(storage=storage, study_name=study_name, directions=list(DIRECTIONS),
                                        sampler=sampler, load_if_exists=True)
            break
        except Exception as e:  # workers creating one new RDB schema at the same moment race
            racing = "IntegrityError" in type(e).__name__ + repr(e) or "already exists" in str(e)
            if attempt == 5 or not racing:
                raise
            time.sleep(0.2 * (attempt + 1))
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        if is_dead_worker(t):
            study._storage.set_trial_user_attr(t._trial_id, attrs.INTERRUPTED, True)
            study._storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL)
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
        raise SearchError(f"{db}: no such study database (--storage {storage})")
    names = [s.study_name for s in optuna.get_all_study_summaries(storage)]
    if study_name is None and len(names) != 1:
        raise SearchError(f"{storage} holds {len(names)} studies; pick one with --study-name: {names}")
    name = study_name or names[0]
    if name not in names:
        raise SearchError(f"{storage}: no study named {name!r}; studies there: {names}")
    return optuna.load_study(study_name=name, storage=storage)
