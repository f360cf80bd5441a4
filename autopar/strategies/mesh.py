"""The device mesh of a plan: named axes ("pp", "dp_replicate", "dp_shard", "tp"), outermost first.

The degree arithmetic is checked once, here, against the world the job runs in; every strategy then
takes the sub-mesh of the axes it works on.
"""

from __future__ import annotations

from typing import NamedTuple

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..plans import MESH_AXES, Plan


class DataShard(NamedTuple):
    """Which slice of the global batch a rank reads: ranks with one `rank` read the same samples."""

    rank: int
    size: int


def build_mesh(plan: Plan, device_type: str) -> DeviceMesh | None:
    """The plan's 4-D mesh over the current process group, or None for a one-process plan.

    Axes of degree 1 are kept, so `mesh["dp_shard"]` and friends exist for every plan.
    """
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    plan.check_world(world)
    if world == 1:
        return None
    shape = tuple(getattr(plan, axis) for axis in MESH_AXES)
    return init_device_mesh(device_type, shape, mesh_dim_names=MESH_AXES)


def dp_mesh(mesh: DeviceMesh | None, plan: Plan) -> DeviceMesh | None:
    """The mesh FSDP2 shards over: 1-D (dp_shard) for FSDP, 2-D (dp_replicate, dp_shard) for HSDP / DDP-like."""
    if mesh is None or (plan.dp_size == 1 and plan.tp == 1):
        return None
    if plan.dp_replicate > 1:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]


def data_shard(mesh: DeviceMesh | None, plan: Plan) -> DataShard:
    """This rank's data-parallel index and the data-parallel degree (TP and PP ranks of a group share it)."""
    if mesh is None:
        return DataShard(0, 1)
    rank = mesh.get_local_rank("dp_replicate") * plan.dp_shard + mesh.get_local_rank("dp_shard")
    return DataShard(rank, plan.dp_size)
