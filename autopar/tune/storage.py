"""Where a study lives: its SQLite storage (Optuna's RDBStorage, write-ahead logged) and the lock a tuner
holds on it while it works (docs/tuning.md, "Storage, resuming and the study's contents")."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Any, Iterator

from ..errors import AutoparError


@contextlib.contextmanager
def study_lock(study_path: Path | None) -> Iterator[None]:
    """An exclusive lock on STUDY.lock while a tuner works on the study (released by the kernel if killed);
    nothing for a study in memory."""
    if study_path is None:
        yield
        return
    lock_path = study_path.with_name(study_path.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise AutoparError(f"another autopar tuner is working on {study_path} (it holds {lock_path}): wait for "
                               "it to end, or use another --study file.") from None
        yield
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
    study_path.parent.mkdir(parents=True, exist_ok=True)
    storage = optuna.storages.RDBStorage(f"sqlite:///{study_path.resolve()}",
                                         engine_kwargs={"connect_args": {"timeout": 60}})
    sqlalchemy.event.listen(storage.engine, "connect", _pragmas)
    storage.engine.dispose()  # pooled connections are dropped, so that every new one gets the pragmas
    return storage
