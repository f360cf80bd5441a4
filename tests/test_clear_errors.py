"""Unclear failures made clear (issue 11, item 11): each refusal is one line that says what to change."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.errors import PlanError, ProfileError


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def _one_line(info: pytest.ExceptionInfo) -> str:
    text = str(info.value)
    assert "\n" not in text
    return text


def test_an_empty_batch_is_refused_naming_it():
    with pytest.raises(ProfileError, match="empty batch .batch size 0.") as info:
        autopar.wrap(_net(), sample=torch.randn(0, 8), verbose=False)
    _one_line(info)


def test_a_container_of_a_wrapped_model_is_refused():
    wrapped = autopar.wrap(_net(), sample=torch.randn(4, 8), verbose=False)
    with pytest.raises(PlanError, match="holds a model autopar already wrapped .at '0'.") as info:
        autopar.wrap(nn.Sequential(wrapped), sample=torch.randn(4, 8), verbose=False)
    _one_line(info)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a GPU")
def test_wrap_for_gpus_on_a_machine_without_one_is_refused_and_points_to_plan():
    model = _net()
    with pytest.raises(PlanError, match="no GPU, but topology='1xH100-SXM' names GPUs.*autopar.plan") as info:
        autopar.wrap(model, sample=torch.randn(4, 8), topology="1xH100-SXM", verbose=False)
    _one_line(info)
    assert not autopar.strategies.state.is_wrapped(model)  # refused before anything changed
    assert autopar.plan(model, sample=torch.randn(4, 8), topology="1xH100-SXM").precision == "bf16"  # the remedy


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_loss_fn_that_captures_a_real_tensor_is_named_as_the_cause():
    targets = torch.randn(4, 2)  # captured from outside the sample: the trace cannot follow it
    kept, log = _Kept(), logging.getLogger("autopar")
    log.addHandler(kept)
    try:
        autopar.wrap(_net(), sample=torch.randn(4, 8), loss_fn=lambda out, s: (out - targets).square().mean())
    finally:
        log.removeHandler(kept)
    text = " ".join(kept.messages)
    assert "neither in the sample nor a parameter or buffer" in text and "loss_fn(output, sample)" in text
