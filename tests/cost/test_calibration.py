"""The calibration cache: a file is read back as written, and one written for another version of the cost
model is ignored (with a warning), so that old factors never mix with new terms."""

from __future__ import annotations

import pytest
import yaml

from autopar.cost.calibration import CALIBRATION_VERSION, Calibration, load_calibration, save_calibration


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
