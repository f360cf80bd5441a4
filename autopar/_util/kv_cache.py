"""A Hugging Face model's key/value cache, off in training forwards.

A model whose config has `use_cache = True` (every Hugging Face decoder by default) builds a cache of each
layer's keys and values in every forward, training ones included, where nothing reads it. Two things go wrong
with it there: a checkpointed layer's recomputation appends to the cache its first run filled, so the replay no
longer matches (Hugging Face turns the cache off under its own gradient checkpointing for that reason), and a
layer compiled on its own (per block, as under FSDP) is guarded on its layer's slot of the cache, so dynamo
compiles it again for every layer and stops at its recompile limit (8), leaving the later layers eager (OLMoE on
an H100, bench/NOTES.md 2026-12-06; a tiny Llama of 4 layers: 4 graphs with the cache, 1 without).

The hook below passes `use_cache=False` to a training forward whose call leaves it unset (absent or None), on
each module that has such a config and a forward that takes `use_cache`. Eval forwards and calls that pass
`use_cache` themselves (`generate` does) keep it; the config is not changed; the loss and logits are the same.
"""
from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

_HANDLE = "_autopar_kv_cache_off"  # on a hooked module: the hook's handle


def _use_cache_position(module: nn.Module) -> int | None:
    """The position of `use_cache` among the forward's positional parameters (None: the forward takes no
    `use_cache`, or only by keyword, then at a position past any call's arguments)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    for i, p in enumerate(params):
        if p.name == "use_cache":
            return i if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) else sys.maxsize
    return None


def _cached(module: nn.Module) -> bool:
    return getattr(getattr(module, "config", None), "use_cache", False) is True


def _no_cache_in_training(position: int):
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]):
        if not module.training or len(args) > position or kwargs.get("use_cache") is not None:
            return None
        return args, {**kwargs, "use_cache": False}
    return hook


def kv_cache_off_in_training(model: nn.Module) -> list[str]:
    """Hook every module of `model` whose config caches keys and values and whose forward takes `use_cache`, so
    that its training forwards run without the cache (see the module's docstring); returns the hooked modules'
    names ("" for `model` itself), those hooked before included. Idempotent."""
    hooked = []
    for name, module in model.named_modules():
        if _HANDLE in vars(module):
            hooked.append(name)
            continue
        if not _cached(module) or (position := _use_cache_position(module)) is None:
            continue
        handle = module.register_forward_pre_hook(_no_cache_in_training(position), with_kwargs=True)
        object.__setattr__(module, _HANDLE, handle)
        hooked.append(name)
    return hooked


def remove_kv_cache_hooks(model: nn.Module, *, keep: frozenset[int] = frozenset()) -> None:
    """Undo kv_cache_off_in_training, on the modules whose id is not in `keep`."""
    for module in model.modules():
        if id(module) not in keep and (handle := vars(module).pop(_HANDLE, None)) is not None:
            handle.remove()


@contextmanager
def kv_cache_off_while(model: nn.Module) -> Iterator[None]:
    """kv_cache_off_in_training for the block's duration (a trace of the step wrap will run), leaving hooks that
    were there before in place."""
    before = frozenset(id(m) for m in model.modules() if _HANDLE in vars(m))
    kv_cache_off_in_training(model)
    try:
        yield
    finally:
        remove_kv_cache_hooks(model, keep=before)
