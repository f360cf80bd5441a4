"""Where a study lives: its SQLite storage (Optuna's RDBStorage, write-ahead logged) and the lock a tuner
holds on it while it works (docs/tuning.md, "Storage, resuming and the study's contents"); and the check,
before the probe and the first trial, that every place a study writes can be written and that its study file
is a sound SQLite database (`check_places`), so a study never measures for nothing."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sqlite3
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

from .._util.io import cache_subdir, check_writable
from ..calibration_cache import calibration_folder
from ..errors import AutoparError, StorageError, StudyLockedError
from ..plan_cache import check_plan_out, plans_folder

_NEW_STUDY = "delete it (or move it aside) to start a new study, or use another --study file."
#: The first bytes of every SQLite database file (sqlite.org/fileformat.html, "The Database Header").
_SQLITE_HEADER = b"SQLite format 3\x00"


def _lock_path(study_path: Path) -> Path:
    """STUDY.lock, beside the study file."""
    return study_path.with_name(study_path.name + ".lock")


def _holder(fd: int) -> str:
    """Who holds a lock, as its holder wrote it into the lock file (`study_lock`): "pid 123 on host, since ..."."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = json.loads(os.read(fd, 4096).decode() or "{}")
    except (OSError, ValueError):
        return "another autopar tuner"
    if not isinstance(data, dict) or not isinstance(data.get("pid"), int):
        return "another autopar tuner"
    return f"the autopar tuner of pid {data['pid']} on {data.get('host', '?')} (since {data.get('since', '?')})"


@contextlib.contextmanager
def study_lock(study_path: Path | None) -> Iterator[None]:
    """An exclusive lock on STUDY.lock while a tuner works on the study (released by the kernel if killed);
    nothing for a study in memory. The holder writes its pid, host and start time into the file; a second tuner is
    refused at once with StudyLockedError, in one line naming them and the file."""
    if study_path is None:
        yield
        return
    lock_path = _lock_path(study_path)
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)  # a new study's folder: the study file will go there too
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise StorageError(f"cannot write the study's lock file {lock_path} ({exc.strerror}): make it and its folder "
                           "writable, or use another --study file.", path=str(lock_path)) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StudyLockedError(f"{_holder(fd)} is working on {study_path} (it holds {lock_path}): wait for it "
                                   "to end, or use another --study file.", path=str(lock_path)) from None
        with contextlib.suppress(OSError):  # who holds it, for the message a second tuner prints
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                      "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
    finally:
        os.close(fd)


def _pragmas(connection: Any, _record: Any) -> None:
    """Write-ahead logging with synchronous=NORMAL: a commit no longer waits for the disk (about 10 ms each, and
    Optuna commits a few times per trial), and a killed tuner still loses nothing it committed (only a power
    loss can drop the last commits)."""
    cursor = connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def study_storage(study_path: Path | None) -> Any:
    """The storage of a study file (created if new), or an in-memory one for `None`."""
    import optuna  # lazy: optuna (and its sqlalchemy) load when a study runs, not on `import autopar`
    import sqlalchemy

    if study_path is None:
        return optuna.storages.InMemoryStorage()
    check_study_file(study_path)
    study_path.parent.mkdir(parents=True, exist_ok=True)
    storage = optuna.storages.RDBStorage(f"sqlite:///{study_path.resolve()}",
                                         engine_kwargs={"connect_args": {"timeout": 60}})
    sqlalchemy.event.listen(storage.engine, "connect", _pragmas)
    storage.engine.dispose()  # pooled connections are dropped, so that every new one gets the pragmas
    return storage


def create_or_load_study(study_path: Path | None, name: str) -> tuple[Any, Any]:
    """(storage, study): the study `name` of the file, created or loaded. What SQLite or Optuna still refuse in a
    file that passed `check_study_file` is a StorageError naming the file, never a raw sqlalchemy traceback."""
    import optuna  # lazy, as in study_storage
    import sqlalchemy

    try:
        storage = study_storage(study_path)
        study = optuna.create_study(storage=storage, study_name=name, direction="maximize", load_if_exists=True)
    except sqlalchemy.exc.OperationalError as exc:  # locked, disk full, I/O: nothing says the file is damaged
        cause = getattr(exc, "orig", None) or exc
        raise StorageError(f"cannot open the study {study_path} ({str(cause).splitlines()[0]}): the file is kept; check "
                           "the disk's free space and your permissions, then run again.", path=str(study_path)) from None
    except (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError) as exc:
        cause = getattr(exc, "orig", None) or exc.__cause__ or exc
        raise StorageError(f"{study_path} is not a study autopar can open ({str(cause).splitlines()[0]}): "
                           f"{_NEW_STUDY}", path=str(study_path)) from None
    return storage, study


def check_study_file(study_path: Path) -> None:
    """Refuse a study file that exists but is not a sound SQLite database (not SQLite at all, truncated, pages
    overwritten: SQLite's `PRAGMA quick_check`), naming it and the remedy. A missing or empty file is a new study."""
    if not study_path.is_file() or study_path.stat().st_size == 0:
        return
    try:
        with study_path.open("rb") as f:
            head = f.read(len(_SQLITE_HEADER))
    except OSError as exc:
        raise StorageError(f"cannot read the study file {study_path} ({exc}): check that you can read it and its "
                           "folder, or use another --study file.", path=str(study_path)) from None
    if head != _SQLITE_HEADER:  # some other file (a script named by mistake): never advise deleting it
        raise StorageError(f"{study_path} is not a study (not an SQLite file at all): --study names the study's own "
                           "file; give it a new path, such as --study study.db.", path=str(study_path))
    try:
        with contextlib.closing(sqlite3.connect(study_path.resolve().as_uri() + "?mode=ro", uri=True,
                                                timeout=60)) as db:
            rows = db.execute("PRAGMA quick_check").fetchall()
    except sqlite3.OperationalError as exc:  # locked, or not openable: nothing says the file is damaged
        raise StorageError(f"cannot read the study file {study_path} (SQLite: {exc}): check that you can read it and "
                           "its folder, or use another --study file.", path=str(study_path)) from None
    except sqlite3.DatabaseError as exc:  # "file is not a database", "database disk image is malformed"
        raise StorageError(f"{study_path} is not a readable SQLite study ({exc}): {_NEW_STUDY}",
                           path=str(study_path)) from None
    if rows != [("ok",)]:
        first = " ".join(str(rows[0][0]).split()) if rows else "no answer"
        raise StorageError(f"{study_path} is a damaged SQLite file (quick_check: {first[:200]}): {_NEW_STUDY}",
                           path=str(study_path))


def check_places(study_path: Path | None, *, plan_out: str | os.PathLike[str] | None,
                 cache_directory: str | os.PathLike[str] | None) -> None:
    """Before the probe and the first trial: the plan cache, the calibration cache, the study file (and its
    lock) and --plan-out's folder can be written, the caches pass their privacy checks, --plan-out is a path
    `write_plan_out` will take, and the study file is sound. Each refusal is a StorageError (or the cache's and
    --plan-out's own errors) naming the path and what to change."""
    env_fix = "point AUTOPAR_CACHE_DIR at a folder you can write"
    cache_fix = env_fix if cache_directory is None else "pass another cache_directory"
    places = [(plans_folder(cache_directory), "the plan cache folder",
               f"make it writable, or {cache_fix} (the best plan is cached there for autopar.wrap).", True)]
    if study_path is not None:
        fix = "make it and its folder writable, or use another --study file."
        places += [(study_path, "the study file", fix, False),
                   (_lock_path(study_path), "the study's lock file", fix, False)]
    if plan_out is not None:
        places.append((check_plan_out(plan_out).parent, "the --plan-out folder",
                       "make it writable, or choose another --plan-out.", True))
    for path, what, remedy, folder in places:
        check_writable(path, what=what, remedy=remedy, folder=folder)
    cache_subdir("plans", directory=cache_directory, create=False)  # the privacy checks store() makes
    try:  # the refit's file is optional (a failed save is a warning, engine._refit): said, never a refusal
        check_writable(calibration_folder(), what="the calibration cache folder", remedy=f"make it writable, or "
                       f"{env_fix}.", folder=True)
        cache_subdir("calibration", create=False)
    except AutoparError as exc:
        warnings.warn(f"{exc} The study runs; its refit of the cost model will not be kept.", stacklevel=2)
    if study_path is not None:
        check_study_file(study_path)
