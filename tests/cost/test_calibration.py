"""The calibration cache: a file is read back as written, and one written for another version of the cost
model is ignored (with a warning), so that old factors never mix with new terms."""

from __future__ import annotations

import os
import stat

import pytest
import yaml

from autopar.calibration_cache import CALIBRATION_VERSION, load_calibration, save_calibration
from autopar.cost.calibration import Calibration
from autopar.errors import CacheError


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))


def test_a_saved_calibration_is_read_back_with_its_version():
    cal = Calibration(matmul_efficiency=0.5, launch_s=1e-5, fitted_runs=3)
    path = save_calibration(cal, "abc123")
    assert yaml.safe_load(path.read_text())["version"] == CALIBRATION_VERSION
    back = load_calibration("abc123")
    assert back is not None
    assert back.matmul_efficiency == 0.5 and back.launch_s == 1e-5 and back.fitted_runs == 3
    assert back.topology_fingerprint == "abc123"


def test_a_calibration_of_another_version_is_ignored_with_a_warning():
    path = save_calibration(Calibration(matmul_efficiency=0.5), "abc123")
    data = yaml.safe_load(path.read_text())
    data.pop("version")  # as an older autopar wrote it
    path.write_text(yaml.safe_dump(data))
    with pytest.warns(UserWarning, match="another version of autopar's cost model"):
        assert load_calibration("abc123") is None
    data["version"] = CALIBRATION_VERSION + 1
    path.write_text(yaml.safe_dump(data))
    with pytest.warns(UserWarning, match="ignored, the defaults stand"):
        assert load_calibration("abc123") is None


@pytest.mark.skipif(os.name == "nt", reason="POSIX permission bits")
def test_a_calibration_file_is_private_and_one_others_can_write_is_refused():
    """The calibration cache shares the plan cache's privacy check (autopar._util.io.check_private)."""
    path = save_calibration(Calibration(), "abc123")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    os.chmod(path, 0o666)
    with pytest.raises(CacheError, match="can be written by others.*chmod 600"):
        load_calibration("abc123")
    os.chmod(path, 0o600)
    os.chmod(path.parent, 0o770)
    with pytest.raises(CacheError, match="calibration can be written by the group.*chmod 700"):
        load_calibration("abc123")
