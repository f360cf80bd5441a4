"""Profiles with their op records (autopar.profile.watch's OpRecords), for the per-op time model's tests: read
from one more trace of the step where profile_model does not carry them (a trace that does not wire them)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar.profile import ModelProfile, find_blocks, profile_model
from autopar.profile.trace import StepTrace
from autopar.profile.watch import StepWatcher, storage_key


def with_op_records(profile: ModelProfile, model: nn.Module, sample: Any, *, loss_fn: Any = None) -> ModelProfile:
    if profile.op_groups or not profile.traced:
        return profile
    units = find_blocks(model, None)[1]
    trace = StepTrace(model, sample, units, loss_fn=loss_fn, precision=profile.profile_precision)
    trace.run()
    return dataclasses.replace(profile, op_groups=trace.watcher.op_groups())


def profiled(model: nn.Module, sample: Any, *, loss_fn: Any = None, precision: str = "fp32") -> ModelProfile:
    """profile_model's profile of `model` on `sample`, with its op records."""
    profile = profile_model(model, sample, loss_fn=loss_fn, precision=precision, warn=False)
    return with_op_records(profile, model, sample, loss_fn=loss_fn)


def records(profile: ModelProfile, kind: str | None = None, *, backward: bool | None = None) -> list:
    """Every record of the step, a block group's once per block (so that sums are the step's)."""
    out = []
    for g in profile.op_groups:
        for r in g.ops:
            if (kind is None or r.kind == kind) and (backward is None or r.backward == backward):
                out += [r] * (len(g.blocks) if g.where == "blocks" else 1)
    return out


def watched(fn, *tensors, params=()) -> list:
    """`fn` on fake tensors under a StepWatcher (no blocks), forward and backward (where the output needs a
    gradient); the op records it made."""
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t).requires_grad_(t.requires_grad) for t in tensors]
        weights = [mode.from_tensor(p).requires_grad_(True) for p in params]
    watcher = StepWatcher({storage_key(w) for w in weights}, {tuple(w.shape) for w in weights if w.dim() >= 2}, 0,
                          lambda: None)
    with mode, watcher:
        out = fn(*fakes, *weights)
        watcher.forward = False
        if out.requires_grad:
            out.float().sum().backward()
    return [r for g in watcher.op_groups() for r in g.ops]
