"""Apply a Plan to a model, in the one valid order (as torchtitan's parallelize does it):

  0. check the plan against the model and the hardware (every refusal says what to change)
  1. float8 swap           (not offered by this version's Plan)
  2. pipeline split        (Plan.pp > 1: not in this version; refused in `check_plan`)
  3. tensor parallel       (Plan.tp > 1: not in this version; refused in `check_plan`)
  4. activation checkpointing, per block: wraps the block's forward, so it must come before compile
     (the checkpoint becomes part of the compiled graph) and before FSDP (whose hooks wrap the call)
  5. torch.compile, per block under FSDP (before sharding, so FSDP's hooks stay outside the graphs),
     the whole model otherwise
  6. FSDP2 `fully_shard` per block, then the root, with the MixedPrecisionPolicy; this also moves
     the parameters to the mesh's device
  7. materialise a meta-device model (`to_empty` + its own init)
  8. without FSDP: move to the device, and bf16 through autocast around the forward
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .._log import get_logger
from ..errors import PlanError
from ..plans import Plan
from ..profile import ModelProfile, iter_block_modules
from ..topology import Topology
from .checkpointing import apply_checkpointing, disable_kv_cache
from .compile import apply_compile
from .fsdp import apply_fsdp
from .mesh import DataShard, data_shard, dp_mesh
from .precision import apply_autocast


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


def check_plan(plan: Plan, profile: ModelProfile, topology: Topology, *, world_size: int) -> None:
    """Raise a PlanError if `plan` cannot run on this model and hardware, saying what to change."""
    plan.check_world(world_size)
    if plan.tp > 1:
        raise PlanError(
            f"tp={plan.tp}: tensor parallelism is not available in this version of autopar; set tp=1 and use "
            "dp_shard for the same processes."
        )
    if plan.pp > 1:
        raise PlanError(
            f"pp={plan.pp}: pipeline parallelism is not available in this version of autopar; set pp=1 and use "
            "dp_shard for the same processes."
        )
    if plan.checkpointing != "none" and not profile.blocks:
        raise PlanError(
            f"checkpointing={plan.checkpointing!r} needs blocks to checkpoint, and {profile.model_class} has none "
            "(no repeated layers, no top-level children with parameters): set checkpointing='none', or pass "
            "blocks= naming the layers."
        )
    if not topology.is_gpu:
        if plan.cpu_offload:
            raise PlanError(
                "cpu_offload moves parameters from GPU memory to host memory, and this job has no GPU "
                f"({topology.describe().splitlines()[0]}): set cpu_offload=False."
            )
    elif not topology.device.supports(plan.precision):
        raise PlanError(
            f"precision={plan.precision!r} is not supported by {topology.device.name}: use precision='fp32'."
        )


def materialize(model: nn.Module, device: torch.device, init_fn: Callable[[nn.Module], None] | None) -> bool:
    """Give a meta-device model real (sharded) storage on `device` and initialise it; False if nothing was meta."""
    if not any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        return False
    model.to_empty(device=device)
    with torch.no_grad():
        if init_fn is not None:
            init_fn(model)
        elif callable(getattr(model, "reset_parameters", None)):
            model.reset_parameters()
        elif callable(getattr(model, "init_weights", None)):  # Hugging Face PreTrainedModel
            model.init_weights()
        else:
            for module in model.modules():
                if callable(getattr(module, "reset_parameters", None)):
                    module.reset_parameters()
    return True


def apply_plan(
    model: nn.Module,
    plan: Plan,
    profile: ModelProfile,
    topology: Topology,
    *,
    mesh: DeviceMesh | None,
    device: torch.device,
    init_fn: Callable[[nn.Module], None] | None = None,
    compile_backend: str | None = None,
) -> Applied:
    """Apply `plan` to `model` in place (see the module docstring for the order) and describe what was done."""
    blocks = list(iter_block_modules(model, profile))
    # 1-3. float8, pipeline and tensor parallel: refused by check_plan in this version.
    # 4. Activation checkpointing.
    checkpointed = apply_checkpointing(blocks, mode=plan.checkpointing, every=plan.checkpoint_every)
    if checkpointed and disable_kv_cache(model):
        get_logger().info("checkpointing: turned the model's key/value cache off (config.use_cache = False), "
                          "as Hugging Face does under its own gradient checkpointing.")
    # 5. torch.compile: per block when FSDP will wrap the blocks, else the whole model (after step 8's
    #    move and autocast, which the compiled call picks up since compile wraps the module's call).
    fsdp_mesh = dp_mesh(mesh, plan)
    use_fsdp = plan.uses_fsdp
    compiled: list[str] = []
    if plan.compile and use_fsdp:
        compiled = apply_compile(model, blocks, per_block=True, backend=compile_backend)
    # 6. FSDP2 (a one-rank mesh when CPU offload is asked for on a single process).
    if use_fsdp:
        if fsdp_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            if not torch.distributed.is_initialized():
                raise PlanError(
                    "cpu_offload on one process runs through FSDP2, which needs a process group: launch with "
                    "torchrun (even --nproc-per-node 1) or call torch.distributed.init_process_group first."
                )
            fsdp_mesh = init_device_mesh(device.type, (1,))
        apply_fsdp(model, fsdp_mesh, blocks=blocks, precision=plan.precision,
                   reshard_after_forward=plan.reshard_after_forward, cpu_offload=plan.cpu_offload)
    # 7. Materialise a meta-device model.
    materialize(model, torch.device("cpu") if plan.cpu_offload else device, init_fn)
    # 8. Without FSDP: move to the device, autocast for bf16, compile the whole model.
    if not use_fsdp:
        model.to(device)
        apply_autocast(model, precision=plan.precision, device_type=device.type)
        if plan.compile:
            compiled = apply_compile(model, blocks, per_block=False, backend=compile_backend)
    return Applied(plan=plan, profile=profile, topology=topology, mesh=mesh, device=device,
                   data_shard=data_shard(mesh, plan), checkpointed=tuple(checkpointed), compiled=tuple(compiled))
