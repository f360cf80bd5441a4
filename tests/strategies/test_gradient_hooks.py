"""Gradient hooks a user put on parameters (Tensor.register_hook: scaling or clamping a gradient;
register_post_accumulate_grad_hook: an optimizer stepped inside backward). FSDP2 replaces every parameter with its
shard and sets the shard's gradient itself after the reduce-scatter, so such hooks are dropped: on 2 gloo ranks a
hook halving the gradients never ran under dp_shard=2 or dp_replicate=2, and the weights came out 0.034 from one
process's, silently (and an optimizer stepped by a hook would train nothing). So plans that use FSDP are refused in
one line that says what to do instead, also for hooks added after a cached profile; one process keeps them."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.errors import PlanError
from autopar.strategies.apply import check_plan
from tests.strategies._refusal import FSDP_PLANS, refusal


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def _hooked(post_accumulate: bool = False) -> nn.Module:
    net = _net()
    for p in net[2].parameters():
        if post_accumulate:
            p.register_post_accumulate_grad_hook(lambda t: None)
        else:
            p.register_hook(lambda g: g * 0.5)
    return net


@pytest.mark.parametrize("post_accumulate", [False, True])
@pytest.mark.parametrize("fields", FSDP_PLANS)
def test_a_plan_that_uses_fsdp_is_refused_in_one_line(fields, post_accumulate):
    model = _hooked(post_accumulate)
    profile = autopar.profile_model(model, torch.randn(8, 8), warn=False)
    assert profile.hooked_params == ("2.weight", "2.bias")
    text = refusal(model, None, fields, profile=profile)
    assert text.startswith("2.weight and 1 more of Sequential has a gradient hook")
    assert "optimizer.step" in text and "one process" in text


def test_a_hook_added_after_the_profile_is_found_on_the_model():
    model = _net()
    profile = autopar.profile_model(model, torch.randn(8, 8), warn=False)
    model[0].weight.register_hook(lambda g: g)
    with pytest.raises(PlanError, match="0.weight of Sequential has a gradient hook"):
        check_plan(autopar.Plan(dp_shard=2, micro_batch_size=4), profile, autopar.Topology.from_spec("2xH200"),
                   world_size=2, model=model)


def test_planning_for_several_gpus_says_no_plan_can_train_it_and_one_process_runs_the_hooks(monkeypatch):
    with pytest.raises(autopar.InfeasiblePlanError, match="no plan can train Sequential on 8 processes: 2.weight"):
        autopar.plan(_hooked(), sample=torch.randn(8, 8), topology="8xH100-SXM")
    monkeypatch.setenv("AUTOPAR_NO_WRAP_CACHE", "1")
    model = autopar.wrap(_hooked(), sample=torch.randn(8, 8), verbose=False)
    plain = _net()
    x = torch.randn(8, 8)
    model(x).square().mean().backward()
    plain(x).square().mean().backward()
    torch.testing.assert_close(model[2].weight.grad, plain[2].weight.grad * 0.5)
    torch.testing.assert_close(model[0].weight.grad, plain[0].weight.grad)
