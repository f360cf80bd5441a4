"""The calibration cache: a file is read back as written, and one written for another version of the cost
model is ignored (with a warning), so that old factors never mix with new terms. And the bounds a refit
from measured steps must keep to before it is stored (check_refit: issue 11, item 7)."""

from __future__ import annotations

import os
import stat

import pytest
import yaml

from autopar.calibration_cache import CALIBRATION_VERSION, load_calibration, save_calibration
from autopar.cost.calibration import (MAX_REFIT_RATIO, MAX_REFIT_RESIDUAL, MODEL_FACTORS, Calibration, RefitProblem,
                                      RefitRejection, check_refit, refit_bounds)
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


# ---- the bounds of a refit ----------------------------------------------------------------------------------
def test_a_refit_within_the_ratio_and_explaining_its_trials_passes():
    prior = Calibration()
    fitted = prior.replace(matmul_efficiency=prior.matmul_efficiency / 2, launch_s=prior.launch_s * 3)
    assert check_refit(prior, fitted, runs=4, residual=0.05, is_gpu=True) is None


def test_a_factor_moved_past_the_ratio_is_rejected_naming_the_factor_value_bound_and_cause():
    prior = Calibration()
    slow = prior.replace(launch_s=prior.launch_s * 100)  # a host-bound script: every op "costs" 100x
    why = check_refit(prior, slow, runs=5, residual=0.01, is_gpu=True)
    assert why is not None and why.problem is RefitProblem.OUT_OF_BOUNDS and why.factor == "launch_s"
    assert why.fitted == pytest.approx(prior.launch_s * 100)
    assert why.high == pytest.approx(prior.launch_s * MAX_REFIT_RATIO)
    line = why.message()
    assert "\n" not in line and line.startswith("calibration refit not stored: launch_s fitted to 0.0045")
    assert f"[{prior.launch_s / MAX_REFIT_RATIO:.3g}, {prior.launch_s * MAX_REFIT_RATIO:.3g}]" in line
    assert "not the modelled step (data loading, a host-bound loop" in line
    # the other way (steps faster than modelled: an efficiency above its bound), another cause
    fast = check_refit(prior, prior.replace(matmul_efficiency=prior.matmul_efficiency * 5), runs=5, residual=0.01,
                       is_gpu=False)
    assert fast is not None and fast.faster and "ran faster than the cost model can explain" in fast.message()
    assert "data loading" not in fast.message()


def test_an_efficiency_above_a_gpus_datasheet_peak_is_rejected_but_not_on_a_cpu():
    prior = Calibration()
    over = prior.replace(matmul_efficiency=min(1.2, prior.matmul_efficiency * MAX_REFIT_RATIO))
    why = check_refit(prior, over, runs=3, residual=0.0, is_gpu=True)
    assert why is not None and why.factor == "matmul_efficiency" and why.high == 1.0
    assert check_refit(prior, over, runs=3, residual=0.0, is_gpu=False) is None  # CPU peaks are nominal


def test_a_refit_that_does_not_explain_its_trials_is_rejected():
    prior = Calibration()
    why = check_refit(prior, prior.replace(memory_efficiency=0.5), runs=6, residual=0.64, is_gpu=True)
    assert why is not None and why.problem is RefitProblem.RESIDUAL and why.high == MAX_REFIT_RESIDUAL
    assert "within 64% on average, above the 25%" in why.message()


def test_the_bounds_cover_every_factor_a_refit_changes_and_a_rejection_validates_itself():
    assert set(refit_bounds(Calibration(), is_gpu=True)) == set(MODEL_FACTORS)
    with pytest.raises(ValueError, match="no rejection"):  # a value inside its bound rejects nothing
        RefitRejection(RefitProblem.OUT_OF_BOUNDS, "launch_s", 4e-5, 1e-5, 1e-4, runs=2)
    with pytest.raises(ValueError, match="must be one of"):
        RefitRejection(RefitProblem.OUT_OF_BOUNDS, "context_bytes", 9.0, 0.0, 1.0, runs=2)
