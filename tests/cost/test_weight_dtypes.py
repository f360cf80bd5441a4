"""Models whose weights are not float32: float64 (as scientific models train: PINNs, neural operators) and bf16
(weights the user cast). Their weights, gradients and Adam's moments are held in the weights' dtype (torch keeps
AdamW's state so), and autocast leaves float64 ops in float64: so a float64 model is planned in its own dtype
('fp32': no cast), its model states predicted at 8 bytes an element (they were predicted at 4, and the plan said
bf16), a bf16 plan given for it is refused in one line, and a bf16-weight model's states are predicted at 2 bytes
with no autocast copy of its weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.cost import Calibration
from autopar.cost.memory import predict_host_memory, predict_memory
from autopar.errors import PlanError
from autopar.plans import Plan
from autopar.profile import profile_model
from autopar.strategies.apply import check_plan


def _mlp(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(4)],
                         nn.Linear(256, 1)).to(dtype)


def _profile(dtype: torch.dtype):
    return profile_model(_mlp(dtype), torch.randn(64, 256, dtype=dtype), warn=False)


@pytest.mark.parametrize("plan", [Plan(micro_batch_size=64), Plan(dp_shard=2, micro_batch_size=32),
                                  Plan(micro_batch_size=64, cpu_offload=True)])
@pytest.mark.parametrize("dtype, ratio", [(torch.float64, 2.0), (torch.bfloat16, 0.5)])
def test_model_states_are_held_in_the_weights_dtype(plan, dtype, ratio):
    base, other = predict_memory(_profile(torch.float32), plan, Calibration()), \
        predict_memory(_profile(dtype), plan, Calibration())
    for term in ("parameters_bytes", "gradients_bytes", "optimizer_bytes"):
        assert getattr(other, term) == pytest.approx(getattr(base, term) * ratio, rel=1e-9), term
    if plan.cpu_offload:
        host = [predict_host_memory(_profile(d), plan, ranks_per_node=1).offloaded_bytes_per_rank
                for d in (torch.float32, dtype)]
        assert host[1] == pytest.approx(host[0] * ratio, rel=1e-9)


def test_a_bf16_plan_copies_float32_weights_only():
    """Without FSDP, bf16 autocast keeps a bf16 copy of each float32 weight a forward used; bf16 weights need none,
    and float64 ones are not cast."""
    from autopar.cost.memory import _gathered_bytes, _RankParams

    plan, rp = Plan(micro_batch_size=64, precision="bf16"), _RankParams(params=1000.0, trainable=1000.0, outside=0.0,
                                                                       largest_unit=250.0)
    assert [_gathered_bytes(plan, rp, [0], 2.0, elem) for elem in (4.0, 2.0, 8.0)] == [2000.0, 0.0, 0.0]


def test_a_float64_model_is_planned_in_float64_and_a_bf16_plan_is_refused():
    x = torch.randn(1024, 256, dtype=torch.float64)
    plan = autopar.plan(_mlp(torch.float64), sample=x, topology="1xH200")
    assert plan.precision == "fp32"
    assert autopar.plan(_mlp(torch.float32), sample=x.float(), topology="1xH200").precision == "bf16"
    profile = _profile(torch.float64)
    with pytest.raises(PlanError) as info:
        check_plan(Plan(micro_batch_size=64, precision="bf16"), profile, autopar.Topology.from_spec("1xH200"),
                   world_size=1)
    text = str(info.value)
    assert "\n" not in text and "weights are float64" in text and "precision='fp32'" in text


def test_a_float64_step_is_predicted_slower_than_its_float32_twin():
    x = torch.randn(1024, 256)
    plan = Plan(micro_batch_size=1024)
    times = [autopar.predict(_mlp(d), plan, sample=x.to(d), topology="1xH200").step_s
             for d in (torch.float32, torch.float64)]
    assert times[1] > times[0]
