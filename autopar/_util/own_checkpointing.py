"""A model's own activation checkpointing (Hugging Face's `gradient_checkpointing_enable()`), which autopar's plan
replaces.

transformers marks each layer it checkpoints with `gradient_checkpointing = True` (and the model with it), and
checkpoints the layer's forward in training. Left on under wrap, it broke the trace (torch.utils.checkpoint's replay
on fake tensors: "Recomputed values ... have different metadata", so no plan was chosen and a safe plan without a
prediction was applied), and it would checkpoint a second time inside a block the plan checkpoints, or spend the
recomputation the plan did not price. So the trace runs with it off (`own_checkpointing_off`), and wrap turns it off
(`turn_own_checkpointing_off`), saying so: the plan's `checkpointing` decides.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


def own_checkpointing(model: nn.Module) -> list[str]:
    """The modules of `model` whose own checkpointing is on (`gradient_checkpointing is True`), by name."""
    return [name for name, m in model.named_modules() if getattr(m, "gradient_checkpointing", None) is True]


@contextmanager
def own_checkpointing_off(model: nn.Module) -> Iterator[None]:
    """The model's own checkpointing off inside the block, as it was after."""
    on = [m for m in model.modules() if getattr(m, "gradient_checkpointing", None) is True]
    for m in on:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in on:
            m.gradient_checkpointing = True


def turn_own_checkpointing_off(model: nn.Module) -> list[str]:
    """Turn the model's own checkpointing off for good; returns the modules it was on for."""
    names = own_checkpointing(model)
    modules = dict(model.named_modules())
    for name in names:
        modules[name].gradient_checkpointing = False
    return names
