"""Every zoo family plans at its realistic size (meta device) for one H200 and for 8 H100s (issue 10's CPU
must-show): `autopar.plan` and `autopar.predict` succeed, and the predicted step lies between 1x and 10x the
time the step's traced FLOPs take at the topology's peak.

The peak is the one autopar's MFU divides by (autopar/cost/__init__.py, predict_profile): the device's bf16
peak (fp32 where it has no bf16) times the plan's GPUs. The FLOPs are the fp32 trace's forward and backward
FLOPs (ModelProfile.flops) per sample times the plan's global batch: the work the model does, without the
recomputation a checkpointing plan adds (which only makes the ratio larger).
"""

from __future__ import annotations

from functools import lru_cache

import pytest

import autopar
from autopar import ModelProfile, Topology
from bench.zoo import ZOO, Family, build_model, family, make_sample

pytestmark = pytest.mark.zoo

TOPOLOGIES = ("1xH200", "8xH100-SXM")
RATIO_RANGE = (1.0, 10.0)


@lru_cache(maxsize=1)
def _profile(name: str) -> ModelProfile:
    """The fp32 trace of one family at its realistic size (the tests of one family run one after another)."""
    f = family(name)
    return autopar.profile_model(build_model(f, "realistic"), make_sample(f, "realistic"), loss_fn=f.loss_fn,
                                 warn=False)


def peak_time_ratio(step_s: float, profile: ModelProfile, plan: autopar.Plan, topology: Topology) -> float:
    """Predicted step time over the time the step's traced FLOPs take at the world's peak."""
    device = topology.device
    peak = device.peak_flops("bf16" if device.supports("bf16") else "fp32") * plan.world_size
    flops = profile.flops_per_sample * plan.global_batch_size
    return step_s / (flops / peak)


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("family_", ZOO, ids=[f.name for f in ZOO])
def test_realistic_model_plans_and_its_prediction_is_near_its_flops(family_: Family, topology: str,
                                                                    record_property):
    why = family_.unavailable()
    if why is not None:
        pytest.skip(why)
    model = build_model(family_, "realistic")
    sample = make_sample(family_, "realistic")
    assert all(p.is_meta for p in model.parameters())

    plan = autopar.plan(model, sample=sample, topology=topology, loss_fn=family_.loss_fn)
    prediction = autopar.predict(model, plan, sample=sample, topology=topology, loss_fn=family_.loss_fn)

    ratio = peak_time_ratio(prediction.step_s, _profile(family_.name), plan, Topology.from_spec(topology))
    record_property("peak_time_ratio", f"{ratio:.3g}")  # for the zoo's report (pytest --junitxml)
    low, high = RATIO_RANGE
    assert low <= ratio <= high, (
        f"predicted step {prediction.step_s * 1e3:.1f} ms is {ratio:.2f}x the step's FLOPs at peak (want {low:g}x "
        f"to {high:g}x); plan: micro-batch {plan.micro_batch_size}, {plan.precision}, {plan.checkpointing} "
        f"checkpointing, compile={plan.compile}, dp_shard={plan.dp_shard}, tp={plan.tp}, pp={plan.pp}")
