"""Every zoo family trains the same wrapped as unwrapped (issue 10's CPU must-show): `autopar.wrap` on a tiny
config in one process, then 3 fp32 AdamW steps on the same batches give the unwrapped copy's losses and
parameters, to a relative 1e-5."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import autopar
from bench.zoo import ZOO, Family, build_model, call, make_sample

pytestmark = pytest.mark.zoo

STEPS = 3
RTOL = 1e-5


def _train(model: nn.Module, family: Family) -> list[float]:
    """The user's loop: 3 AdamW steps (built after wrap), one batch per step, the same seed per step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    losses = []
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        sample = make_sample(family, "tiny", seed=step)
        loss = family.loss_fn(call(model, sample), sample)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| over the whole tensor (0 when both are zero)."""
    diff = (a.detach().double() - b.detach().double()).norm().item()
    scale = b.detach().double().norm().item()
    return diff / scale if scale > 0 else diff


@pytest.mark.parametrize("family", ZOO, ids=[f.name for f in ZOO])
def test_wrapped_tiny_model_trains_as_the_unwrapped_one(family: Family, one_plain_process):
    why = family.unavailable()
    if why is not None:
        pytest.skip(why)
    model = build_model(family, "tiny")
    reference = copy.deepcopy(model)
    autopar.wrap(model, sample=make_sample(family, "tiny"), loss_fn=family.loss_fn, verbose=False)
    model.train()

    losses, ref_losses = _train(model, family), _train(reference, family)

    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        assert abs(got - want) <= RTOL * abs(want), f"step {step}: loss {got} != unwrapped {want}"
    params = dict(model.named_parameters())
    ref_params = dict(reference.named_parameters())
    assert params.keys() == ref_params.keys(), "wrap renamed or dropped parameters"
    worst = max(ref_params, key=lambda n: _relative_error(params[n], ref_params[n]))
    assert _relative_error(params[worst], ref_params[worst]) <= RTOL, \
        f"{worst}: relative error {_relative_error(params[worst], ref_params[worst]):.2e} after {STEPS} steps"
    buffers, ref_buffers = dict(model.named_buffers()), dict(reference.named_buffers())
    for name, want in ref_buffers.items():  # BatchNorm statistics: trained alike, never touched by profiling
        if want.is_floating_point():
            assert _relative_error(buffers[name], want) <= RTOL, f"buffer {name} differs"
