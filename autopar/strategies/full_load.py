"""Full (unsharded) state dicts in and out of a model whose parameters autopar sharded.

In: `model.load_state_dict(full)`: each rank takes its shards.

FSDP2 and tensor parallelism hold parameters as DTensors, and torch's load copies a state dict's value into each
one: a value that is a plain tensor (a pretrained checkpoint, `torch.load` of a file saved from the plain model, a
state dict another process built) raised "aten.copy_.default got mixed torch.Tensor and DTensor" on every rank.
`apply_full_load` installs a load pre-hook on the root that turns each plain tensor of a DTensor parameter's full
shape into that DTensor's layout from this rank's own copy (`distribute_tensor(..., src_data_rank=None)`: every
rank holds the full tensor, nothing is sent), so the load copies each rank's shards. A DTensor value (a sharded
state dict, torch's `get_model_state_dict`) and a tensor of another shape are left to torch's load, which checks
them as it does for any model.

Out: `autopar.full_state_dict(model)`: the model's state as full, plain tensors on the CPU on every rank, what the
plain model's `state_dict()` holds. `model.state_dict()` gives FSDP's shards (DTensors), which Hugging Face's
`save_pretrained` cannot write (on 2 gloo ranks under dp_shard=2 it raised "Attempted to access the data pointer on
an invalid python storage"); `model.save_pretrained(path, state_dict=autopar.full_state_dict(model),
is_main_process=rank == 0)` writes the model that reloads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .._util.strided import full_tensor
from ..errors import PlanError
from .state import ATTR


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state (parameters and persistent buffers, by their names) as full, plain tensors on the CPU, on
    every rank: a collective, which every rank calls. Each sharded parameter is gathered whole, so every rank holds
    the model's size in host memory. A pipeline stage holds only its own layers: refused for pipeline plans (save
    with autopar.save and convert the checkpoint: docs/checkpoints.md)."""
    from torch.distributed.tensor import DTensor

    state = getattr(model, ATTR, None)
    if state is not None and state.plan.pp > 1:
        raise PlanError(f"full_state_dict: under pp={state.plan.pp} each rank holds only its stages' layers: "
                        "save with autopar.save and convert the checkpoint (torch.distributed.checkpoint.format_utils."
                        "dcp_to_torch_save).")
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # the shards (with the model's own names), each gathered here: torch's full state dict gathers a fused layer's
    # weight under tp x dp_shard wrong (autopar._util.strided)
    sharded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    return {k: (full_tensor(v) if isinstance(v, DTensor) else v).detach().cpu() for k, v in sharded.items()}


def apply_full_load(model: nn.Module) -> None:
    """Let `model.load_state_dict` take full (unsharded) tensors for its DTensor parameters."""
    model.register_load_state_dict_pre_hook(_full_to_shards)


def _full_to_shards(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    from torch.distributed.tensor import DTensor

    named = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
    for name, target in named:
        key = prefix + name
        value = state_dict.get(key)
        if isinstance(target, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
                and tuple(value.shape) == tuple(target.shape):
            state_dict[key] = _as_placed(value.detach(), target)


def _as_placed(full: torch.Tensor, like: Any) -> Any:
    """`full` laid out as DTensor `like` is (its mesh and placements), from this rank's copy."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = like.device_mesh
    full = full.to(like.to_local().device)
    try:
        return distribute_tensor(full, mesh, like.placements, src_data_rank=None)
    except (NotImplementedError, RuntimeError, AssertionError):  # a placement distribute_tensor cannot make at once
        whole = distribute_tensor(full, mesh, [Replicate()] * mesh.ndim, src_data_rank=None)
        return whole.redistribute(mesh, like.placements)
