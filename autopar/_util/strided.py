"""Checkpoints of tensors under DTensor's strided sharding (tensor parallelism's fused projections: GPT-2's c_attn,
a fused q/k/v or gate/up layer, each rank holding its share of every part). torch's distributed checkpoint (DCP,
torch 2.11-2.13) places a strided shard's chunk as if it were a plain shard: the ranks' chunks overlap and the save
fails ("has overlapping chunks"; every GPT-2 under tensor parallelism could not be saved, found by a helper). Such
tensors are saved whole instead (replicated: DCP writes one copy) and loaded into a whole buffer, then split back
into the strided layout; every other tensor is left to DCP.

Under tensor parallelism and FSDP together (tp x dp_shard), a fused nn.Linear's weight is split twice along one dim:
tensor parallelism's strided shard, then FSDP's chunk of each rank's share (placements `(_StridedShard(0, sf=tp),
_StridedShard(0, sf=3))`). torch (2.11-2.13) gathers such a tensor wrong (`full_tensor()`, `redistribute`: the parts
come back in the wrong rows; a fused q/k/v or gate/up layer's full weight and its checkpoint were wrong, found by a
helper, though training was right). `full_tensor` and the save and load here undo the two splits one at a time:
FSDP's chunks over its mesh dim, then tensor parallelism's strided shard over its own."""

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


def _two_splits_of_one_dim(t: Any) -> bool:
    """A 2-D mesh's tensor whose outer placement (FSDP's) is a strided shard of the dim the inner one shards."""
    placements = getattr(t, "placements", ())
    if len(placements) != 2 or type(placements[0]).__name__ != "_StridedShard":
        return False
    inner = getattr(placements[1], "dim", None)
    return inner is not None and inner == placements[0].dim and t.device_mesh.mesh_dim_names is not None


def _inner_shape(t: Any) -> tuple[int, ...]:
    """The shape of the inner split's share (what the outer split chunks): the dim divided by the inner mesh size."""
    dim, size = t.placements[1].dim, t.device_mesh.size(1)
    shape = list(t.shape)
    shape[dim] //= size
    return tuple(shape)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


def full_tensor(t: Any) -> Any:
    """DTensor `t` gathered whole (a plain tensor, on every rank; a collective), right for two splits of one dim
    (FSDP over tensor parallelism's strided shard, above), which torch's `full_tensor()` gathers wrong."""
    if not _two_splits_of_one_dim(t):
        return t.full_tensor()
    from torch.distributed.tensor import DTensor, Shard

    outer, inner = t.device_mesh.mesh_dim_names
    dim, shape = t.placements[0].dim, _inner_shape(t)
    share = DTensor.from_local(t.to_local(), t.device_mesh[outer], [Shard(dim)], run_check=False, shape=shape,
                               stride=_contiguous_stride(shape)).full_tensor()
    return DTensor.from_local(share, t.device_mesh[inner], [t.placements[1]], run_check=False,
                              shape=tuple(t.shape), stride=_contiguous_stride(tuple(t.shape))).full_tensor()


def _local_share(whole: Any, like: Any) -> Any:
    """This rank's local tensor of `like`'s layout, cut from the plain tensor `whole` (every rank holds it)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    if not _two_splits_of_one_dim(like):
        return distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None).to_local()
    outer, inner = like.device_mesh.mesh_dim_names
    share = distribute_tensor(whole, like.device_mesh[inner], [like.placements[1]], src_data_rank=None).to_local()
    return distribute_tensor(share, like.device_mesh[outer], [Shard(like.placements[0].dim)],
                             src_data_rank=None).to_local()


def _replicated(t: Any) -> Any:
    from torch.distributed.tensor import DTensor, Replicate

    if _two_splits_of_one_dim(t):
        return DTensor.from_local(full_tensor(t), t.device_mesh, [Replicate()] * t.device_mesh.ndim, run_check=False)
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
    with torch.no_grad():
        for node, key, strided, whole in swapped:
            strided.to_local().copy_(_local_share(whole.to_local(), strided))
            node[key] = strided
