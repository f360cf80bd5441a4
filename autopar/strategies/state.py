"""What autopar did to a model: the `Applied` record `apply_plan` returns, kept on the model, and the
lookups of it (`autopar.applied`, `autopar.plan_of`, `autopar.data_shard`) that step, data, checkpoint and
the exact check read. It sits below them so none of them imports `wrap`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..errors import PlanError
from ..plans import Plan
from ..profile import ModelProfile
from ..topology import Topology
from .mesh import DataShard
from .pipeline import PipelineRuntime
from .tensor_parallel import TPLayout

#: the attribute of a wrapped model that holds its Applied record
ATTR = "_autopar_applied"


@dataclass(frozen=True)
class Applied:
    """What `apply_plan` did to a model; kept on the model and returned by `autopar.applied(model)`."""

    plan: Plan
    profile: ModelProfile
    topology: Topology
    mesh: DeviceMesh | None
    device: torch.device
    data_shard: DataShard
    checkpointed: tuple[str, ...]
    compiled: tuple[str, ...]
    notes: tuple[str, ...] = ()  # what was changed besides the plan's techniques, for the log
    pipeline: PipelineRuntime | None = None  # the runtime of a pipeline-parallel plan
    tensor_parallel: TPLayout | None = None  # what a tensor-parallel plan split
    used_on_some_ranks: tuple[str, ...] = ()  # parameters that may go without a gradient on some ranks (their FSDP
    # units reduce zeros for them: strategies/unused.py)


def attach(model: nn.Module, state: Applied) -> None:
    """Keep `state` on the model (once: a model is wrapped at most once)."""
    object.__setattr__(model, ATTR, state)


def is_wrapped(model: nn.Module) -> bool:
    return getattr(model, ATTR, None) is not None


def applied(model: nn.Module) -> Applied:
    """What autopar did to a wrapped model: its plan, profile, topology, mesh, device and data shard."""
    state = getattr(model, ATTR, None)
    if state is None:
        raise PlanError("this model was not wrapped by autopar.wrap: there is no plan to report.")
    return state


def plan_of(model: nn.Module) -> Plan:
    """The Plan a wrapped model runs."""
    return applied(model).plan


def data_shard(model: nn.Module) -> DataShard:
    """(rank, size): which of `size` equal slices of the global batch this process reads.

    Processes with the same data-shard rank (tensor- or pipeline-parallel peers) read the same samples."""
    return applied(model).data_shard
