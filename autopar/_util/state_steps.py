"""Optimizer steps that train nothing: torch's distributed state-dict helpers (`get_state_dict`, `set_state_dict`)
step a never-stepped optimizer once, at learning rate 0, to make its state, and `autopar.save` and `autopar.load`
call them. Hooks that count a job's training steps (the tuner's trial clock, its probe's end) skip the steps taken
inside `making_state()` (a helper found a resumed script's first timed step to be `autopar.load`'s)."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

_local = threading.local()


@contextlib.contextmanager
def making_state() -> Iterator[None]:
    """Optimizer steps inside are autopar's own, to make or read optimizer state, not training steps."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def in_state_step() -> bool:
    """Whether the optimizer step now running is one `making_state()` marks."""
    return getattr(_local, "depth", 0) > 0
