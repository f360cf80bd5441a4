"""Checkpoints that move between plans: `autopar.save` / `autopar.load` on torch.distributed.checkpoint.

A checkpoint is a folder written by every rank together (DCP): model and optimizer state keyed by the
parameters' own names, each rank writing its shards. Loading reshards to whatever the loading plan
holds - another mesh, another world size, one process - including the optimizer state. Next to the
shards, `autopar.yaml` (plain YAML, autopar._util.yaml_text) records the model's fingerprint and the
plan that saved it, so that loading into another model is refused with a clear message, and every file's
size and SHA-256, which `load` verifies first (a flipped, truncated or missing file is refused by name).

A save never damages the checkpoint before it: every rank writes into a new hidden folder beside `path`
(`.NAME.new-TOKEN`), each rank hashes its own shard files, rank 0 writes `autopar.yaml` last, and only then
is the folder switched in (the old one renamed aside, the new one renamed to `path`, the old one removed).
A crash at any point leaves `path` complete, or, in the instant between the two renames, both complete
folders beside it: `load` then takes the new one (the old one if the new one is not complete), and says so.

DCP's own metadata file is read by torch (with pickle): load checkpoints you trust, as with torch.load.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.nn as nn
import yaml

from ._util.dist import broadcast_text, first_failure
from ._util.io import atomic_write_text, fsync_dir
from ._util.yaml_text import load_yaml
from .errors import AutoparError, PlanMismatchError
from .profile import model_fingerprint

_META = "autopar.yaml"
_SUMS = ".autopar-sums.{rank}.yaml"  # one rank's files and their hashes, merged into autopar.yaml by rank 0
_SHARD = re.compile(r"__(\d+)_")  # DCP's file of rank N: __N_I.distcp


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _barrier() -> None:
    if _world() > 1:
        dist.barrier()


def _digest(path: Path) -> dict[str, Any]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def _own_files(folder: Path, rank: int) -> list[Path]:
    """The files this rank hashes: its own shards (DCP names them __RANK_N.distcp), and on rank 0 the rest of
    DCP's: `.metadata` and any other file not hidden (the ranks' own hidden sums files, and the temporary files
    they are written through while this rank lists the folder, are not the checkpoint's)."""
    files = sorted(p for p in folder.iterdir()
                   if p.is_file() and (p.name == ".metadata" or not p.name.startswith(".")))
    shards = [p for p in files if _SHARD.match(p.name)]
    return [p for p in shards if int(_SHARD.match(p.name)[1]) == rank] + \
        ([p for p in files if p not in shards] if rank == 0 else [])


def save(model: nn.Module, optimizer: Any, path: str | os.PathLike[str]) -> Path:
    """Save `model` (wrapped by autopar or not) and `optimizer` to the folder `path`, from every rank; a
    checkpoint already at `path` stays complete until the new one is (see the module docstring)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise AutoparError(f"{path} is a file, not a checkpoint folder: give a folder path to autopar.save.")
    token = broadcast_text(uuid.uuid4().hex[:12] if _rank() == 0 else None)
    new = path.parent / f".{path.name}.new-{token}"
    model_sd, optim_sd = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(new))
    except CheckpointException as exc:  # a BaseException: it would escape the user's `except Exception`
        raise AutoparError(f"could not save to {path} (CheckpointException: {str(exc).splitlines()[0] if str(exc) else ''}"
                           "); the checkpoint there before, if any, is unchanged.") from exc
    _barrier()
    sums = {p.name: _digest(p) for p in _own_files(new, _rank())}
    atomic_write_text(new / _SUMS.format(rank=_rank()), yaml.safe_dump(sums, sort_keys=True))
    _barrier()
    if _rank() == 0:
        files: dict[str, Any] = {}
        for r in range(_world()):
            part = new / _SUMS.format(rank=r)
            files.update(load_yaml(part.read_text()))
            part.unlink()
        state = getattr(model, "_autopar_applied", None)
        fingerprint = state.profile.fingerprint if state is not None else model_fingerprint(model)
        meta = {"autopar_checkpoint": 1, "model_fingerprint": fingerprint,
                "plan": state.plan.to_dict() if state is not None else None,
                "optimizer": type(optimizer).__name__, "files": files}
        atomic_write_text(new / _META, yaml.safe_dump(meta, sort_keys=False))  # last: the folder is complete
        _switch(new, path, token)
    _barrier()
    return path


def _switch(new: Path, path: Path, token: str) -> None:
    """`new` (complete) becomes `path`; the checkpoint there before is removed once it no longer is `path`."""
    old = path.parent / f".{path.name}.old-{token}"
    if path.exists():
        os.replace(path, old)
    os.replace(new, path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def _complete(folder: Path) -> bool:
    return (folder / _META).is_file()


def _resolve(path: Path) -> Path:
    """`path`, or, where a save was interrupted between its two renames, the complete folder beside it (the
    new one first), with a warning; `path` itself when nothing better exists (its errors then say why)."""
    if _complete(path) or not path.parent.is_dir():
        return path
    beside = [p for kind in ("new", "old") for p in sorted(path.parent.glob(f".{path.name}.{kind}-*"),
                                                           key=lambda q: q.stat().st_mtime, reverse=True)]
    found = next((p for p in beside if p.is_dir() and _complete(p)), None)
    if found is None:
        return path
    warnings.warn(f"autopar: {path} is missing (a save was interrupted while switching folders); loading the "
                  f"complete checkpoint {found.name} beside it. Save again to put it back in place.", stacklevel=3)
    return found


def _verify(path: Path, files: Any) -> None:
    """Every listed file present, of its size and SHA-256 (each rank checks its share; every rank raises if one
    fails). Checkpoints saved before checksums (no `files`) are not checked."""
    error: BaseException | None = None
    if isinstance(files, dict):
        names = sorted(files)
        for name in names[_rank()::_world()]:
            f, want = path / name, files[name]
            if not f.is_file():
                error = AutoparError(f"the checkpoint file {f} is missing: the checkpoint at {path} is incomplete; "
                                     "load an earlier one or save again.")
                break
            got = _digest(f)
            if got["bytes"] != want.get("bytes") or got["sha256"] != want.get("sha256"):
                what = "truncated or extended" if got["bytes"] != want.get("bytes") else "changed (its SHA-256 differs)"
                error = AutoparError(f"the checkpoint file {f} is {what} since it was saved: the checkpoint at "
                                     f"{path} is damaged; load an earlier one or save again.")
                break
    first_failure(error)


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

    The optimizer must be the same kind as the one saved (its state is matched by parameter name): another
    kind is refused, as is a checkpoint of another model (by fingerprint), unless `force=True`. Every file is
    verified against the sizes and SHA-256s the save recorded.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = _resolve(Path(path))
    meta_path = path / _META
    if not meta_path.is_file():
        raise AutoparError(f"{path} is not an autopar checkpoint (no {_META}): give the folder autopar.save wrote.")
    try:
        meta = load_yaml(meta_path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise AutoparError(f"{meta_path} is not plain YAML ({exc.__class__.__name__}): the checkpoint is damaged.") from None
    if not isinstance(meta, dict) or meta.get("autopar_checkpoint") != 1:
        raise AutoparError(f"{meta_path} is not an autopar checkpoint description.")
    _verify(path, meta.get("files"))
    saved_kind = meta.get("optimizer")
    if not force and saved_kind is not None and saved_kind != type(optimizer).__name__:
        raise AutoparError(
            f"the checkpoint at {path} holds the state of an optimizer of kind {saved_kind}, and this one is "
            f"{type(optimizer).__name__}: its state would be read as another algorithm's (or not at all); build "
            f"a {saved_kind} to resume, or pass force=True to load the model and the matching state anyway.")
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
