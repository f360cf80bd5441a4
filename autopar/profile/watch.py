"""What every op of the traced step does (StepWatcher, a TorchDispatchMode): the largest tensor, which storages
are weights, kernel launches, memory-bound bytes and what selective checkpointing keeps; and storage_key, the
identity of a tensor's storage the trace counts by."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

from .flops import matmul_ops


def storage_key(t: torch.Tensor) -> Any:
    """The identity of `t`'s storage: views of one tensor share it."""
    return StorageWeakRef(t.untyped_storage())


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class StepWatcher(TorchDispatchMode):
    """Watches every op of the traced step: the largest tensor it creates (bytes, op); which storages derive
    from parameters only (casts, transposes and views of weights, e.g. autocast's bf16 weight copies: those
    are weights, not activations, and do not grow with the batch); how many ops run (kernel launches); the
    bytes the non-matmul ops read and write (memory-bound time); and, per block in the forward, the bytes
    of matmul and attention outputs (what selective checkpointing keeps).

    `running_block()` is the index of the innermost block whose forward is running, or None; `forward` is
    set False by the trace before backward."""

    def __init__(self, param_storages: set[Any], param_shapes: set[tuple[int, ...]], num_blocks: int,
                 running_block: Callable[[], int | None]) -> None:
        super().__init__()
        self.param_shapes = param_shapes  # an op whose every output has a parameter's shape works on weights
        self.weight_storages = set(param_storages)
        self.running_block = running_block
        self.forward = True
        self.largest_bytes, self.largest_op = 0, "none"
        self.num_ops = 0
        self.traffic_bytes = 0
        self.weight_traffic_bytes = 0
        self.selective_bytes = [0] * num_blocks
        self._matmul = matmul_ops()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors_in, tensors_out = _tensors((args, kwargs)), _tensors(out)
        inputs = [storage_key(t) for t in tensors_in]
        from_weights = bool(inputs) and all(k in self.weight_storages for k in inputs)
        allocated = self._allocated(func, inputs, tensors_out, from_weights)
        if allocated:
            self.num_ops += 1
            if func.overloadpacket in self._matmul:
                self._count_matmul(allocated)
            else:
                self._count_traffic(allocated, tensors_in, tensors_out, from_weights)
        return out

    def _allocated(self, func: Any, inputs: list[Any], tensors_out: list[torch.Tensor], from_weights: bool) -> int:
        """Bytes of the op's new outputs (views of an input allocate nothing); outputs made from weights alone
        join the weights instead. Keeps the largest output seen."""
        allocated = 0
        for t in tensors_out:
            key = storage_key(t)
            if from_weights:
                self.weight_storages.add(key)
            elif key not in inputs:
                nbytes = _nbytes(t)
                allocated += nbytes
                if nbytes > self.largest_bytes:
                    self.largest_bytes, self.largest_op = nbytes, str(func.overloadpacket.__name__)
        return allocated

    def _count_matmul(self, allocated: int) -> None:
        """A matmul's or attention's output, in a block's forward: what selective checkpointing keeps."""
        block = self.running_block()
        if self.forward and block is not None:
            self.selective_bytes[block] += allocated

    def _count_traffic(self, allocated: int, tensors_in: list[torch.Tensor], tensors_out: list[torch.Tensor],
                       from_weights: bool) -> None:
        """A memory-bound op's bytes read and written, and whether they are weight traffic.

        Weight traffic: casts of the weights (autocast's copies, forward) and, in backward, ops whose inputs
        and outputs all have a parameter's shape (gradient casts and accumulation). Inputs count too, so that
        an activation whose shape happens to match a weight's (tokens = hidden in a flattened 2-D layer) is
        not taken for one unless everything it touches is."""
        moved = allocated + sum(_nbytes(t) for t in tensors_in)
        self.traffic_bytes += moved
        if from_weights or (not self.forward and all(tuple(t.shape) in self.param_shapes for t in tensors_in)
                            and all(tuple(t.shape) in self.param_shapes for t in tensors_out)):
            self.weight_traffic_bytes += moved
