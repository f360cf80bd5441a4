"""A model whose forward takes a gradient (a gradient penalty: torch.autograd.grad(..., create_graph=True) inside
forward, as WGAN-GP critics and physics-informed networks do). Under FSDP2 the inner backward runs the units'
post-backward hooks, which free the gathered weights that the outer backward reads (its first step raised
"setStorage: ... storage of size 0" on 2 gloo processes, with dp_shard=2 and dp_replicate=2 alike), and keeping the
weights gathered trained it wrong: so the trace finds that gradient, plans that manage the parameters with FSDP or
split the model into stages are refused in one line that says what to change, and one process trains it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autopar
from tests.strategies._refusal import FSDP_PLANS, refusal


class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.clone().requires_grad_(True)
        h = x
        for layer in self.layers:
            h = torch.tanh(layer(h))
        score = self.head(h)
        grad, = torch.autograd.grad(score.sum(), x, create_graph=True)
        return score.mean() + 10 * ((grad.norm(dim=1) - 1) ** 2).mean()


class Plain(Critic):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h).mean()


def test_the_trace_finds_where_the_forward_takes_a_gradient():
    profile = autopar.profile_model(Critic(), torch.randn(8, 8), warn=False)
    assert profile.differentiating_forward == "the forward of the modules after the blocks"
    assert autopar.profile_model(Plain(), torch.randn(8, 8), warn=False).differentiating_forward == ""


@pytest.mark.parametrize("fields", FSDP_PLANS)
def test_a_plan_that_uses_fsdp_is_refused_in_one_line(fields):
    text = refusal(Critic(), torch.randn(8, 8), fields)
    assert text.startswith("Critic takes a gradient in the forward of")
    assert "torch.autograd.grad" in text and "one process" in text


def test_planning_for_several_gpus_says_no_plan_can_train_it_and_one_gpu_plans_one_process():
    x = torch.randn(8, 8)
    with pytest.raises(autopar.InfeasiblePlanError) as info:
        autopar.plan(Critic(), sample=x, topology="8xH100-SXM")
    text = str(info.value)
    assert "\n" not in text and text.startswith("no plan can train Critic on 8 processes: Critic takes a gradient")
    assert not autopar.plan(Critic(), sample=x, topology="1xH200").uses_fsdp


def test_one_process_trains_it_as_the_plain_module_does(monkeypatch):
    monkeypatch.setenv("AUTOPAR_NO_WRAP_CACHE", "1")
    torch.manual_seed(0)
    reference = Critic()
    model = Critic()
    model.load_state_dict(reference.state_dict())
    model = autopar.wrap(model, sample=torch.randn(8, 8), verbose=False)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, model)]
    for step in range(3):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
        losses = []
        for m, opt in zip((reference, model), opts):
            loss = m(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    for a, b in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
