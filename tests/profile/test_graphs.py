"""autopar.profile.graphs: dynamo's own count of the forward's graphs, and what the search does with it."""

import torch
import torch.nn as nn

from autopar.profile import profile_model
from autopar.profile.graphs import GraphCount, dynamo_graphs
from autopar.search import enumerate_plans
from autopar.topology import Topology

H200 = Topology.from_spec("1xH200")


class _Broken(nn.Module):
    """A forward dynamo cuts in two (what a `torch.compiler.disable`d helper or an untraceable call does)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.a(x))
        torch._dynamo.graph_break()
        return self.b(x)


def _plain() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _on_meta(build) -> nn.Module:
    with torch.device("meta"):
        return build()


def _compiled_plans(profile, **kw) -> int:
    return sum(p.compile for p in enumerate_plans(profile, H200, world_size=1, global_batch_size=8, **kw))


def test_dynamo_counts_the_graphs_of_a_meta_model():
    x = torch.randn(8, 16)
    broken = dynamo_graphs(_on_meta(_Broken), x)
    assert broken == GraphCount(num_graphs=2, break_reasons=broken.break_reasons) and broken.num_breaks == 1
    assert any("graph_break" in r for r in broken.break_reasons)
    assert dynamo_graphs(_on_meta(_plain), x).num_breaks == 0


def test_a_real_model_on_a_cpu_is_not_probed():
    """A real forward on a CPU can take minutes at a realistic size: not known, rather than slow."""
    assert dynamo_graphs(_Broken(), torch.randn(8, 16)) is None


def test_a_forward_dynamo_cuts_is_offered_compiled_plans_only_when_measured():
    x = torch.randn(8, 16)
    broken = profile_model(_on_meta(_Broken), x, warn=False)
    plain = profile_model(_on_meta(_plain), x, warn=False)
    assert broken.graph_breaks == 1 and plain.graph_breaks == 0
    assert any("2 graphs" in n and "graph_break" in n for n in broken.notes)
    assert not any("graphs" in n for n in plain.notes)
    assert _compiled_plans(broken) == 0 and list(enumerate_plans(broken, H200, world_size=1, global_batch_size=8))
    assert _compiled_plans(broken, measured=True) > 0 and _compiled_plans(broken, eager=False) > 0
    assert _compiled_plans(plain) > 0


def test_graphs_false_leaves_the_count_unknown():
    profile = profile_model(_on_meta(_Broken), torch.randn(8, 16), warn=False, graphs=False)
    assert profile.graph_breaks is None and _compiled_plans(profile) > 0


class _Noisy(nn.Module):
    """A training forward that changes state: BatchNorm's running statistics and dropout's random draws."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm, self.drop = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.norm(self.conv(x)))


def test_a_real_forward_leaves_the_buffers_and_the_random_stream_as_it_found_them():
    torch.manual_seed(0)
    model, x = _Noisy().train(), torch.randn(2, 3, 8, 8)
    before = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.get_rng_state()
    assert dynamo_graphs(model, x, real_cpu=True).num_breaks == 0
    assert all(torch.equal(before[n], b) for n, b in model.named_buffers())
    assert torch.equal(torch.get_rng_state(), rng)
    model(x)  # the same forward, run for real, does change them (what the check above would catch)
    assert not torch.equal(before["norm.running_mean"], model.norm.running_mean)
