"""autopar: make PyTorch training fast without hand-tuning parallelism.

    model = autopar.wrap(model, sample=batch)   # choose a plan and apply it (FSDP2, checkpointing, bf16, compile)
    plan = autopar.plan(model, sample=batch)    # choose only; the model is untouched

The public API is this module's names; every other module is private (docs/architecture.md shows the layers).
"""

from __future__ import annotations

from .api import plan, wrap
from .checkpoint import load, save
from .data import dataloader, local_batch, sampler
from .errors import (AutoparError, InfeasiblePlanError, MaterializeError, PlanError, PlanMismatchError, ProfileError,
                     StaleOptimizerError, TopologyError, UntracedWarning)
from .planning import candidates, predict
from .plans import Loop, Plan
from .profile import ModelProfile, profile_model
from .step import clip_grad_norm_, train_step
from .strategies.full_load import full_state_dict
from .strategies.state import applied, data_shard, plan_of
from .topology import DeviceSpec, Topology
from .tune.study import autotune
from .tune.worker import install_from_env as _install_tuner_hook

_install_tuner_hook()  # in a run autopar's tuner launched (AUTOPAR_TRIAL_*): its wrap hook; elsewhere nothing

__version__ = "0.1.0"

__all__ = [
    "AutoparError",
    "DeviceSpec",
    "InfeasiblePlanError",
    "Loop",
    "MaterializeError",
    "ModelProfile",
    "Plan",
    "PlanError",
    "PlanMismatchError",
    "ProfileError",
    "StaleOptimizerError",
    "Topology",
    "TopologyError",
    "UntracedWarning",
    "applied",
    "autotune",
    "candidates",
    "clip_grad_norm_",
    "data_shard",
    "dataloader",
    "full_state_dict",
    "load",
    "local_batch",
    "plan",
    "plan_of",
    "predict",
    "profile_model",
    "sampler",
    "save",
    "train_step",
    "wrap",
]
