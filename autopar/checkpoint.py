"""Checkpoints that move between plans: `autopar.save` / `autopar.load` on torch.distributed.checkpoint.

A checkpoint is a folder written by every rank together (DCP): model and optimizer state keyed by the
parameters' own names, each rank writing its shards. Loading reshards to whatever the loading plan
holds - another mesh, another world size, one process - including the optimizer state. Next to the
shards, `autopar.yaml` (plain YAML, read with yaml.safe_load) records the model's fingerprint and the
plan that saved it, so that loading into another model is refused with a clear message.

DCP's own metadata file is read by torch (with pickle): load checkpoints you trust, as with torch.load.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.nn as nn
import yaml

from ._util.yaml_text import load_yaml
from .errors import AutoparError, PlanMismatchError
from .profile import model_fingerprint

_META = "autopar.yaml"


def _rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def save(model: nn.Module, optimizer: Any, path: str | os.PathLike[str]) -> Path:
    """Save `model` (wrapped by autopar or not) and `optimizer` to the folder `path`, from every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = Path(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    state = getattr(model, "_autopar_applied", None)
    fingerprint = state.profile.fingerprint if state is not None else model_fingerprint(model)
    meta = {"autopar_checkpoint": 1, "model_fingerprint": fingerprint,
            "plan": state.plan.to_dict() if state is not None else None}
    if _rank0():
        tmp = path / f".{_META}.tmp"
        tmp.write_text(yaml.safe_dump(meta, sort_keys=False))
        os.replace(tmp, path / _META)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return path


def _tied_aliases(path: Path, optim_sd: dict, state: Any) -> dict[str, str]:
    """Optimizer-state names this model holds that the checkpoint keeps under another name of the same tied
    weight (a model that ties its head to its embedding saves one state; a pipeline stage holds a copy under
    the head's name): {name here: name in the checkpoint}."""
    if state is None or not state.profile.tied_params or "state" not in optim_sd:
        return {}
    import torch.distributed.checkpoint as dcp

    saved = {k.split(".", 2)[2].rsplit(".", 1)[0] for k in dcp.FileSystemReader(str(path)).read_metadata()
             .state_dict_metadata if k.startswith("optim.state.")}
    aliases = {}
    for group in state.profile.tied_params:
        for name in group:
            if name in optim_sd["state"] and name not in saved:
                other = next((n for n in group if n in saved and n not in optim_sd["state"]), None)
                if other is not None:
                    aliases[name] = other
    return aliases


def load(model: nn.Module, optimizer: Any, path: str | os.PathLike[str], *, force: bool = False) -> None:
    """Load a checkpoint saved by `save` into `model` and `optimizer`, under any plan and world size.

    The optimizer must be the same kind as the one saved (its state is matched by parameter name).
    Refuses a checkpoint of another model (by fingerprint) unless `force=True`.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    meta_path = path / _META
    if not meta_path.is_file():
        raise AutoparError(f"{path} is not an autopar checkpoint (no {_META}): give the folder autopar.save wrote.")
    try:
        meta = load_yaml(meta_path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise AutoparError(f"{meta_path} is not plain YAML ({exc.__class__.__name__}): the checkpoint is damaged.") from None
    if not isinstance(meta, dict) or meta.get("autopar_checkpoint") != 1:
        raise AutoparError(f"{meta_path} is not an autopar checkpoint description.")
    state = getattr(model, "_autopar_applied", None)
    fingerprint = state.profile.fingerprint if state is not None else model_fingerprint(model)
    if not force and meta.get("model_fingerprint") not in (None, fingerprint):
        raise PlanMismatchError(
            f"the checkpoint at {path} is of another model (fingerprint {meta.get('model_fingerprint')}, this model's "
            f"is {fingerprint}): load it into the model that saved it, or pass force=True to skip this check (every "
            "parameter of the model must still be in the checkpoint, by name and shape)."
        )
    model_sd, optim_sd = get_state_dict(model, optimizer)
    aliases = _tied_aliases(path, optim_sd, state)
    for mine, theirs in aliases.items():  # a tied weight saved under its other name
        optim_sd["state"][theirs] = optim_sd["state"].pop(mine)
    # Which parameters each optimizer group holds is this plan's business (a pipeline stage saved only its
    # own): keep ours, and take the groups' settings (learning rate, betas, ...) from the checkpoint.
    own_params = [list(group["params"]) for group in optim_sd.get("param_groups", [])]
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        raise AutoparError(
            f"could not load {path} into this model and optimizer ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}). The optimizer must be of the kind that was saved, "
            "and every parameter of this model must be in the checkpoint."
        ) from exc
    for mine, theirs in aliases.items():
        optim_sd["state"][mine] = optim_sd["state"].pop(theirs)
    for group, params in zip(optim_sd.get("param_groups", []), own_params):
        group["params"] = params
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
