"""autopar.strategies.materialize: meta tensors get storage and values, real ones are kept, and an
initialisation that misses a tensor is refused by name (issue 11, items 1 and 6)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.errors import MaterializeError
from autopar.strategies.materialize import materialize
from tests.distributed._launch import torchrun

CPU = torch.device("cpu")


class _Scaled(nn.Module):
    """A hand-written norm without reset_parameters, and a scale held by the root: no init covers them."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm_weight = nn.Parameter(torch.ones(8))
        self.register_buffer("scale", torch.full((1,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.norm_weight * self.scale


def test_a_model_partly_on_meta_keeps_its_real_weights():
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.BatchNorm1d(16))
    backbone[2].running_mean.fill_(0.5)  # as a pretrained one would have it
    real = {n: t.clone() for n, t in backbone.state_dict().items()}
    with torch.device("meta"):
        head = nn.Linear(16, 4)
    model = nn.Sequential(backbone, head)
    assert materialize(model, CPU, None)
    assert all(torch.equal(backbone.state_dict()[n], t) for n, t in real.items())  # not re-initialised
    assert not head.weight.is_meta and torch.isfinite(head.weight).all() and head.weight.std() > 0
    assert not materialize(model, CPU, None)  # nothing meta now


def test_init_fn_is_called_only_on_the_modules_that_held_meta_tensors():
    torch.manual_seed(0)
    backbone = nn.Linear(8, 8)
    before = backbone.weight.clone()
    with torch.device("meta"):
        head = nn.Linear(8, 2)
    seen = []

    def init_fn(module: nn.Module) -> None:
        seen.append(module)
        for p in module.parameters(recurse=False):
            p.fill_(0.25)

    model = nn.Sequential(backbone, head)
    materialize(model, CPU, init_fn)
    assert seen == [head] and torch.equal(backbone.weight, before) and torch.all(head.weight == 0.25)


def test_a_wholly_meta_model_with_tied_weights_is_tied_again():
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    materialize(model, CPU, None)
    assert model[1].weight is model[0].weight and torch.isfinite(model[0].weight).all()


def test_an_initialisation_that_misses_tensors_is_refused_by_name():
    with torch.device("meta"):
        model = _Scaled()
    with pytest.raises(MaterializeError, match="norm_weight.*scale|scale.*norm_weight") as info:
        materialize(model, CPU, None)
    assert "fc.weight" not in str(info.value) and "init_fn" in str(info.value)
    with torch.device("meta"):
        model = _Scaled()

    def init_fn(root: nn.Module) -> None:
        root.fc.reset_parameters()
        root.norm_weight.fill_(1.0)
        root.scale.fill_(2.0)

    assert materialize(model, CPU, init_fn) and torch.all(model.norm_weight == 1) and model.scale.item() == 2.0


def test_an_integer_buffer_left_unset_is_refused_too():
    class Positions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("position_ids", torch.arange(4), persistent=False)

    with torch.device("meta"):
        model = Positions()
    with pytest.raises(MaterializeError, match="position_ids"):
        materialize(model, CPU, None)


def test_wrap_trains_a_pretrained_backbone_with_a_meta_head():
    """Through autopar.wrap: the backbone's weights are the pretrained ones after wrap."""
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
    pretrained = {n: t.clone() for n, t in backbone.state_dict().items()}
    with torch.device("meta"):
        head = nn.Linear(32, 4)
    model = autopar.wrap(nn.Sequential(backbone, head), sample=torch.randn(8, 16), verbose=False)
    assert all(torch.equal(t, pretrained[n]) for n, t in backbone.state_dict().items())
    assert not any(p.is_meta for p in model.parameters())


def test_under_fsdp_on_two_ranks_the_real_shards_are_put_back(tmp_path):
    """FSDP2 re-registers its shards only when its modules are emptied whole: the real values are restored."""
    torchrun("tests/strategies/_materialize_worker.py", 2, [str(tmp_path / "out.pt")], cache_dir=tmp_path / "cache",
             timeout_s=600)
    result = torch.load(tmp_path / "out.pt", weights_only=False)
    assert result["plan"] == 2 and set(result["real"]) == {n for n in result["after"] if not n.startswith("head")}
    for name, value in result["real"].items():
        assert torch.equal(result["after"][name], value), name
    head = result["after"]["head.weight"]
    assert torch.isfinite(head).all() and head.std() > 0
