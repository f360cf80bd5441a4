"""autopar's tuners: measured trials of plans in the user's own launch command.

    from autopar.tune import run_trial, probe
    p = probe(["torchrun", "--nproc-per-node", "8", "train.py"])          # the profile wrap() makes there
    r = run_trial(["torchrun", "--nproc-per-node", "8", "train.py"], plan)  # one plan, measured

Names load on first use (docs/tuning.md).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "run_trial": ".trial",
    "probe": ".trial",
    "TrialResult": ".trial",
    "ProbeResult": ".trial",
    "ProbeError": ".trial",
    "ENV_DIR": ".trial",
    "ENV_MODE": ".trial",
    "ENV_STEPS": ".trial",
    "ENV_WARMUP": ".trial",
    "ENV_INJECT": ".trial",
}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:  # pragma: no cover
    from .trial import (ENV_DIR, ENV_INJECT, ENV_MODE, ENV_STEPS, ENV_WARMUP, ProbeError, ProbeResult, TrialResult,
                        probe, run_trial)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'autopar.tune' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
