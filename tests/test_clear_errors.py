"""Unclear failures made clear (issue 11, item 11): each refusal is one line that says what to change."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.errors import PlanError, ProfileError
from tests.distributed._launch import torchrun


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning is for a machine without a GPU")
def test_wrap_for_gpus_on_a_machine_without_one_says_so_and_points_to_plan():
    """Not silent: the GPUs' plan runs here on the CPU (the parity tests use exactly that on purpose)."""
    with pytest.warns(UserWarning, match="no GPU, but topology='1xH100-SXM' names GPUs.*autopar.plan"):
        autopar.wrap(_net(), sample=torch.randn(4, 8), topology="1xH100-SXM", verbose=False)


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


def test_ranks_given_different_batch_sizes_all_raise_the_same_error(tmp_path):
    """Rank 1 raised alone before, and rank 0 went on to 'Connection closed'."""
    torchrun("tests/distributed/_uneven_worker.py", 2, [str(tmp_path / "out")], cache_dir=tmp_path / "cache",
             timeout_s=300)
    results = [(tmp_path / f"out.{r}").read_text() for r in (0, 1)]
    assert results[0] == results[1] and results[0].startswith("PlanError: the ranks were given samples of "
                                                              "different batch sizes (2 to 4 samples)")
