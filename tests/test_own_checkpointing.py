"""A Hugging Face model whose own gradient checkpointing the user turned on before wrap
(`model.gradient_checkpointing_enable()`): the trace failed on it (torch.utils.checkpoint's replay on fake tensors),
so wrap applied a safe plan with no prediction. Now the trace runs with it off, and wrap turns it off, saying so: the
plan's checkpointing replaces it (autopar/_util/own_checkpointing.py). The model then trains as the plain one."""

from __future__ import annotations

import warnings

import pytest
import torch

import autopar
from autopar._util.own_checkpointing import own_checkpointing, own_checkpointing_off
from tests._training import make_model

pytestmark = pytest.mark.usefixtures("one_plain_process")


def _batch(step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def test_the_trace_sees_it_off_and_leaves_it_on():
    model = make_model("llama")
    model.gradient_checkpointing_enable()
    on = own_checkpointing(model)
    assert on and all(name.startswith("model") for name in on)
    with own_checkpointing_off(model):
        assert own_checkpointing(model) == []
    assert own_checkpointing(model) == on
    profile = autopar.profile_model(model, _batch(0), warn=False)
    assert profile.flops > 0 and own_checkpointing(model) == on


def test_wrap_chooses_a_plan_turns_it_off_says_so_and_trains_as_the_plain_model(monkeypatch):
    monkeypatch.setenv("AUTOPAR_NO_WRAP_CACHE", "1")
    plain, model = make_model("llama"), make_model("llama")
    model.gradient_checkpointing_enable()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        autopar.wrap(model, sample=_batch(0), verbose=False)
    assert autopar.applied(model).plan.prediction  # chosen by the cost model, not the safe plan
    assert own_checkpointing(model) == []
    told = [str(w.message) for w in said if "gradient_checkpointing_enable" in str(w.message)]
    assert len(told) == 1 and "is turned off" in told[0]
    for m in (plain, model):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m.losses = []
        for step in range(2):
            loss = m(**_batch(step)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            m.losses.append(loss.item())
    assert model.losses == pytest.approx(plain.losses, rel=1e-5)
