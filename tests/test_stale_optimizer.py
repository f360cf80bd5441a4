"""An optimizer built before autopar.wrap, whose parameters the plan replaced, is refused at its first step
with the remedy (issue 11, item 2): on 2 gloo ranks under FSDP, and for a meta model on one process; one whose
parameters are still the model's trains as before."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.errors import StaleOptimizerError
from tests.distributed._launch import torchrun


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_an_optimizer_of_a_meta_model_built_before_wrap_is_refused():
    with torch.device("meta"):
        model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model = autopar.wrap(model, sample=torch.randn(4, 8), verbose=False)
    with pytest.raises(StaleOptimizerError, match="built before autopar.wrap.*build the optimizer after wrap"):
        _step(model, opt)
    fresh = torch.optim.SGD(model.parameters(), lr=0.1)  # the remedy
    before = [p.clone() for p in model.parameters()]
    _step(model, fresh)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_an_optimizer_whose_parameters_wrap_kept_trains_as_before():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # one process: wrap keeps the parameters
    model = autopar.wrap(model, sample=torch.randn(4, 8), verbose=False)
    before = [p.clone() for p in model.parameters()]
    _step(model, opt)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_under_fsdp_on_two_ranks_an_optimizer_built_before_wrap_is_refused(tmp_path):
    torchrun("tests/distributed/_stale_optimizer_worker.py", 2, [str(tmp_path / "out")], cache_dir=tmp_path / "cache",
             timeout_s=600)
    for rank in (0, 1):
        text = (tmp_path / f"out.{rank}").read_text()
        assert text.startswith("StaleOptimizerError") and "build the optimizer after wrap" in text, text
        assert "after: trained" in text  # the optimizer built after wrap steps the model's parameters
