"""autopar: make PyTorch training fast without hand-tuning parallelism.

    model = autopar.wrap(model, sample=batch)   # choose a plan and apply it (FSDP2, checkpointing, bf16, compile)
    plan = autopar.plan(model, sample=batch)    # choose only; the model is untouched

The public API is this module's names; everything else is private. Heavy modules load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "Plan": ".plans",
    "ModelProfile": ".profile",
    "profile_model": ".profile",
    "Topology": ".topology",
    "DeviceSpec": ".topology",
    "wrap": ".api",
    "plan": ".api",
    "candidates": ".planning",
    "predict": ".planning",
    "autotune": ".tune.study",
    "applied": ".api",
    "plan_of": ".api",
    "data_shard": ".api",
    "train_step": ".step",
    "sampler": ".data",
    "dataloader": ".data",
    "local_batch": ".data",
    "save": ".checkpoint",
    "load": ".checkpoint",
    "AutoparError": ".errors",
    "PlanError": ".errors",
    "PlanMismatchError": ".errors",
    "ProfileError": ".errors",
    "TopologyError": ".errors",
    "InfeasiblePlanError": ".errors",
}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:  # pragma: no cover
    from .api import applied, data_shard, plan, plan_of, wrap
    from .planning import candidates, predict
    from .tune.study import autotune
    from .checkpoint import load, save
    from .data import dataloader, local_batch, sampler
    from .step import train_step
    from .errors import AutoparError, InfeasiblePlanError, PlanError, PlanMismatchError, ProfileError, TopologyError
    from .plans import Plan
    from .profile import ModelProfile, profile_model
    from .topology import DeviceSpec, Topology


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'autopar' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
