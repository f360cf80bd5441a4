"""FSDP2: `fully_shard` each block, then the root, over the data-parallel mesh.

A 1-D mesh shards parameters, gradients and optimizer state over all its ranks (ZeRO-3); a 2-D mesh
(dp_replicate, dp_shard) is HSDP: sharded within a group, replicated across groups (with dp_shard = 1,
plain replication, like DDP). CPU offload keeps the sharded parameters, gradients and optimizer state
in host memory and runs the optimizer there.
"""

from __future__ import annotations

from typing import Sequence

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .precision import fsdp_policy


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    blocks: Sequence[tuple[str, nn.Module]],
    precision: str,
    reshard_after_forward: bool,
    cpu_offload: bool,
    outer_units: Sequence[nn.Module] | None = None,
) -> None:
    """Shard `model` over `mesh`: one FSDP unit per block, the rest (embeddings, head) in the root unit.

    With `outer_units` (a pipeline stage, whose forward stops after its last block), the modules around
    the blocks are units of their own and no unit wraps the whole model.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for index, (_, block) in enumerate(blocks):
        # The last block's parameters are needed again at once when backward starts: keep them gathered.
        reshard = reshard_after_forward and index < len(blocks) - 1
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard,
                    mp_policy=fsdp_policy(precision, root=False), offload_policy=offload)
    if outer_units is not None:
        for module in outer_units:
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward,
                        mp_policy=fsdp_policy(precision, root=True), offload_policy=offload)
        return
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward,
                mp_policy=fsdp_policy(precision, root=True), offload_policy=offload)
