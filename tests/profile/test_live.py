"""The trace's replay of live memory (autopar.profile.live) and the eager plans that read it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from autopar import Plan
from autopar.cost.calibration import Calibration
from autopar.cost.memory import predict_memory
from autopar.profile import profile_model
from autopar.profile.live import LiveMemory, _pareto


class _Head(nn.Module):
    """A large output (the logits) that the loss reduces to a scalar without saving it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(32, 64)
        self.head = nn.Linear(64, 4096)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def test_a_storage_counts_once_and_is_seen_freed_when_its_last_view_dies():
    live = LiveMemory()
    a = torch.zeros(1000)
    view = a[:10]
    live.allocated(a, "zeros")
    live.allocated(view, "slice")  # the same storage
    assert live.num_allocations == 1
    del a
    b = torch.ones(500)
    live.allocated(b, "ones")
    assert live.frontier([]) == ((4000 + 2000, 0),)  # a still alive through its view
    del view
    c = torch.ones(250)
    live.allocated(c, "ones")
    assert max(o for o, _ in live.frontier([])) == 6000  # a freed before c: 2000 + 1000 after
    assert live.frontier([c]) == ((6000, 0), (2000, 1000))


def test_the_frontier_keeps_only_points_no_other_point_covers():
    assert _pareto([(5, 0), (3, 1), (4, 1), (1, 1), (0, 7), (5, 0)]) == ((5, 0), (4, 1), (0, 7))


def test_the_gradients_alive_at_the_end_are_every_trainable_parameters_gradient():
    model = _Head()
    profile = profile_model(model, torch.zeros(8, 32), warn=False, graphs=False)
    grads = 4 * sum(p.numel() for p in model.parameters())
    assert max(g for _, g in profile.live_frontier) == grads


def test_the_models_output_is_freed_before_backward_unless_the_loss_saved_it():
    """loss = loss_fn(model(x)): the logits a sum reduces are not kept through backward (4096 x 8 x 4 bytes)."""
    model = _Head()
    profile = profile_model(model, torch.zeros(8, 32), loss_fn=lambda out, _: out.sum(), warn=False, graphs=False)
    logits = 8 * 4096 * 4
    peak = max(o for o, _ in profile.live_frontier)
    assert logits <= peak < 2 * logits  # the logits exist once (forward), not beside their gradient


def test_an_eager_plan_reads_the_replay_and_scales_it_with_the_micro_batch():
    model = _Head()
    profile = profile_model(model, torch.zeros(8, 32), warn=False, graphs=False)
    cal = Calibration()
    one = predict_memory(profile, Plan(micro_batch_size=8), cal)
    two = predict_memory(profile, Plan(micro_batch_size=16), cal)
    expected = max(2 * o + 4 * profile.num_params * g / max(gg for _, gg in profile.live_frontier)
                   for o, g in profile.live_frontier)
    assert two.activations_bytes + two.gradients_bytes == pytest.approx(expected)
    assert one.transient_bytes == 0.0
    rule = predict_memory(dataclasses.replace(profile, live_frontier=()), Plan(micro_batch_size=8), cal)
    assert rule.transient_bytes > 0  # without the replay: the moments' rule, logits as the transient
    for plan in (Plan(micro_batch_size=8, compile=True), Plan(micro_batch_size=8, checkpointing="full")):
        without = predict_memory(dataclasses.replace(profile, live_frontier=()), plan, cal)
        assert predict_memory(profile, plan, cal) == without  # compiled, checkpointed plans keep the rule
