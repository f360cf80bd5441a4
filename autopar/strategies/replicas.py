"""broadcast_replicas: every data-parallel replica starts from the same values.

FSDP2 does not synchronise module states when it shards (DDP does): ranks whose models were seeded
differently, or a meta model each rank initialised with its own random stream, would keep replicas that
differ forever under replication (HSDP's and the DDP-like plan's `dp_replicate` axis) while their gradients
are averaged (issue 11: the tuner picked such a plan as the best). So, after sharding and materialising,
every tensor replicated over an axis of the mesh is broadcast over that axis from its first rank: a DTensor
parameter over each axis it is `Replicate()` on (its `Shard` axes hold different parts by design), and a plain
tensor (a buffer, a parameter FSDP leaves out) over every data-parallel axis. Then every rank holds what the
first rank of its groups holds. Under the exact check's fake tensors there is nothing to send.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

DP_AXES = ("dp_replicate", "dp_shard")


def broadcast_replicas(model: nn.Module, mesh: DeviceMesh) -> int:
    """Broadcast every replicated tensor of `model` over its replicated axes (see the module docstring);
    returns how many tensors were sent over some axis."""
    axes = [a for a in DP_AXES if a in (mesh.mesh_dim_names or ()) and mesh.size(mesh.mesh_dim_names.index(a)) > 1]
    sent = 0
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            if is_fake(t) or t.is_meta:
                continue
            if isinstance(t, DTensor):
                groups = [t.device_mesh.get_group(i) for i, p in enumerate(t.placements)
                          if p.is_replicate() and t.device_mesh.size(i) > 1]
                local = t.to_local()
            else:
                groups = [mesh.get_group(a) for a in axes]
                local = t
            for group in groups:
                _broadcast(local, group)
            sent += bool(groups)
    return sent


def _broadcast(t: torch.Tensor, group: dist.ProcessGroup) -> None:
    """`t` from the group's first rank, in place (through the GPU where the backend is NCCL and `t` is not)."""
    gpu = dist.get_backend(group) == "nccl" and t.device.type != "cuda"
    staged = t.to(torch.device("cuda", torch.cuda.current_device()) if gpu else t.device).contiguous()  # t if it can
    dist.broadcast(staged, src=dist.get_global_rank(group, 0), group=group)
    if staged is not t:
        t.copy_(staged)
