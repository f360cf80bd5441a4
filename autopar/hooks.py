"""The one hook `autopar.wrap` calls: how a tuner's trial run learns what wrap did. A no-op outside a trial.

`wrap` calls the installed `WrapHook` at three points and never branches on why: which plan to apply
(`plan_override`), what it profiled (`profiled`), and what it applied (`applied`). The default hook does
nothing, so outside a trial wrap behaves as if this module did not exist. autopar's tuner installs its own
hook in the run it launches (`autopar.tune.worker`, chosen from the environment the tuner sets), and ends
that run from the training loop's optimizer step, never from inside `wrap`.

This module sits beside `api` so that the tuner (above it) plugs into wrap without wrap importing the
tuner.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch.nn as nn

from .plans import Loop, Plan
from .profile import ModelProfile
from .topology import Topology


@dataclass(frozen=True)
class Profiled:
    """What wrap knows once every rank has profiled the model: passed to `WrapHook.profiled`."""

    model: nn.Module
    sample: Any
    profile: ModelProfile
    topology: Topology
    world_size: int
    global_batch_size: int
    loss_fn: Callable[[Any, Any], Any] | None
    blocks: Any
    loop: Loop  # what drives the step (wrap's loop=; Loop.PLAIN when left out)

    @property
    def uses_train_step(self) -> bool:
        """Whether the loop is autopar.train_step (the field this event had before the loop had three values)."""
        return self.loop is Loop.TRAIN_STEP


class WrapHook:
    """What wrap tells whoever runs it. Every method of this base class does nothing."""

    def plan_override(self) -> Plan | Path | None:
        """A plan (or plan file) to apply instead of the one wrap was given or would choose; None: no change."""
        return None

    def profiled(self, event: Profiled) -> None:
        """Every rank has profiled the model (the same result on every rank)."""

    def applied(self, model: nn.Module, plan: Plan, profile: ModelProfile) -> None:
        """The plan is applied; `model` is ready to train."""


_HOOK: list[WrapHook] = [WrapHook()]


def wrap_hook() -> WrapHook:
    """The hook wrap calls now."""
    return _HOOK[0]


def set_wrap_hook(hook: WrapHook | None) -> WrapHook:
    """Install `hook` (None: the no-op default) and return the one it replaces."""
    if hook is not None and not isinstance(hook, WrapHook):
        raise TypeError(f"a wrap hook must be an autopar.hooks.WrapHook, got {type(hook).__name__}.")
    previous, _HOOK[0] = _HOOK[0], hook or WrapHook()
    return previous
