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
    assert live.frontier([]) == ((4000 + 2000, 0, 0),)  # a still alive through its view
    del view
    c = torch.ones(250)
    live.allocated(c, "ones")
    assert max(o for o, _, _ in live.frontier([])) == 6000  # a freed before c: 2000 + 1000 after
    assert live.frontier([c]) == ((6000, 0, 0), (2000, 1000, 0))


def test_the_weights_casts_are_summed_apart_and_die_as_they_do():
    live = LiveMemory()
    cast = torch.zeros(100)
    live.allocated(cast, "_to_copy", counted=False)
    act = torch.zeros(50)
    live.allocated(act, "mm")
    del cast
    grad = torch.zeros(200)
    live.allocated(grad, "mm")
    assert set(live.frontier([grad])) == {(200, 0, 400), (200, 800, 0)}  # the copy gone before the gradient came


def test_the_frontier_keeps_only_points_no_other_point_covers():
    points = [(5, 0, 0), (3, 1, 0), (4, 1, 0), (1, 1, 0), (0, 7, 0), (5, 0, 0), (1, 1, 3), (0, 7, 1), (0, 6, 2)]
    assert _pareto(points) == ((5, 0, 0), (4, 1, 0), (1, 1, 3), (0, 7, 1), (0, 6, 2))


def test_the_gradients_alive_at_the_end_are_every_trainable_parameters_gradient():
    model = _Head()
    profile = profile_model(model, torch.zeros(8, 32), warn=False, graphs=False)
    grads = 4 * sum(p.numel() for p in model.parameters())
    assert max(g for _, g, _ in profile.live_frontier) == grads


def test_the_models_output_is_freed_before_backward_unless_the_loss_saved_it():
    """loss = loss_fn(model(x)): the logits a sum reduces are not kept through backward (4096 x 8 x 4 bytes)."""
    model = _Head()
    profile = profile_model(model, torch.zeros(8, 32), loss_fn=lambda out, _: out.sum(), warn=False, graphs=False)
    logits = 8 * 4096 * 4
    peak = max(o for o, _, _ in profile.live_frontier)
    assert logits <= peak < 2 * logits  # the logits exist once (forward), not beside their gradient


def test_an_eager_plan_reads_the_replay_and_scales_it_with_the_micro_batch():
    model = _Head()
    profile = profile_model(model, torch.zeros(8, 32), warn=False, graphs=False)
    cal = Calibration()
    one = predict_memory(profile, Plan(micro_batch_size=8), cal)
    two = predict_memory(profile, Plan(micro_batch_size=16), cal)
    expected = max(2 * o + 4 * profile.num_params * g / max(gg for _, gg, _ in profile.live_frontier)
                   for o, g, _ in profile.live_frontier)
    assert two.activations_bytes + two.gradients_bytes == pytest.approx(expected)
    assert one.transient_bytes == 0.0
    rule = predict_memory(dataclasses.replace(profile, live_frontier=()), Plan(micro_batch_size=8), cal)
    assert rule.transient_bytes > 0  # without the replay: the moments' rule, logits as the transient
    for plan in (Plan(micro_batch_size=8, compile=True), Plan(micro_batch_size=8, checkpointing="full")):
        without = predict_memory(dataclasses.replace(profile, live_frontier=()), plan, cal)
        assert predict_memory(profile, plan, cal) == without  # compiled, checkpointed plans keep the rule


class _Deep(nn.Module):
    """Equal layers with a small batch: the weights' bf16 copies outweigh the activations."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(256, 256) for _ in range(6)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def test_a_bf16_eager_plan_counts_the_casts_alive_at_its_peak_not_all_of_them():
    """Under autocast each weight's bf16 copy dies after its GEMMs' backward, as its gradient appears: the copies
    and the gradients are never all alive at once (the H200's MLP and Mixtral: every copy counted beside every
    gradient over-predicted their peaks by 0.8 and 5.9 GiB)."""
    profile = profile_model(_Deep(), torch.zeros(4, 256), precision="bf16", warn=False, graphs=False)
    weights = sum(256 * 256 for _ in range(6))
    assert max(c for _, _, c in profile.live_frontier) >= 2 * weights  # every copy alive once (end of forward)
    cal, plan = Calibration(), Plan(micro_batch_size=4, precision="bf16")
    eager = predict_memory(profile, plan, cal)
    old = dataclasses.replace(profile, live_frontier=tuple((o, g, None) for o, g, _ in profile.live_frontier))
    everything = predict_memory(old, plan, cal)  # a profile from before: every cast alive throughout
    assert everything.gathered_bytes == pytest.approx(2 * profile.num_params)
    assert eager.gathered_bytes < everything.gathered_bytes
    assert eager.allocated_bytes < everything.allocated_bytes
    at_peak = [p for p in profile.live_frontier if p[2] == eager.gathered_bytes]
    assert at_peak, "the copies counted are those of one moment of the trace"


def test_an_fsdp_plan_counts_its_gathered_units_not_the_traced_casts():
    profile = profile_model(_Deep(), torch.zeros(4, 256), precision="bf16", warn=False, graphs=False)
    old = dataclasses.replace(profile, live_frontier=tuple((o, g, None) for o, g, _ in profile.live_frontier))
    plan, cal = Plan(micro_batch_size=4, precision="bf16", dp_shard=2), Calibration()
    variants = {"bf16": profile, "bf16-pure": profile}
    assert predict_memory(profile, plan, cal, variants=variants).gathered_bytes == \
        predict_memory(old, plan, cal, variants={"bf16": old, "bf16-pure": old}).gathered_bytes


def test_a_frontier_written_as_pairs_reads_back_with_no_cast_figure():
    from autopar.profile import ModelProfile
    profile = profile_model(_Head(), torch.zeros(8, 32), warn=False, graphs=False)
    data = profile.to_dict()
    data["live_frontier"] = [[o, g] for o, g, _ in profile.live_frontier]
    assert all(c is None for _, _, c in ModelProfile.from_dict(data).live_frontier)
    assert ModelProfile.from_dict(profile.to_dict()).live_frontier == profile.live_frontier
