"""The compiled-partition probe (autopar.profile.remat) runs inside every traced profile: it must leave no trace.
What the trace measures is the same with and without it; the profiled model keeps no hook and no changed
buffer; no fake tensor of the trace outlives the profile; and the model compiles (aot_eager: AOTAutograd's
functionalization, as inductor runs it) and trains exactly as an unprofiled copy in the same process."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from autopar.profile import profile_model
from autopar.profile.blocks import find_blocks
from autopar.profile.trace import StepTrace
from tests._convnets import ConvBlock


class _Net(nn.Module):
    """BatchNorm (buffers updated in place by every training forward), residuals, dropout, a pooled head."""

    def __init__(self, channels: int = 8, layers: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList(ConvBlock(channels) for _ in range(layers))
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(channels, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.head(self.drop(x.mean((2, 3))))


def _loss(out: torch.Tensor, _x: torch.Tensor) -> torch.Tensor:
    return out.float().logsumexp(-1).mean()


X = torch.randn(2, 3, 8, 8)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_probe_changes_nothing_the_trace_measures(precision):
    torch.manual_seed(0)
    model = _Net()
    profile = profile_model(model, X, loss_fn=_loss, precision=precision, warn=False)
    assert all(b.compiled_saved_bytes is not None for b in profile.blocks)  # the probe ran
    _, units, _ = find_blocks(model, None)
    plain = StepTrace(model, X, units, loss_fn=_loss, precision=precision).run()
    assert tuple(b.saved_bytes for b in profile.blocks) == plain.saved_bytes
    assert profile.saved_bytes_outside_blocks == plain.saved_outside_bytes
    assert profile.flops == pytest.approx(plain.flops) and profile.largest_transient_bytes == plain.largest_bytes
    assert (profile.num_ops, profile.traffic_bytes, profile.op_groups) == (plain.num_ops, plain.traffic_bytes,
                                                                           plain.op_groups)


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._forward_hooks_with_kwargs)
               + len(m._backward_hooks) for m in model.modules())


def _fake_ids() -> set[int]:
    return {id(o) for o in gc.get_objects() if type(o) is FakeTensor}


def test_the_profiled_model_keeps_no_hook_no_changed_buffer_and_no_fake_tensor():
    torch.manual_seed(0)
    model = _Net()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    gc.collect()
    fakes_before = _fake_ids()
    profile_model(model, X, loss_fn=_loss, precision="bf16", warn=False)
    gc.collect()
    assert not _fake_ids() - fakes_before  # none made by the trace is alive (earlier tests' may be, or go)
    assert _hooks(model) == 0
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def _compiled_steps(model: nn.Module, steps: int = 2) -> tuple[list[float], list[torch.Tensor]]:
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for i in range(steps):
        torch.manual_seed(i)  # the same dropout masks for both models
        loss = _loss(compiled(X), X)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, [t.detach().clone() for t in model.state_dict().values()]


def test_a_profiled_model_compiles_and_trains_as_an_unprofiled_copy():
    """The failure the probe once was blamed for (a compile after a profile in the same process): AOTAutograd
    functionalizes the step, BatchNorm's running statistics included."""
    torch.manual_seed(0)
    model = _Net()
    twin = copy.deepcopy(model)
    profile_model(model, X, loss_fn=_loss, precision="bf16", warn=False)
    try:
        losses, state = _compiled_steps(model)
        twin_losses, twin_state = _compiled_steps(twin)
    finally:
        torch._dynamo.reset()
    assert losses == twin_losses
    assert all(torch.equal(a, b) for a, b in zip(state, twin_state))
