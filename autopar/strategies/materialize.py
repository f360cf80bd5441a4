"""materialize: a model's meta tensors get real (sharded) storage and initial values; nothing else changes.

Two faults this guards against:
- A model only partly on meta (a pretrained backbone, a new head built under `torch.device("meta")`): only the
  modules that hold meta tensors get storage (`to_empty(recurse=False)`) and are initialised, so the real
  weights are kept. Under FSDP2, whose modules re-register their shards only when emptied as a whole
  (FSDPModule._apply), the whole tree is emptied and the real values (this rank's shards: one more copy of
  them for a moment) are put back.
- An initialisation that misses a tensor (a hand-written norm without `reset_parameters`, a root-level scale):
  `to_empty` leaves whatever bytes were there, which would train silently. Every new floating tensor is filled
  with NaN and every integer one with its type's lowest value before the initialisation runs; one still
  holding them afterwards was not initialised, and the step is refused with their names (MaterializeError).
  Booleans cannot be marked and are not checked. Under fake tensors (the exact memory check) there are no
  values to check.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ..errors import MaterializeError

InitFn = Callable[[nn.Module], None]


def materialize(model: nn.Module, device: torch.device, init_fn: InitFn | None) -> bool:
    """Give `model`'s meta tensors real storage on `device` and initialise them; False if nothing was meta.

    Wholly on meta: `init_fn(model)`, else the model's `reset_parameters()`, else Hugging Face's
    `init_weights()`, else every module's `reset_parameters()`. Partly on meta: each module holding meta
    tensors gets `init_fn(module)`, else its `reset_parameters()`, else the Hugging Face model's
    `_init_weights(module)`; a module whose tensors are all real is never touched."""
    owners = [m for m in model.modules() if any(t.is_meta for t in _own_tensors(m))]
    if not owners:
        return False
    whole = all(t.is_meta for t in (*model.parameters(), *model.buffers()))
    fresh = [name for name, t in _named_tensors(model) if t.is_meta]
    _empty(model, owners, whole, device)
    tensors = dict(_named_tensors(model))
    checked = [(name, tensors[name]) for name in fresh if not is_fake(tensors[name])]
    with torch.no_grad():
        for _, t in checked:
            _mark(t)
        _initialise(model, owners, whole, init_fn)
    missed = [name for name, t in checked if _still_marked(t)]
    if missed:
        shown = ", ".join(missed[:6]) + (f" and {len(missed) - 6} more" if len(missed) > 6 else "")
        raise MaterializeError(
            f"the initialisation of the meta-device model left {len(missed)} tensor(s) without values: {shown}; "
            "pass autopar.wrap(..., init_fn=fn) where fn(module) sets them (or give their modules a "
            "reset_parameters()).")
    return True


def _empty(model: nn.Module, owners: list[nn.Module], whole: bool, device: torch.device) -> None:
    """Storage on `device` for the meta tensors (the owners' own, or the whole model's), real values kept, tied
    parameters tied again."""
    ties = _tied_names(model)
    kept: dict[str, torch.Tensor] = {}
    if whole:
        model.to_empty(device=device)
    elif any(isinstance(m, FSDPModule) for m in model.modules()):
        kept = {name: t.detach().clone() for name, t in _named_tensors(model) if not t.is_meta}
        model.to_empty(device=device)
    else:
        for module in owners:
            module.to_empty(device=device, recurse=False)
    _retie(model, ties)
    tensors = dict(_named_tensors(model))
    with torch.no_grad():
        for name, value in kept.items():
            tensors[name].copy_(value)


def _own_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters(recurse=False)
    yield from module.buffers(recurse=False)


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()


def _tied_names(model: nn.Module) -> list[list[str]]:
    """Names that share one Parameter: to_empty gives every module a new one, so they are shared again after."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _retie(model: nn.Module, ties: list[list[str]]) -> None:
    for names in ties:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, attr, first)


def _initialise(model: nn.Module, owners: list[nn.Module], whole: bool, init_fn: InitFn | None) -> None:
    if whole:
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
        return
    hf_init = getattr(model, "_init_weights", None)  # Hugging Face's per-module initialisation
    for module in owners:
        if init_fn is not None:
            init_fn(module)
        elif callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
        elif callable(hf_init):
            hf_init(module)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's values (a sharded parameter's shard)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _mark(t: torch.Tensor) -> None:
    local = _local(t)
    if local.is_floating_point():
        local.fill_(float("nan"))
    elif local.dtype != torch.bool and not local.is_complex():
        local.fill_(torch.iinfo(local.dtype).min)


def _still_marked(t: torch.Tensor) -> bool:
    local = _local(t)
    if local.numel() == 0:
        return False
    if local.is_floating_point():
        return bool(torch.isnan(local).any())
    if local.dtype == torch.bool or local.is_complex():
        return False
    return bool((local == torch.iinfo(local.dtype).min).any())
