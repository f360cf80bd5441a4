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
The next save to `path` that completes removes the folders such crashes left beside it (only those holding
nothing but a save's own files).

A save replaces only what it may: a new or empty folder, or one that `autopar.yaml` marks as an autopar
checkpoint and that holds nothing but that checkpoint's files. Any other folder (your notes, a data set, the
current directory, HOME, `/`) is refused in one line before anything is written. A path that is a symbolic
link saves into the folder it points to (the link stays). A save that fails (a full disk, a rank's error)
removes its new folder and names the cause; the checkpoint there before is unchanged.

Buffers that are not sharded (BatchNorm's running statistics) are one tensor per rank, and a checkpoint keeps one
rank's copy of each: where data-parallel ranks trained them on different data they differ, and `save` says so once
(a warning on rank 0 naming them) rather than silently keeping one.

Parameter groups are matched by the parameters' names, not their positions: groups built in another order
get their own settings back, and groups that do not match the saved ones are refused.

DCP's own metadata file is read by torch (with pickle): load checkpoints you trust, as with torch.load.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.nn as nn
import yaml

from ._util.dist import broadcast_text, first_failure
from ._util.io import atomic_write_text, fsync_dir
from ._util.state_steps import making_state
from ._util.strided import split_loaded, whole_for_load, whole_for_save
from ._util.trial_run import trial_run
from ._util.yaml_text import load_yaml
from .errors import AutoparError, PlanMismatchError
from .profile import model_fingerprint

_META = "autopar.yaml"
_SUMS = ".autopar-sums.{rank}.yaml"  # one rank's files and their hashes, merged into autopar.yaml by rank 0
_SHARD = re.compile(r"__(\d+)_")  # DCP's file of rank N: __N_I.distcp
_DCP_FILE = re.compile(r"__\d+_\d+\.distcp")  # the whole name of one (a user's __2024_results.csv is not)
_DRIFT_WARNED: set[tuple[str, ...]] = set()  # the sets of drifted buffers this process has warned of


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


def _protected(folder: Path) -> str | None:
    """What `folder` is, where autopar.save must never replace it whatever it holds: "/", HOME, the current
    directory (or a folder holding it)."""
    resolved = folder.resolve()
    if resolved == Path(resolved.anchor):
        return "the root of the file system"
    try:
        if resolved == Path.home().resolve():
            return "your home folder"
    except (RuntimeError, KeyError):  # no HOME and no password entry
        pass
    cwd = Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        return "the current directory" if resolved == cwd else "a folder that holds the current directory"
    return None


def _foreign_entries(folder: Path) -> list[str]:
    """The entries of an existing folder that are not an autopar checkpoint's: everything, unless `autopar.yaml`
    marks the folder as one; then whatever its manifest does not list (besides DCP's files and the manifest)."""
    entries = sorted(p.name for p in folder.iterdir())
    try:
        meta = load_yaml((folder / _META).read_bytes().decode("utf-8")) if (folder / _META).is_file() else None
    except (OSError, UnicodeDecodeError, AutoparError, yaml.YAMLError):
        meta = None
    if not isinstance(meta, dict) or meta.get("autopar_checkpoint") != 1:
        return entries
    listed = set(meta["files"]) if isinstance(meta.get("files"), dict) else set()
    return [e for e in entries if (folder / e).is_dir()
            or (e not in listed and e not in (_META, ".metadata") and not _DCP_FILE.fullmatch(e))]


def _refusal(path: Path) -> str:
    """Why `autopar.save` may not write to `path` ("" where it may): only a new or empty folder, or an autopar
    checkpoint holding nothing else, is ever replaced; never "/", HOME or the current directory."""
    if not path.exists():
        return ""
    if not path.is_dir():
        return f"{path} is a file, not a checkpoint folder: give a folder path to autopar.save."
    what = _protected(path)
    if what is not None:
        return (f"{path} is {what}: autopar.save never replaces it; give a folder of its own, e.g. "
                f"{path / 'checkpoint'}.")
    foreign = _foreign_entries(path)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        return (f"{path} holds files that are not an autopar checkpoint's ({shown}): autopar.save replaces only "
                "a new or empty folder or a checkpoint it wrote; give another folder.")
    return ""


def _state_bytes(*states: Any) -> int:
    """Bytes of this rank's tensors in nested state dicts (a DTensor's local shard)."""
    import torch

    total = 0
    stack = list(states)
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, torch.Tensor):
            local = item.to_local() if hasattr(item, "to_local") else item
            total += local.numel() * local.element_size()
    return total


def _no_space(exc: BaseException) -> OSError | None:
    """The 'no space left on device' (or quota) error behind `exc`, through DCP's per-rank failures."""
    seen, stack = set(), [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e
        stack += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return None


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def _save_error(path: Path, new: Path, exc: BaseException, need_bytes: int) -> AutoparError:
    """The one-line error of a failed save: the cause, and, for a full disk, how much was free and needed."""
    full = _no_space(exc)
    if full is not None:
        free = shutil.disk_usage(path.parent).free if path.parent.exists() else 0
        cause = (f"no space left on device ({_gib(free)} free on the file system of {path.parent}; this process's "
                 f"share of the checkpoint needs about {_gib(need_bytes)})")
    else:
        text = str(exc).strip().splitlines()
        cause = f"{type(exc).__name__}: {text[0] if text else ''}"
    return AutoparError(f"could not save to {path} ({cause}); the unfinished {new.name} was removed, and the "
                        "checkpoint there before, if any, is unchanged.")


#: The folders a tuner's run skipped saving to (said once each).
_SKIPPED: set[Path] = set()


def save(model: nn.Module, optimizer: Any, path: str | os.PathLike[str]) -> Path:
    """Save `model` (wrapped by autopar or not) and `optimizer` to the folder `path`, from every rank; a
    checkpoint already at `path` stays complete until the new one is, and only a new or empty folder or an
    autopar checkpoint is ever replaced (see the module docstring). In a run `autopar tune` launched it writes
    nothing, and says so once per folder."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = Path(path)
    if trial_run() is not None:  # the tuner runs this script a few steps under another plan: keep the user's files
        if path not in _SKIPPED:
            _SKIPPED.add(path)
            warnings.warn(f"autopar tune's {trial_run()} run: autopar.save({str(path)!r}) writes nothing (a trial "
                          "must not replace your checkpoint).", stacklevel=2)
        return path
    if path.is_symlink():  # save into the folder it points to; the link stays a link
        path = path.resolve()
    refusal = broadcast_text(_refusal(path) if _rank() == 0 else None)  # every rank refuses rank 0's way
    if refusal:
        raise AutoparError(refusal)
    _warn_drifted(model)
    token = broadcast_text(uuid.uuid4().hex[:12] if _rank() == 0 else None)
    started = time.time()
    new = path.parent / f".{path.name}.new-{token}"
    stepped = bool(optimizer.state)  # never stepped: torch's get_state_dict steps it once (lr 0) to make its state
    with making_state():  # (its lr-0 step is no training step: the tuner's clock skips it)
        model_sd, optim_sd = get_state_dict(model, optimizer)
    if not stepped:  # as it was, so the first real step is AdamW's first (its count, its bias correction)
        optimizer.state.clear()
    try:
        _write(model, optimizer, model_sd, optim_sd, new, dcp, stepped=stepped)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException; KeyboardInterrupt cleans too
        shutil.rmtree(new, ignore_errors=True)
        if not isinstance(exc, Exception) and type(exc).__name__ != "CheckpointException":
            raise
        raise _save_error(path, new, exc, _state_bytes(model_sd, optim_sd)) from exc
    if _rank() == 0:
        _switch(new, path, token, started)
    _barrier()
    return path


def _drifted_buffers(model: nn.Module, mesh: Any) -> list[str]:
    """Collective over the data-parallel axes of `mesh` (not the pipeline's or tensor-parallel ones): names of
    the plain floating buffers a checkpoint saves (persistent, not DTensors) whose values differ between
    data-parallel ranks (BatchNorm's running statistics): a checkpoint keeps one rank's copy of each."""
    import torch
    from torch.distributed.tensor import DTensor

    if mesh is None:
        return []
    names = mesh.mesh_dim_names or ()
    axes = [a for a in ("dp_replicate", "dp_shard") if a in names and mesh.size(names.index(a)) > 1]
    named = []
    seen: set[int] = set()
    for prefix, module in model.named_modules():  # FSDP2 keeps the modules' own names
        for key, b in module._buffers.items():
            if (b is None or key in module._non_persistent_buffers_set or id(b) in seen or isinstance(b, DTensor)
                    or not b.is_floating_point() or b.is_meta):
                continue
            seen.add(id(b))
            named.append((f"{prefix}.{key}" if prefix else key, b))
    if not axes or not named:
        return []
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    stats = torch.stack([torch.stack([b.detach().double().sum(), b.detach().double().pow(2).sum()])
                         for _, b in named]).to(device)
    differ = torch.zeros(len(named), dtype=torch.bool, device=device)
    for axis in axes:
        lo, hi = stats.clone(), stats.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=mesh.get_group(axis))
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=mesh.get_group(axis))
        differ |= ~torch.isclose(lo, hi, rtol=1e-6, atol=1e-12).all(dim=1)
    return [n for (n, _), d in zip(named, differ.tolist()) if d]


def _warn_drifted(model: nn.Module) -> None:
    """On every rank of a wrapped model (a collective): find the buffers that differ between data-parallel ranks;
    rank 0 warns once per process for each set of them."""
    state = getattr(model, "_autopar_applied", None)
    mesh = getattr(state, "mesh", None)
    if mesh is None or _world() == 1:
        return
    drifted = tuple(_drifted_buffers(model, mesh))
    if not drifted or _rank() != 0 or drifted in _DRIFT_WARNED:
        return
    _DRIFT_WARNED.add(drifted)
    shown = ", ".join(drifted[:6]) + (f" and {len(drifted) - 6} more" if len(drifted) > 6 else "")
    warnings.warn(f"autopar.save: {len(drifted)} buffer(s) differ between the data-parallel ranks ({shown}): the "
                  "checkpoint keeps one rank's copy, and every rank loads that; to keep them equal, convert before "
                  "wrap: model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)", UserWarning, stacklevel=3)


def _write(model: nn.Module, optimizer: Any, model_sd: dict, optim_sd: dict, new: Path, dcp: Any, *,
           stepped: bool = True) -> None:
    """Every rank's shards, their sums, and (rank 0, last) the manifest, into the hidden folder `new`."""
    dcp.save(whole_for_save({"model": model_sd, "optim": optim_sd}), checkpoint_id=str(new))  # (fused layers whole)
    _barrier()
    sums = {p.name: _digest(p) for p in _own_files(new, _rank())}
    mine = {"files": sums, "param_groups": _group_names(optim_sd)}
    atomic_write_text(new / _SUMS.format(rank=_rank()), yaml.safe_dump(mine, sort_keys=True))
    _barrier()
    error: BaseException | None = None
    if _rank() == 0:
        try:
            files: dict[str, Any] = {}
            groups: list[set[str]] = []
            for r in range(_world()):  # a pipeline stage holds its own parameters in each group
                part = new / _SUMS.format(rank=r)
                theirs = load_yaml(part.read_text())
                files.update(theirs["files"])
                for i, names in enumerate(theirs["param_groups"]):
                    groups += [set() for _ in range(i + 1 - len(groups))]
                    groups[i].update(names)
                part.unlink()
            state = getattr(model, "_autopar_applied", None)
            fingerprint = state.profile.fingerprint if state is not None else model_fingerprint(model)
            meta = {"autopar_checkpoint": 1, "model_fingerprint": fingerprint,
                    "plan": state.plan.to_dict() if state is not None else None,
                    "optimizer": type(optimizer).__name__, "optimizer_stepped": stepped, "files": files,
                    "param_groups": [sorted(g) for g in groups]}
            atomic_write_text(new / _META, yaml.safe_dump(meta, sort_keys=False))  # last: the folder is complete
        except Exception as exc:  # every rank learns of it (first_failure), rank 0 raises its own
            error = exc
    first_failure(error)


def _group_names(optim_sd: dict) -> list[list[str]]:
    """Each optimizer group's parameter names, in order (get_state_dict names them)."""
    return [[str(n) for n in group.get("params", [])] for group in optim_sd.get("param_groups", [])]


def _switch(new: Path, path: Path, token: str, started: float) -> None:
    """`new` (complete) becomes `path`; the checkpoint there before is removed once it no longer is `path`, and
    so are the folders earlier saves to `path` left beside it when killed (_leftovers; `started`: this save's
    start, time.time())."""
    old = path.parent / f".{path.name}.old-{token}"
    if path.exists():
        os.replace(path, old)
    os.replace(new, path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)
    for folder in _leftovers(path, started):
        shutil.rmtree(folder, ignore_errors=True)


#: What a save writes into its folder: DCP's shards and metadata (and its temporary file), the sums of each rank,
#: the manifest, and atomic_write_text's temporary files of those two
_OWN_FILE = "|".join((re.escape(_SUMS).replace(re.escape("{rank}"), r"\d+"), re.escape(_META)))
_SAVE_FILE = re.compile(rf"{_DCP_FILE.pattern}|(__\d+)?\.metadata(\.tmp)?|{_OWN_FILE}|\.({_OWN_FILE})\.\w+\.tmp")


def _leftovers(path: Path, before: float) -> list[Path]:
    """The folders a save to `path` killed before its end left beside it (`.NAME.new-TOKEN`, `.NAME.old-TOKEN`):
    plain folders (no links) holding nothing but what a save writes, none of it changed since `before` (a save
    to the same path still running elsewhere keeps its folder). Anything else there is the user's: kept."""
    name = re.compile(rf"\.{re.escape(path.name)}\.(new|old)-[0-9a-f]{{12}}")
    found = []
    for folder in path.parent.iterdir():
        if not name.fullmatch(folder.name) or folder.is_symlink() or not folder.is_dir():
            continue
        try:
            entries = list(folder.iterdir())
            stale = folder.stat().st_mtime < before and all(
                not e.is_symlink() and e.is_file() and _SAVE_FILE.fullmatch(e.name) and e.stat().st_mtime < before
                for e in entries)
        except OSError:
            continue
        if stale:
            found.append(folder)
    return found


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
    fails). A manifest without a mapping of files is damaged (`load(..., verify=False)` reads a checkpoint
    written before checksums)."""
    error: BaseException | None = None
    well_formed = isinstance(files, dict) and files and all(
        isinstance(k, str) and "/" not in k and k not in (".", "..") and isinstance(v, dict) and isinstance(v.get("bytes"), int)
        and isinstance(v.get("sha256"), str) for k, v in files.items())
    if not well_formed:
        what = ("missing" if files is None else "malformed" if isinstance(files, dict) else
                f"a {type(files).__name__}, not a mapping of file sizes and hashes")
        error = AutoparError(f"{path / _META} is damaged: its `files` is {what}; "
                             "the checkpoint cannot be verified (one saved by an autopar before checksums loads with "
                             "autopar.load(..., verify=False)).")
    else:
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


def _groups_differ(path: Path, saved: int, own: int) -> str:
    return (f"the checkpoint at {path} has {saved} optimizer parameter groups and this optimizer {own}: build the "
            "optimizer with the groups it was saved with.")


def _group_order(own: list[list[str]], saved: Any, aliases: dict[str, str], num_loaded: int,
                 path: Path) -> list[int]:
    """For each of this optimizer's groups (its parameters' names), the index of the saved group that held the
    same parameters: groups are matched by name, never by position. A checkpoint that did not record its groups'
    names (saved before this check) is taken in order."""
    if saved is None:
        return list(range(len(own)))
    if not isinstance(saved, list) or not all(isinstance(g, list) for g in saved):
        raise AutoparError(f"{path / _META} is damaged: its `param_groups` is not a list of name lists.")
    if len(saved) != len(own) or num_loaded != len(own):
        raise AutoparError(_groups_differ(path, len(saved), len(own)))
    where = {name: j for j, names in enumerate(saved) for name in names}
    order = []
    for k, names in enumerate(own):
        if not names:  # a group this process holds no parameter of (a pipeline stage's): by position
            order.append(k)
            continue
        found = {where[n] if n in where else where.get(aliases.get(n, ""), -1) for n in names} - {-1}
        missing = [n for n in names if n not in where and aliases.get(n) not in where]
        if len(found) != 1 or missing:
            detail = (f"{missing[0]} is in none of the saved groups" if missing else
                      "its parameters were in saved groups " + ", ".join(map(str, sorted(found))))
            raise AutoparError(f"this optimizer's parameter group {k} matches no saved group ({detail}): build "
                               "the optimizer's groups with the parameters they held when saved (their order may differ).")
        order.append(found.pop())
    if sorted(order) != list(range(len(own))):
        raise AutoparError(f"two of this optimizer's parameter groups match one saved group of {path}: build the "
                           "optimizer's groups with the parameters they held when saved.")
    return order


def load(model: nn.Module, optimizer: Any, path: str | os.PathLike[str], *, force: bool = False,
         verify: bool = True) -> None:
    """Load a checkpoint saved by `save` into `model` and `optimizer`, under any plan and world size.

    The optimizer must be the same kind as the one saved (its state is matched by parameter name): another
    kind is refused, as is a checkpoint of another model (by fingerprint), unless `force=True`. Every file is
    verified against the sizes and SHA-256s the save recorded; a manifest without them is refused as damaged
    unless `verify=False` (a checkpoint saved before checksums). Each parameter group takes the settings
    (learning rate, weight decay, ...) of the saved group that held the same parameters, by name.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

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
    if verify:
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
    with making_state():  # (its lr-0 step is no training step: the tuner's clock skips it)
        model_sd, optim_sd = get_state_dict(model, optimizer)
    aliases = _tied_aliases(path, optim_sd, state)
    for mine, theirs in aliases.items():  # a tied weight saved under its other name
        optim_sd["state"][theirs] = optim_sd["state"].pop(mine)
    # Which parameters each optimizer group holds is this plan's business (a pipeline stage saved only its
    # own): keep ours, and take the groups' settings (learning rate, betas, ...) from the checkpoint.
    own_params = [list(group["params"]) for group in optim_sd.get("param_groups", [])]
    from torch.distributed.checkpoint.api import CheckpointException

    saved_groups = meta.get("param_groups")
    if isinstance(saved_groups, list) and len(saved_groups) != len(own_params):  # before DCP's missing-key error
        raise AutoparError(_groups_differ(path, len(saved_groups), len(own_params)))
    # A parameter the saved optimizer never stepped (a head no batch had used yet) has no state there: it gets none
    # here either, as then (torch's get_state_dict made state for every parameter, which DCP would look for).
    saved_keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    stateless = [n for n in optim_sd.get("state", {}) if not any(k.startswith(f"optim.state.{n}.") for k in saved_keys)]
    for name in stateless:
        del optim_sd["state"][name]
    try:
        states = {"model": model_sd, "optim": optim_sd}
        swapped = whole_for_load(states)  # (fused layers loaded whole, then split back)
        dcp.load(states, checkpoint_id=str(path))
        split_loaded(swapped)
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        raise AutoparError(
            f"could not load {path} into this model and optimizer ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}). The optimizer must be of the kind that was saved, "
            "and every parameter of this model must be in the checkpoint."
        ) from exc
    for mine, theirs in aliases.items():
        optim_sd["state"][mine] = optim_sd["state"].pop(theirs)
    loaded = optim_sd.get("param_groups", [])
    order = _group_order(own_params, meta.get("param_groups"), aliases, len(loaded), path)
    optim_sd["param_groups"] = [dict(loaded[j], params=params) for j, params in zip(order, own_params)]
    # (strict=False lets those stateless parameters be; every model key was in the checkpoint, or dcp.load raised)
    with making_state():
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=StateDictOptions(strict=not stateless))
    if meta.get("optimizer_stepped") is False:  # saved before its first step: no state, as then
        optimizer.state.clear()
