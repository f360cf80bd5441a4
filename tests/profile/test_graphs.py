"""autopar.profile.graphs: dynamo's own count of the forward's graphs, and what the search does with it."""

import pytest
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
    assert broken == GraphCount(num_graphs=2, break_reasons=broken.break_reasons, break_sites=broken.break_sites)
    assert broken.num_breaks == 1 and broken.break_sites
    assert any("graph_break" in r for r in broken.break_reasons)
    assert dynamo_graphs(_on_meta(_plain), x).num_breaks == 0


def test_a_real_model_on_a_cpu_is_not_probed():
    """A real forward on a CPU can take minutes at a realistic size: not known, rather than slow."""
    assert dynamo_graphs(_Broken(), torch.randn(8, 16)) is None


class _Layer(nn.Module):
    def __init__(self, cut: bool) -> None:
        super().__init__()
        self.a, self.b, self.cut = nn.Linear(16, 16), nn.Linear(16, 16), cut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.a(x))
        if self.cut:  # a break in the block's forward: it recurs in every block
            torch._dynamo.graph_break()
        return self.b(x) + x


class _Stack(nn.Module):
    """Six same-structure layers; dynamo cut in every layer, or once before the layers, or not at all."""

    def __init__(self, *, cut_layers: bool = False, cut_before: bool = False, depth: int = 6) -> None:
        super().__init__()
        self.embed, self.head, self.cut_before = nn.Linear(16, 16), nn.Linear(16, 4), cut_before
        self.layers = nn.ModuleList(_Layer(cut_layers) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        if self.cut_before:  # what a mask helper dynamo does not trace does (HF GPT-2 in transformers 5.17)
            torch._dynamo.graph_break()
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_a_forward_dynamo_cuts_inside_its_blocks_is_offered_compiled_plans_only_when_measured():
    x = torch.randn(8, 16)
    cut = profile_model(_on_meta(lambda: _Stack(cut_layers=True)), x, warn=False)
    plain = profile_model(_on_meta(_Stack), x, warn=False)
    assert cut.graph_breaks == 1 and cut.graph_breaks_in_blocks is True
    assert plain.graph_breaks == 0 and plain.graph_breaks_in_blocks is False
    assert any("2 graphs" in n and "inside the blocks" in n and "autopar tune" in n for n in cut.notes)
    assert not any("graphs" in n for n in plain.notes)
    assert _compiled_plans(cut) == 0 and list(enumerate_plans(cut, H200, world_size=1, global_batch_size=8))
    assert _compiled_plans(cut, measured=True) > 0 and _compiled_plans(cut, eager=False) > 0
    assert _compiled_plans(plain) > 0


def test_a_break_outside_the_blocks_leaves_compiled_plans_offered():
    """The blocks compile whole: GPT-2's one break before its layers kept it eager at 0.44x its compiled speed."""
    x = torch.randn(8, 16)
    before = profile_model(_on_meta(lambda: _Stack(cut_before=True)), x, warn=False)
    assert before.graph_breaks == 1 and before.graph_breaks_in_blocks is False
    assert any("outside the blocks" in n for n in before.notes)
    assert _compiled_plans(before) > 0
    root = profile_model(_on_meta(_Broken), x, warn=False)  # no repeated blocks: its units are its two Linears
    assert root.graph_breaks == 1 and root.graph_breaks_in_blocks is False and _compiled_plans(root) > 0


def test_breaks_whose_place_is_not_known_count_as_inside_the_blocks():
    count = GraphCount(num_graphs=3)
    assert count.in_forward_of([_Layer(cut=True)]) is None
    elsewhere = (("/nowhere/model.py", 3),)
    assert GraphCount(num_graphs=3, break_sites=(elsewhere, ())).in_forward_of([_Layer(cut=True)]) is None
    assert GraphCount(num_graphs=3, break_sites=(elsewhere, elsewhere)).in_forward_of([_Layer(cut=True)]) is False
    assert GraphCount(num_graphs=1).in_forward_of([_Layer(cut=True)]) is False


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


class _Indexed(_Stack):
    """Reads its layers by index up to a fixed depth: with fewer layers in place its forward fails."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for i in range(16):  # as many as it was built with (test: depth=16)
            x = self.layers[i](x)
        return self.head(x)


class _EncoderDecoder(nn.Module):
    """Two stacks of layers, an encoder's and a decoder's, cut in every layer of the second where asked."""

    def __init__(self, *, encoder: int = 8, decoder: int = 8, cut_decoder: bool = False) -> None:
        super().__init__()
        self.encoder = nn.ModuleList(_Layer(False) for _ in range(encoder))
        self.decoder = nn.ModuleList(_Layer(cut_decoder) for _ in range(decoder))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.encoder:
            x = layer(x)
        for layer in self.decoder:
            x = layer(x)
        return x


def test_a_deep_stack_is_counted_at_depths_one_and_two_and_extended(monkeypatch):
    """dynamo unrolls the loop over the blocks (its time grows with the depth): a deep stack of one class (8 blocks
    in all at least) is captured with its first block, then its first two, and the count extended; the count is the
    full-depth one, and the model keeps its own container. A shallower stack, and a forward that cannot run with
    fewer blocks, are captured at full depth."""
    import autopar.profile.graphs as graphs

    x, meta = torch.randn(8, 16), torch.device("meta")
    depths, real = [], graphs._explained

    def explained(model, *args):
        depths.append(len(model.layers))
        return real(model, *args)

    monkeypatch.setattr(graphs, "_explained", explained)
    for kw in ({"cut_layers": True}, {"cut_before": True}, {}):
        model = _on_meta(lambda: _Stack(depth=16, **kw))
        layers = model.layers
        depths.clear()
        shallow = dynamo_graphs(model, x, blocks_path="layers")
        assert depths == [1, 2] and model.layers is layers and len(layers) == 16
        assert shallow == real(model, x, meta, 3)  # the full-depth capture's count, reasons and sites
    depths.clear()
    assert dynamo_graphs(_on_meta(_Stack), x, blocks_path="layers").num_graphs == 1 and depths == [6]
    indexed = _on_meta(lambda: _Indexed(depth=16))
    depths.clear()
    assert dynamo_graphs(indexed, x, blocks_path="layers").num_graphs == 1 and depths == [1, 16]
    depths.clear()
    profile_model(_on_meta(lambda: _Stack(cut_layers=True, depth=16)), x, warn=False)  # the profile passes its container
    assert depths == [1, 2]


@pytest.mark.parametrize("encoder, decoder, captures", [(8, 8, 2), (12, 6, 3)])
def test_an_encoder_decoder_is_counted_shallow_over_both_stacks(monkeypatch, encoder, decoder, captures):
    """Blocks in two containers (T5's, Whisper's): both shortened at once; stacks of one length grow together (two
    captures), of different lengths one at a time (three); the count is the full-depth one, the decoder layers'
    breaks included; the profile finds both containers from its blocks' names."""
    import autopar.profile.graphs as graphs

    x, meta = torch.randn(8, 16), torch.device("meta")
    seen, real = [], graphs._explained

    def explained(model, *args):
        seen.append((len(model.encoder), len(model.decoder)))
        return real(model, *args)

    monkeypatch.setattr(graphs, "_explained", explained)
    model = _on_meta(lambda: _EncoderDecoder(encoder=encoder, decoder=decoder, cut_decoder=True))
    shallow = dynamo_graphs(model, x, blocks_path=("encoder", "decoder"))
    assert len(seen) == captures and max(max(s) for s in seen) == 2
    assert (len(model.encoder), len(model.decoder)) == (encoder, decoder)
    full = real(model, x, meta, 3)
    assert shallow.num_graphs == full.num_graphs > 1  # the decoder's breaks counted as at full depth
    seen.clear()
    profile = profile_model(model, x, warn=False)
    assert len(seen) == captures and profile.graph_breaks == full.num_graphs - 1 and profile.graph_breaks_in_blocks
