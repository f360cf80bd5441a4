"""The calibration refit of a study (autopar/tune/refit.py, and the engine's saving of it): a refit out of bounds is
neither kept nor saved, and says why in one line; a refit within them is saved for its model only, so another
model on the same hardware predicts as before (issue 11, item 7: a slow script's study refit a calibration 100x
off, and every later prediction on that hardware with it)."""

from __future__ import annotations

import math
import types

import optuna
import pytest

import autopar
from autopar.calibration_cache import load_calibration, load_refit
from autopar.cost import predict_profile
from autopar.models.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens
from autopar.plan_cache import sample_signature
from autopar.planning import calibration_for, profile_variants
from autopar.search import search
from autopar.topology import Topology
from autopar.tune import TrialResult
from autopar.tune.ledger import Measured
from autopar.tune.refit import StepModel
from autopar.tune.study import tune

WORLD, GLOBAL = 2, 8
TOPO = Topology.cpu(WORLD)
CFG_A = GPTConfig(vocab_size=128, seq_len=32, num_layers=4, hidden_dim=64, num_heads=4)
CFG_B = GPTConfig(vocab_size=128, seq_len=32, num_layers=2, hidden_dim=32, num_heads=2)


@pytest.fixture(autouse=True)
def _quiet_optuna():
    optuna.logging.set_verbosity(optuna.logging.WARNING)


def _probe(cfg):
    profile, variants = profile_variants(GPT(cfg), synthetic_tokens(GLOBAL // WORLD, cfg), TOPO, loss_fn=lm_loss)
    return types.SimpleNamespace(profile=profile, variants=variants, topology=TOPO, world_size=WORLD,
                                 global_batch_size=GLOBAL, model_fingerprint=profile.fingerprint, cfg=cfg)


@pytest.fixture(scope="module")
def model_a():
    return _probe(CFG_A)


@pytest.fixture(scope="module")
def model_b():
    return _probe(CFG_B)


def _plans(probe, n):
    ranked = search(probe.profile, TOPO, world_size=WORLD, global_batch_size=GLOBAL, variants=probe.variants,
                    calibration=calibration_for(TOPO))
    return [c.plan for c in ranked if c.feasible][:n]


def _predicted(probe, plan, cal=None):
    return predict_profile(probe.profile, plan, TOPO, cal or calibration_for(TOPO), variants=probe.variants).step_s


class Runner:
    """A fake trial runner: each plan "measures" its predicted step (default calibration) times `factor`."""

    def __init__(self, probe, factor):
        self.probe, self.factor = probe, factor

    def __call__(self, argv, plan, *, steps, warmup, timeout_s, env=None, workdir=None):
        step = _predicted(self.probe, plan) * self.factor
        return TrialResult(status="ok", plan=plan, step_s=step, tokens_per_s=GLOBAL * self.probe.cfg.seq_len / step,
                           samples_per_s=GLOBAL / step, peak_allocated_bytes=(), peak_reserved_bytes=(), wall_s=0.01,
                           cause=None, returncode=0, log_tail="")


def _study(probe, factor, tmp_path, trials=4):
    return tune(["python", "train.py"], study_path=tmp_path / "s.db", runner=Runner(probe, factor),
                prober=lambda argv, **_: probe, trials=trials, steps=3, warmup=1, prune_factor=math.inf)


def _step_model(probe, plans):
    return StepModel(probe.profile, TOPO, probe.variants, {p.key(): p for p in plans}, calibration_for(TOPO))


def _records(probe, plans, factor):
    return [Measured(p.key(), i, _predicted(probe, p) * factor, 1.0) for i, p in enumerate(plans)]


# ---- the refit itself ------------------------------------------------------------------------------------
def test_a_refit_of_steps_100x_the_modelled_is_rejected_naming_the_factor_and_cause(model_a):
    plans = _plans(model_a, 3)
    fitted = _step_model(model_a, plans).refit(_records(model_a, plans, 100.0))
    assert not fitted.accepted and fitted.calibration == calibration_for(TOPO)  # the start is kept
    why = fitted.rejection
    assert why is not None and why.problem.value == "out of bounds"
    assert why.message().startswith(f"calibration refit not stored: {why.factor} fitted to")
    assert "data loading, a host-bound loop" in why.message()


def test_a_refit_within_bounds_is_kept(model_a):
    plans = _plans(model_a, 3)
    fitted = _step_model(model_a, plans).refit(_records(model_a, plans, 2.0))
    assert fitted.accepted and fitted.rejection is None and fitted.error_after < 0.05


# ---- what a study saves, and what another model then predicts --------------------------------------------
def test_a_slow_scripts_study_changes_no_later_prediction_for_another_model(model_a, model_b, tmp_path):
    """The issue's case: a study whose measured steps are 100x the modelled (a data-loading-bound script)."""
    plan_b = _plans(model_b, 1)[0]
    before = autopar.predict(model_b.profile, plan_b, topology=TOPO, variants=model_b.variants).step_s
    with pytest.warns(UserWarning, match="calibration refit not stored: .* fitted to .* is outside"):
        report = _study(model_a, 100.0, tmp_path)
    assert not report.fit_accepted and "calibration refit not stored" in report.table()
    assert load_calibration(TOPO.fingerprint()) is None  # nothing saved for the hardware
    assert load_refit(TOPO.fingerprint(), model_fingerprint=model_a.profile.fingerprint,
                      sample_signature=sample_signature(model_a.profile)) is None  # nor for the model
    after = autopar.predict(model_b.profile, plan_b, topology=TOPO, variants=model_b.variants).step_s
    assert after == before


def test_a_refit_of_model_a_is_not_inherited_by_model_b_on_the_same_hardware(model_a, model_b, tmp_path):
    plan_a, plan_b = _plans(model_a, 1)[0], _plans(model_b, 1)[0]
    report = _study(model_a, 2.0, tmp_path)  # A's script runs 2x slower than modelled: a refit within bounds
    assert report.fit_accepted
    # B predicts with the hardware's calibration (the defaults here), not A's refit ...
    b = autopar.predict(model_b.profile, plan_b, topology=TOPO, variants=model_b.variants).step_s
    assert b == _predicted(model_b, plan_b)
    # ... while A predicts with its refit
    a = autopar.predict(model_a.profile, plan_a, topology=TOPO, variants=model_a.variants).step_s
    assert a == pytest.approx(2.0 * _predicted(model_a, plan_a), rel=0.05)
