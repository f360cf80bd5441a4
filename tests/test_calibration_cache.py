"""The calibration cache per model (save_refit / load_refit) and what planning says of a cached calibration
(planning.calibration_for): a tuner's refit of one model is never read for another, and a cached calibration
in use is logged, naming its file and what it changes, and recorded in the plan's prediction (issue 11, item 7)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import yaml

import autopar
from autopar._util.log import get_logger
from autopar.calibration_cache import CALIBRATION_VERSION, load_refit, refit_path, save_calibration, save_refit
from autopar.cost import predict_profile
from autopar.cost.calibration import Calibration
from autopar.errors import CacheError
from autopar.plan_cache import sample_signature
from autopar.planning import calibration_for, profile_variants
from autopar.plans import Plan
from autopar.topology import Topology

TOPO = Topology.cpu(1)
pytestmark = pytest.mark.filterwarnings("ignore:autopar. no repeated blocks")  # the MLPs have no repeated layers


def _mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 16))


def _sample():
    return torch.randn(4, 16)


@pytest.fixture
def profiles():
    a, _ = profile_variants(_mlp(32), _sample(), TOPO)
    b, _ = profile_variants(_mlp(64), _sample(), TOPO)
    assert a.fingerprint != b.fingerprint
    return a, b


@pytest.fixture
def autopar_log(caplog):
    logger = get_logger()
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="autopar")
    yield caplog
    logger.removeHandler(caplog.handler)


def _key(profile):
    return dict(model_fingerprint=profile.fingerprint, sample_signature=sample_signature(profile))


def _store_refit(profile, **factors):
    fitted = calibration_for(TOPO).replace(source="fitted to 4 measured steps (autopar tune)", fitted_runs=4, **factors)
    return save_refit(fitted, topology_fingerprint=TOPO.fingerprint(), **_key(profile))


def test_a_refit_is_read_back_for_its_model_only(profiles):
    a, b = profiles
    path = _store_refit(a, launch_s=9e-6)
    back = load_refit(TOPO.fingerprint(), **_key(a))
    assert back is not None and back.path == path and back.factors["launch_s"] == 9e-6 and back.fitted_runs == 4
    assert load_refit(TOPO.fingerprint(), **_key(b)) is None
    assert calibration_for(TOPO, profile=a).launch_s == 9e-6
    assert calibration_for(TOPO, profile=b) == calibration_for(TOPO)  # B: the hardware's, not A's refit


def test_a_refit_file_copied_to_another_models_name_is_refused(profiles):
    a, b = profiles
    src = _store_refit(a, launch_s=9e-6)
    refit_path(TOPO.fingerprint(), **_key(b)).write_bytes(src.read_bytes())
    with pytest.raises(CacheError, match="holds the refit of another job .*model_fingerprint"):
        load_refit(TOPO.fingerprint(), **_key(b))
    with pytest.warns(UserWarning, match="was not used .*predicting without it"):  # planning: said, not silent
        assert calibration_for(TOPO, profile=b) == calibration_for(TOPO)


def test_a_topology_file_of_version_5_which_may_hold_a_leaked_refit_is_ignored():
    path = save_calibration(Calibration(launch_s=4.5e-3), TOPO.fingerprint())
    data = yaml.safe_load(path.read_text())
    data["version"] = 5
    path.write_text(yaml.safe_dump(data))
    assert CALIBRATION_VERSION > 5
    with pytest.warns(UserWarning, match="another version of autopar's cost model"):
        assert calibration_for(TOPO).launch_s != 4.5e-3


def test_a_cached_topology_calibration_in_use_is_logged_with_its_file_and_changes(autopar_log):
    default = calibration_for(TOPO)
    path = save_calibration(default.replace(memory_efficiency=0.3), TOPO.fingerprint())
    chosen = autopar.plan(_mlp(48), sample=_sample(), topology=TOPO)
    lines = [r.getMessage() for r in autopar_log.records if "calibration cached" in r.getMessage()]
    assert len(lines) == 1 and str(path) in lines[0] and f"memory_efficiency {default.memory_efficiency:.3g} -> 0.3" in lines[0]
    assert str(path) in chosen.prediction["calibration"]  # the plan says what it was predicted with


def test_a_cached_refit_in_use_is_logged_and_named_in_the_prediction(profiles, autopar_log):
    a, _ = profiles
    default = calibration_for(TOPO)
    # the plan's GEMMs run in fp32 on the CPU pseudo-device, so their rate is a factor that always counts
    slower = default.fp32_matmul_efficiency / 2
    path = _store_refit(a, fp32_matmul_efficiency=slower)
    plan = Plan(micro_batch_size=4)
    pred = autopar.predict(a, plan, topology=TOPO)
    autopar.predict(a, plan, topology=TOPO)  # a loop of predictions says it once
    lines = [r.getMessage() for r in autopar_log.records if "calibration cached" in r.getMessage()]
    assert len(lines) == 1 and str(path) in lines[0] and "this model's refit" in lines[0]
    assert f"fp32_matmul_efficiency {default.fp32_matmul_efficiency:.3g} -> {slower:.3g}" in lines[0]
    assert str(path) in pred.calibration_source
    assert pred.step_s > predict_profile(a, plan, TOPO, default).step_s


def test_planning_where_no_cache_folder_can_be_made_predicts_with_the_defaults(profiles, tmp_path, monkeypatch):
    """A cache root under a regular file (or a read-only HOME): reading the cache creates nothing, so planning goes on."""
    a, _ = profiles
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(blocker / "cache"))
    assert calibration_for(TOPO, profile=a) == calibration_for(TOPO)
    assert not (blocker / "cache").exists()


def test_a_refit_file_whose_factor_is_zero_is_skipped_with_a_warning(profiles):
    a, _ = profiles
    path = _store_refit(a, launch_s=9e-6)
    data = yaml.safe_load(path.read_text())
    data["factors"]["matmul_efficiency"] = 0.0
    path.write_text(yaml.safe_dump(data))
    with pytest.warns(UserWarning, match="positive finite"):
        cal = calibration_for(TOPO, profile=a)
    assert cal == calibration_for(TOPO)  # the hardware's, not a crash and not a zero efficiency
