"""wrap's own cache: the plan wrap chose (and, on a GPU, measured) for a model, so that wrapping the same model
again for the same job starts at once (issue 33: "a second wrap of the same model plans from the cache").

The key is computed without tracing anything (`structure_key`): the model's class, every module's class and the
code of its `forward`, every parameter's and buffer's name, shape, dtype and requires_grad, training mode, a
Hugging Face model's config, the sample's structure with each tensor's shape and dtype, the loss function's code
and the `blocks` argument; then the job: the topology's fingerprint, the world size, the global batch, the loop,
torch's version and autopar's code (its files' sizes and dates). The device type and the weights' values are not in it (a plan depends on neither).
Anything else that changes the step without changing one of these (a global flag the forward reads, a
monkey-patched function it calls) is not seen: set AUTOPAR_NO_WRAP_CACHE=1 (or delete `<cache root>/wrapped`)
to plan afresh.

One YAML file per key, `<root>/wrapped/<digest>.yaml` (`autopar._util.io.cache_subdir`, the plan cache's root),
holding the key's fields in words, the plan (with its prediction and what was measured) and the date. Read with
`yaml.safe_load` (bounded, `autopar._util.yaml_text.load_yaml`) only after the file passed the privacy checks of
the other caches (`read_private_bytes`: not a symlink, this user's, not writable by others); a refused file raises
CacheError with the remedy, a file of another key (copied over) too. A plan the tuner cached for the same model
and job takes precedence: an entry records the tuner's key digest, and wrap plans afresh (and so finds the tuned
plan) when that file exists.
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import json
import os
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import yaml
from torch import nn
from torch.utils._pytree import tree_flatten

from ._util.io import atomic_write_text, cache_subdir, read_private_bytes, readable_cache_dir
from ._util.yaml_text import load_yaml
from .errors import CacheError, PlanError
from .plan_cache import current_torch_version
from .plans import Loop, Plan

#: Set to 1 to make wrap neither read nor write this cache.
DISABLE_ENV = "AUTOPAR_NO_WRAP_CACHE"
#: Part of every key: files of another layout (or of keys computed another way) are never found.
SCHEMA_VERSION = 1
MAX_FILE_BYTES = 1 << 20
_FORMAT_FIELD = "autopar_wrap_cache"
_TOP_LEVEL = (_FORMAT_FIELD, "key", "digest", "tuned_key", "plan", "stored_at")
_SUBDIR = "wrapped"
_REMEDY = "Delete it; wrap plans afresh and writes it again."


def enabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip() in ("", "0")


# ---------------------------------------------------------------------------------------------------
# The key
# ---------------------------------------------------------------------------------------------------
def _code_digest(code: types.CodeType, h: Any, depth: int = 0) -> None:
    """The bytecode, names and constants of `code` and the functions nested in it (not their addresses)."""
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            if depth < 8:
                _code_digest(const, h, depth + 1)
        elif isinstance(const, frozenset):
            h.update(repr(sorted(map(repr, const))).encode())
        else:
            h.update(repr(const).encode())


def _callable_digest(fn: Any) -> str:
    """Name and code of a function or method (its __call__ for an object); the type's name where there is none."""
    if fn is None:
        return "none"
    target = getattr(fn, "__func__", fn)
    if isinstance(target, nn.Module):
        target = type(target).forward
    code = getattr(target, "__code__", None)
    if code is None:
        call = getattr(type(target), "__call__", None)
        code = getattr(call, "__code__", None)
    h = hashlib.sha256(f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', type(target).__name__)}"
                       .encode())
    if code is not None:
        _code_digest(code, h)
    return h.hexdigest()[:16]


def _config_text(model: nn.Module) -> str:
    """A Hugging Face model's config (every field: attention implementation, dropout, ...), or ""."""
    config = getattr(model, "config", None)
    if config is None:
        return ""
    to_dict = getattr(config, "to_dict", None)
    data = to_dict() if callable(to_dict) else getattr(config, "__dict__", {})
    return json.dumps(data, sort_keys=True, default=lambda v: type(v).__name__)


def _sample_text(sample: Any) -> str:
    leaves, spec = tree_flatten(sample)
    parts = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append(f"T{tuple(leaf.shape)}:{leaf.dtype}")
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            parts.append(repr(leaf)[:100])
        else:
            parts.append(type(leaf).__qualname__)
    return f"{spec}|{';'.join(parts)}"


def structure_digest(model: nn.Module, sample: Any, *, loss_fn: Callable | None = None, blocks: Any = None) -> str:
    """A digest of what wrap's plan for `model` depends on, computed without tracing (see the module docstring)."""
    h = hashlib.sha256()
    h.update(f"{type(model).__module__}.{type(model).__qualname__}|training={model.training}".encode())
    forwards: dict[type, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        cls = type(module)
        if cls not in forwards:
            forwards[cls] = _callable_digest(getattr(cls, "forward", None))
        h.update(f"{name}:{cls.__module__}.{cls.__qualname__}:{forwards[cls]}:{module.training}\n".encode())
    for name, p in model.named_parameters(remove_duplicate=False):
        h.update(f"p {name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}\n".encode())
    for name, b in model.named_buffers(remove_duplicate=False):
        h.update(f"b {name}:{tuple(b.shape)}:{b.dtype}\n".encode())
    h.update(_config_text(model).encode())
    h.update(_sample_text(sample).encode())
    h.update(f"loss={_callable_digest(loss_fn)}|blocks={blocks if isinstance(blocks, (str, type(None))) else type(blocks).__name__}"
             .encode())
    return h.hexdigest()[:32]


@functools.lru_cache(maxsize=1)
def autopar_code_digest() -> str:
    """The size and modification time of every source file of this autopar (its planning code): a plan another
    version of autopar made is not reused."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        st = path.stat()
        h.update(f"{path.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class WrapKey:
    """What a cached wrap plan is for."""

    structure: str  # structure_digest
    topology_fingerprint: str
    world_size: int
    global_batch_size: int
    loop: str
    torch_version: str
    autopar_version: str

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA_VERSION, **self.__dict__}

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:32]

    def describe(self) -> str:
        return (f"model structure {self.structure[:12]}, topology {self.topology_fingerprint}, {self.world_size} "
                f"process(es), global batch {self.global_batch_size}, loop {self.loop}, torch {self.torch_version}")


def wrap_key(model: nn.Module, sample: Any, *, topology_fingerprint: str, world_size: int, global_batch_size: int,
             loop: Loop, loss_fn: Callable | None = None, blocks: Any = None) -> WrapKey:
    return WrapKey(structure=structure_digest(model, sample, loss_fn=loss_fn, blocks=blocks),
                   topology_fingerprint=topology_fingerprint, world_size=world_size,
                   global_batch_size=global_batch_size, loop=Loop.parse(loop).value,
                   torch_version=current_torch_version(), autopar_version=autopar_code_digest())


# ---------------------------------------------------------------------------------------------------
# Reading and writing
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WrapEntry:
    path: Path
    plan: Plan
    stored_at: str
    tuned_key: str | None  # the plan cache's digest for the same model and job (its file wins when it exists)


def lookup(key: WrapKey, *, directory: str | os.PathLike[str] | None = None) -> WrapEntry | None:
    """The entry cached under `key`, None when there is none; CacheError when a file is there but refused."""
    folder = cache_subdir(_SUBDIR, directory=directory, create=False)
    if folder is None:
        return None
    path = folder / f"{key.digest()}.yaml"
    raw = read_private_bytes(path, max_bytes=MAX_FILE_BYTES, what="wrap cache file")
    if raw is None:
        return None
    try:
        data = load_yaml(raw.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CacheError(f"{path} is not a wrap cache file ({first}). {_REMEDY}") from None
    if not isinstance(data, Mapping) or data.get(_FORMAT_FIELD) != SCHEMA_VERSION:
        raise CacheError(f"{path} is not a wrap cache file of layout {SCHEMA_VERSION}. {_REMEDY}")
    unknown = sorted(set(map(str, data)) - set(_TOP_LEVEL))
    if unknown:
        raise CacheError(f"{path} has unknown field(s) {', '.join(unknown)}. {_REMEDY}")
    if data.get("key") != key.to_dict() or data.get("digest") != key.digest():
        raise CacheError(f"{path} holds the plan of another model or job (copied or renamed over this key's file): "
                         f"autopar never applies a plan made for something else. {_REMEDY}")
    stored_at, tuned = data.get("stored_at"), data.get("tuned_key")
    if not isinstance(stored_at, str) or not (tuned is None or isinstance(tuned, str)):
        raise CacheError(f"{path}: stored_at must be a date and tuned_key a digest. {_REMEDY}")
    try:
        plan = Plan.from_dict(data.get("plan"))
    except (PlanError, TypeError, ValueError) as exc:
        raise CacheError(f"{path} holds an invalid plan: {exc} {_REMEDY}") from None
    return WrapEntry(path=path, plan=plan, stored_at=stored_at, tuned_key=tuned)


def store(plan: Plan, key: WrapKey, *, tuned_key: str | None = None,
          directory: str | os.PathLike[str] | None = None) -> Path | None:
    """Cache `plan` (with its prediction and measurement) under `key`; written atomically, 0600, in a 0700 folder.
    None, writing nothing, where the default cache folder cannot be made (warned once a process, as for every
    autopar cache: `autopar._util.io.readable_cache_dir`); CacheError where AUTOPAR_CACHE_DIR cannot be used."""
    if directory is None and readable_cache_dir() is None:
        return None
    folder = cache_subdir(_SUBDIR, directory=directory, create=True)
    assert folder is not None
    path = folder / f"{key.digest()}.yaml"
    doc = {_FORMAT_FIELD: SCHEMA_VERSION, "key": key.to_dict(), "digest": key.digest(), "tuned_key": tuned_key,
           "stored_at": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "plan": plan.to_dict()}
    header = f"# autopar wrap cache entry: {key.describe()}. Written by autopar.wrap; delete to forget it.\n"
    atomic_write_text(path, header + yaml.safe_dump(doc, sort_keys=False), mode=0o600)
    return path
