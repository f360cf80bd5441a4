"""Every zoo family plans at its realistic size (meta device) for one H200 and for 8 H100s (issue 10's CPU
must-show): `autopar.plan` and `autopar.predict` succeed, and the predicted step lies between the time the
step's traced FLOPs take at the topology's peak (it cannot be faster) and 10x the step's roofline time.

The peak is the one autopar's MFU divides by (autopar/cost/__init__.py, predict_profile): the device's bf16
peak (fp32 where it has no bf16) times the plan's GPUs. The FLOPs are the trace's forward and backward FLOPs
(ModelProfile.flops) per sample times the plan's global batch: the work the model does, without the
recomputation a checkpointing plan adds (which only makes the ratio larger).

The roofline time is, over every op the trace records under the plan's precision, the larger of its FLOPs at
the peak of the dtype it runs in (bf16 tensor cores; plain fp32 for fp32 ops) and its bytes at the HBM
bandwidth, summed, per GPU. The issue asked for 10x the FLOPs at peak; that bound fails on the GPU itself:
on the H200 (bench/results/zoo_roofline_2026-12-02.txt, each family's latest wrap step) ResNet-50 measured
14.3x its FLOPs at peak, Swin 18.7x, wav2vec2 16.0x, Mixtral 16.4x and OLMoE 18.3x (their BatchNorm,
convolution and elementwise work is bound by memory or by the host; the MoE experts run fp32 GEMMs without
tensor cores), while every measured family ran within 0.75x (compiled: fusion removes bytes) to 6.0x
(wav2vec2, host-bound) its roofline. A prediction 30x-800x off, as issue 10 saw, still fails this bound.
"""

from __future__ import annotations

from functools import lru_cache

import pytest

import autopar
from autopar import ModelProfile, Topology
from autopar.errors import TraceError
from bench.zoo import ZOO, Family, build_model, family, make_sample, roofline_s

pytestmark = pytest.mark.zoo

# Families autopar cannot trace yet (issue 33, item 3): plan falls back to the structure's safe plan, predict raises.
KNOWN_TRACE_FAILURES: dict[str, str] = {}  # none now: VideoMAE's plain tensor attribute is traced (fake copy)


def _families() -> list:
    return [pytest.param(f, id=f.name, marks=pytest.mark.xfail(strict=True, raises=TraceError,
                                                               reason=KNOWN_TRACE_FAILURES[f.name]))
            if f.name in KNOWN_TRACE_FAILURES else pytest.param(f, id=f.name) for f in ZOO]

TOPOLOGIES = ("1xH200", "8xH100-SXM")
LOWEST_PEAK_RATIO = 1.0  # predicted step over the FLOPs at peak, at least
HIGHEST_ROOFLINE_RATIO = 10.0  # predicted step over the roofline time, at most


@lru_cache(maxsize=2)
def _profile(name: str, precision: str) -> ModelProfile:
    """The trace of one family at its realistic size under `precision` (the tests of one family run one after
    another)."""
    f = family(name)
    return autopar.profile_model(build_model(f, "realistic"), make_sample(f, "realistic"), loss_fn=f.loss_fn,
                                 precision=precision, warn=False, graphs=False)


def peak_time_ratio(step_s: float, profile: ModelProfile, plan: autopar.Plan, topology: Topology) -> float:
    """Predicted step time over the time the step's traced FLOPs take at the world's peak."""
    device = topology.device
    peak = device.peak_flops("bf16" if device.supports("bf16") else "fp32") * plan.world_size
    flops = profile.flops_per_sample * plan.global_batch_size
    return step_s / (flops / peak)


def roofline_ratio(step_s: float, profile: ModelProfile, plan: autopar.Plan, topology: Topology) -> float:
    """Predicted step time over the roofline time of one GPU's share of the global batch."""
    share = plan.global_batch_size / plan.world_size / profile.sample_batch_size
    return step_s / (roofline_s(profile, topology.device) * share)


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("family_", _families())
def test_realistic_model_plans_and_its_prediction_is_within_its_roofline(family_: Family, topology: str,
                                                                         record_property):
    why = family_.unavailable()
    if why is not None:
        pytest.skip(why)
    model = build_model(family_, "realistic")
    sample = make_sample(family_, "realistic")
    assert all(p.is_meta for p in model.parameters())

    plan = autopar.plan(model, sample=sample, topology=topology, loss_fn=family_.loss_fn)
    prediction = autopar.predict(model, plan, sample=sample, topology=topology, loss_fn=family_.loss_fn)

    profile = _profile(family_.name, "fp32" if plan.precision == "fp32" else "bf16")
    assert profile.op_groups, "the trace recorded no ops"
    topo = Topology.from_spec(topology)
    ratio = peak_time_ratio(prediction.step_s, profile, plan, topo)
    roof_ratio = roofline_ratio(prediction.step_s, profile, plan, topo)
    record_property("peak_time_ratio", f"{ratio:.3g}")  # for the zoo's report (pytest --junitxml)
    record_property("roofline_ratio", f"{roof_ratio:.3g}")
    plan_words = (f"plan: micro-batch {plan.micro_batch_size}, {plan.precision}, {plan.checkpointing} "
                  f"checkpointing, compile={plan.compile}, dp_shard={plan.dp_shard}, tp={plan.tp}, pp={plan.pp}")
    assert ratio >= LOWEST_PEAK_RATIO, (
        f"predicted step {prediction.step_s * 1e3:.1f} ms is {ratio:.2f}x the step's FLOPs at peak (want at least "
        f"{LOWEST_PEAK_RATIO:g}x); {plan_words}")
    assert roof_ratio <= HIGHEST_ROOFLINE_RATIO, (
        f"predicted step {prediction.step_s * 1e3:.1f} ms is {roof_ratio:.2f}x the step's roofline time (want at "
        f"most {HIGHEST_ROOFLINE_RATIO:g}x); {plan_words}")
