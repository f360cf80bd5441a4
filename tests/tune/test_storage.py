"""Where a study writes (autopar/tune/storage.py, engine.py's end): every place is checked before the probe and
the first trial, a write that fails after the trials keeps the result, and a damaged study file is refused in
one line (issue 11, item 10).

The studies run with tests/tune/test_study.py's fake runner and probe (the tiny GPT's real profile on 2 CPU
processes). A read-only folder is made with chmod; where this process can still write it (root, as CI runs),
every new file under it is refused the way the kernel refuses it, at `tempfile.mkstemp`, through which autopar's
writes (atomic_write_text) and its write check both go.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import tempfile
from pathlib import Path

import pytest

from autopar import plan_cache as cache
from autopar.cli import main
from autopar.errors import ResultNotSavedError, StorageError
from autopar.plans import Plan
from autopar.tune.storage import check_places, study_lock
from autopar.tune.study import tune
from tests.tune.test_study import (  # noqa: F401 - the fixtures are used by name
    NO_PRUNING,
    FakeRunner,
    _fake_trials,
    _private_cache,
    _tune,
    probe_result,
)


@pytest.fixture
def read_only(monkeypatch):
    """`read_only(folder)`: the folder (made if missing) can no longer take new files; undone after the test, or by
    `read_only.undo()`."""
    folders: list[Path] = []
    real_mkstemp = tempfile.mkstemp

    def refusing(*args, dir=None, **kw):
        if dir is not None and any(Path(dir).resolve().is_relative_to(f) for f in folders):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(dir))
        return real_mkstemp(*args, dir=dir, **kw)

    def make(folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o555)
        folders.append(folder.resolve())
        if os.access(folder, os.W_OK):  # root: chmod does not stop it, so refuse as the kernel would
            monkeypatch.setattr(tempfile, "mkstemp", refusing)

    def undo() -> None:
        for folder in folders:
            folder.chmod(0o755)
        folders.clear()

    make.undo = undo
    yield make
    undo()


class _Probe:
    """A prober that counts its calls."""

    def __init__(self, result) -> None:
        self.result, self.calls = result, 0

    def __call__(self, argv, **_):
        self.calls += 1
        return self.result


def _tune_probed(prober, runner, study: Path, **kw):
    return tune(["python", "train.py"], study_path=study, runner=runner, prober=prober, steps=3, warmup=1, **kw)


def _one_line(text: str) -> str:
    assert "\n" not in text.strip(), text
    return text


# ---- (a) every place a study writes is checked before the probe -------------------------------------------
@pytest.mark.parametrize("place, remedy", [("cache", "AUTOPAR_CACHE_DIR"), ("study", "--study"),
                                           ("plan_out", "--plan-out")])
def test_an_unwritable_place_is_refused_before_the_probe_and_any_trial(probe_result, tmp_path, read_only, place,
                                                                       remedy):
    folders = {"cache": tmp_path / "cache", "study": tmp_path / "studies", "plan_out": tmp_path / "out"}
    read_only(folders[place])
    runner, prober = FakeRunner(probe_result), _Probe(probe_result)
    with pytest.raises(StorageError) as refused:
        _tune_probed(prober, runner, tmp_path / "studies" / "s.db", trials=2, plan_out=tmp_path / "out" / "best.yaml")
    message = _one_line(str(refused.value))
    assert str(folders[place]) in message and remedy in message and "cannot write" in message
    assert prober.calls == 0 and runner.ran == []  # nothing ran, nothing was measured for nothing
    assert list(tmp_path.rglob(".autopar-write-check-*")) == []  # the check's own files are gone


def test_a_calibration_folder_that_cannot_be_written_is_said_and_the_study_still_runs(tmp_path, read_only,
                                                                                     monkeypatch):
    """The refit's file is optional (a failed save is a warning): it never refuses the study."""
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "root"))
    read_only(tmp_path / "root" / "calibration")
    with pytest.warns(UserWarning, match="calibration cache folder.*refit of the cost model will not be kept"):
        check_places(tmp_path / "s.db", plan_out=None, cache_directory=tmp_path / "plans")


def test_a_study_in_a_folder_that_does_not_exist_yet_gets_its_lock(tmp_path):
    study = tmp_path / "runs" / "new" / "s.db"
    check_places(study, plan_out=None, cache_directory=tmp_path / "plans")
    with study_lock(study):
        assert study.with_name("s.db.lock").exists()


# ---- (b) a write that fails after the trials keeps the result ---------------------------------------------
class _TurnsReadOnly(FakeRunner):
    """The fake runner; after its `after`-th trial the cache folder becomes read-only (a disk remounted, a quota)."""

    def __init__(self, probe_result, read_only, folder: Path, after: int) -> None:
        super().__init__(probe_result)
        self.read_only, self.folder, self.after = read_only, folder, after

    def __call__(self, *args, **kw):
        result = super().__call__(*args, **kw)
        if len(self.ran) == self.after:
            self.read_only(self.folder)
        return result


@pytest.mark.filterwarnings("ignore:could not save the fitted calibration")
def test_a_cache_made_read_only_mid_study_keeps_the_best_plan_and_a_rerun_caches_it(probe_result, tmp_path,
                                                                                    read_only):
    runner = _TurnsReadOnly(probe_result, read_only, tmp_path / "cache", after=2)
    out, study = tmp_path / "out" / "best.yaml", tmp_path / "s.db"
    with pytest.raises(ResultNotSavedError) as unsaved:
        _tune(probe_result, runner, study, trials=3, prune_factor=NO_PRUNING, plan_out=out)
    report, message = unsaved.value.report, _one_line(str(unsaved.value))
    assert len(runner.ran) == 3 and report.best is not None and report.cached_path is None
    assert Plan.load(out).key() == report.best.key() and report.plan_out == str(out)  # --plan-out written first
    assert "the plan cache" in message and str(tmp_path / "cache") in message and str(out) in message
    assert "AUTOPAR_CACHE_DIR" in message and str(study) in message
    read_only.undo()  # the folder is writable again: the same call caches the plan and runs nothing again
    again = _tune(probe_result, runner, study, trials=3, prune_factor=NO_PRUNING, plan_out=out)
    assert len(runner.ran) == 3 and again.best.key() == report.best.key()
    [(key, path)] = cache.entries()
    assert str(path) == again.cached_path and cache.lookup(key).key() == report.best.key()


def test_the_tune_command_exits_2_in_one_line_and_still_prints_the_table_when_the_cache_fails(
        probe_result, tmp_path, capsys, monkeypatch, read_only):
    runner = _TurnsReadOnly(probe_result, read_only, tmp_path / "cache", after=2)
    _fake_trials(monkeypatch, runner, probe_result)
    with pytest.warns(UserWarning, match="could not save the fitted calibration"):
        code = main(["tune", "--study", str(tmp_path / "s.db"), "--trials", "3", "--steps", "3", "--warmup", "1",
                     "--plan-out", str(tmp_path / "best.yaml"), "--", "python", "train.py"])
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if not line.startswith("[autopar tune]")]
    assert code == 2 and len(errors) == 1 and errors[0].startswith("autopar tune: the best plan")
    assert "AUTOPAR_CACHE_DIR" in errors[0] and str(tmp_path / "best.yaml") in errors[0]
    assert "best (*)" in captured.out and (tmp_path / "best.yaml").is_file()  # the table, and the plan kept


# ---- (c) a damaged study file ------------------------------------------------------------------------------
def _damaged(good: Path, bad: Path, how: str) -> None:
    """A copy of the study file `good`, damaged: not SQLite, cut short, or with one page overwritten."""
    with sqlite3.connect(good) as db:  # the write-ahead log folded into the file, so the copy holds the study
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = bytearray(good.read_bytes())
    page = 4096 * 2
    if how == "not sqlite":
        data = bytearray(b"these are not the bytes of a database\n" * 200)
    elif how == "truncated":
        data = data[:page + 100]
    else:
        data[page:page + 2000] = bytes(range(256)) * 7 + bytes(208)
    bad.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["not sqlite", "truncated", "page overwritten"])
def test_a_damaged_study_file_is_refused_in_one_line_naming_it_before_the_probe(probe_result, tmp_path, capsys,
                                                                                monkeypatch, how):
    _tune(probe_result, FakeRunner(probe_result), tmp_path / "good.db", trials=2, prune_factor=NO_PRUNING)
    bad = tmp_path / "bad.db"
    _damaged(tmp_path / "good.db", bad, how)
    runner, prober = FakeRunner(probe_result), _Probe(probe_result)
    with pytest.raises(StorageError) as refused:
        _tune_probed(prober, runner, bad, trials=2)
    message = _one_line(str(refused.value))
    assert str(bad) in message and "--study" in message and refused.value.path == str(bad)
    # a damaged study may be deleted; a file that is not SQLite at all may be the user's script named by mistake
    assert ("delete it" in message) is (how != "not sqlite"), message
    assert prober.calls == 0 and runner.ran == []
    _fake_trials(monkeypatch, FakeRunner(probe_result), probe_result)
    for argv in (["tune", "--study", str(bad), "--", "python", "train.py"], ["report", str(bad)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"autopar {argv[0]}: ") and str(bad) in err
