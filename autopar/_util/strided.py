"""Checkpoints of tensors under DTensor's strided sharding (tensor parallelism's fused projections: GPT-2's c_attn,
a fused q/k/v or gate/up layer, each rank holding its share of every part). torch's distributed checkpoint (DCP,
torch 2.11-2.13) places a strided shard's chunk as if it were a plain shard: the ranks' chunks overlap and the save
fails ("has overlapping chunks"; every GPT-2 under tensor parallelism could not be saved, found by a helper). Such
tensors are saved whole instead (replicated: DCP writes one copy) and loaded into a whole buffer, then split back
into the strided layout; every other tensor is left to DCP."""

from __future__ import annotations

from typing import Any, Callable

import torch


def _is_strided(t: Any) -> bool:
    placements = getattr(t, "placements", None)
    return placements is not None and any(type(p).__name__ == "_StridedShard" for p in placements)


def _walk(tree: Any, fn: Callable[[Any], Any]) -> Any:
    """`tree` (dicts and lists of tensors, as a state dict is) with `fn` applied to each strided DTensor."""
    if isinstance(tree, dict):
        return {k: _walk(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_walk(v, fn) for v in tree]
    return fn(tree) if _is_strided(tree) else tree


def _replicated(t: Any) -> Any:
    from torch.distributed.tensor import Replicate

    return t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim)


def whole_for_save(state: Any) -> Any:
    """`state` with every strided DTensor replaced by the same values, replicated (collective over its mesh)."""
    return _walk(state, _replicated)


def whole_for_load(state: Any) -> list[tuple[Any, Any, Any, Any]]:
    """Swap, in place, every strided DTensor of `state` for a replicated buffer of its whole shape for DCP to load
    into (DCP also writes the non-tensor values it loads into these very dicts); returns what `split_loaded` needs
    to put each strided tensor back, with the loaded values."""
    swapped: list[tuple[Any, Any, Any, Any]] = []

    def visit(node: Any) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in list(items):
            if _is_strided(value):
                whole = _replicated(value)  # (its values are overwritten by the load)
                node[key] = whole
                swapped.append((node, key, value, whole))
            else:
                visit(value)

    visit(state)
    return swapped


def split_loaded(swapped: list[tuple[Any, Any, Any, Any]]) -> None:
    """Each loaded whole buffer's values into its strided tensor's local share, and the strided tensor back in its
    place in the state dict."""
    from torch.distributed.tensor import distribute_tensor

    with torch.no_grad():
        for node, key, strided, whole in swapped:
            share = distribute_tensor(whole.to_local(), strided.device_mesh, strided.placements)
            strided.to_local().copy_(share.to_local())
            node[key] = strided
