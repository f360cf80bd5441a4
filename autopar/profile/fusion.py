"""What torch.compile's inductor would leave of a traced step's memory-bound work: its bytes and its kernels
(FusionModel), with inductor's reduction heuristics (reduction_loops); fed by autopar.profile.watch's StepWatcher.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef

_NORM = frozenset((
    "native_layer_norm", "native_layer_norm_backward", "native_batch_norm", "native_batch_norm_backward",
    "_native_batch_norm_legit", "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training",
    "cudnn_batch_norm", "cudnn_batch_norm_backward", "batch_norm_backward", "native_group_norm",
    "native_group_norm_backward", "_fused_rms_norm", "_fused_rms_norm_backward"))
_SOFTMAX = frozenset(("_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data",
                      "_safe_softmax"))
_REDUCTION = frozenset((
    "sum", "mean", "amax", "amin", "max", "min", "var", "var_mean", "std", "std_mean", "prod", "norm",
    "linalg_vector_norm", "cumsum", "cumprod", "logsumexp", "nll_loss_forward", "nll_loss_backward",
    "nll_loss2d_forward", "nll_loss2d_backward", "any", "all", "argmax", "argmin", "topk", "sort"))
_REDUCING = ("norm", "softmax", "reduction")  # memory-bound kinds that end a fused kernel's loop
# Inductor's reduction heuristics (torch/_inductor: choices.py, ir.py Reduction.num_splits), for Hopper's 132 SMs:
_PERSISTENT_RNUMEL = 1024  # a row reduction of at most this many elements runs in one persistent kernel with
# its neighbours (InductorChoices.should_use_persistent_reduction, ReductionHint.INNER); elements
_SPLIT_OUTPUTS = 132 * 2 * 32  # fewer outputs than this over a reduction of more than 32 elements: a split
# reduction, two kernels (num_splits: numel_hint < num_sm * 2 * 32); elements


def storage_key(t: torch.Tensor) -> Any:
    """The identity of `t`'s storage: views of one tensor share it."""
    return StorageWeakRef(t.untyped_storage())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def reduction_loops(name: str, tensors_in: list[torch.Tensor], tensors_out: list[torch.Tensor]
                    ) -> list[tuple[int, int]]:
    """The reductions a memory-bound op runs as (outputs, elements reduced per output), as inductor lowers it:
    a reduction op over its output; softmax over its rows (the last dim); layer, RMS and group norms over their
    statistics' groups, their backward also over the rows for the weight gradients (a column reduction); batch
    norm in training over each channel, forward and backward. Pointwise ops: none."""
    if not tensors_in or not tensors_out:
        return []
    x, out = tensors_in[0], tensors_out
    numel = max(x.numel(), 1)
    if name in _REDUCTION:
        kept = max(out[0].numel(), 1)
        return [(kept, numel // kept)]
    if name in _SOFTMAX:
        rows = x.shape[-1] if x.dim() else 1
        return [(numel // max(rows, 1), rows)]
    if name not in _NORM:
        return []
    if "batch_norm" in name:
        channels = x.shape[1] if x.dim() > 1 else 1
        training = not name.endswith("no_training") and (len(out) > 1 and out[1].numel() > 0)
        return [(channels, numel // channels)] if training or "backward" in name else []
    stats = next((t for t in (tensors_in if "backward" in name else out)[1:]
                  if 0 < t.numel() < numel and t.numel() * 2 <= numel), None)  # mean / rstd
    groups = stats.numel() if stats is not None else numel // max(x.shape[-1], 1)
    loops = [(groups, numel // groups)]
    if "backward" in name and len(out) > 1 and out[1].numel():
        loops.append((out[1].numel(), numel // max(out[1].numel(), 1)))  # the weight's gradient, over the rows
    return loops


class FusionModel:
    """The memory-bound bytes and kernels of the step once inductor fuses every chain of memory-bound ops
    between two compute ops (GEMMs, convolutions, attention: extern kernels inductor does not fuse into) into
    one loop: a chain reads each tensor it did not make once, and writes only what is read after it (by a
    compute op, a later chain or backward: saved activations) or is a gradient; what its own ops make and use
    stays in registers. An upper bound on inductor's fusion (it also recomputes cheap ops in backward rather
    than save them, and fuses across independent compute ops), a lower bound on its kernel count (a reduction
    over another shape splits a loop: one kernel more a reduction past the first)."""

    def __init__(self) -> None:
        self.region = 0
        self._made: dict[Any, list] = {}  # storage -> [bytes, scope, region, written]
        self._read: set[Any] = set()  # storages the current chain read already
        self._open = False  # the current region has a memory-bound kernel running
        self._reductions = 0
        self.bytes: dict[tuple, int] = defaultdict(int)  # (scope, backward, weight) -> bytes
        self.kernels: dict[tuple, int] = defaultdict(int)  # (scope, backward, weight) -> kernels
        self.backward = False

    def compute_op(self, inputs: list[torch.Tensor]) -> None:
        """A compute op reads its inputs from memory (what chains made of them is written) and ends the chain."""
        for t in inputs:
            self._write(storage_key(t))
        self.boundary()

    def boundary(self) -> None:
        self.region += 1
        self._read.clear()
        self._open, self._reductions = False, 0

    def memory_op(self, scope: int, kind: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
                  loops: Sequence[tuple[int, int]] = ()) -> None:
        """A memory-bound op of `scope` joins the current chain. Weight traffic (kind "weight") is counted apart
        (paid per micro-batch), and a backward one's outputs (gradients) are written whatever reads them.
        `loops`: its reductions (reduction_loops), each (outputs, elements reduced per output)."""
        where = (scope, self.backward, kind == "weight")
        if not self._open:
            self._open, self._reductions = True, 0
            self.kernels[where] += 1
        for outputs_numel, reduced in loops:
            self._reduction_kernels(where, outputs_numel, reduced)
        if kind in ("norm", "softmax") and not self._open:  # the op's own pointwise part (normalising) after
            # its reductions: a kernel that the ops after it join
            self._open = True
            self.kernels[where] += 1
        for t in inputs:
            key = storage_key(t)
            made = self._made.get(key)
            if made is not None and made[2] == self.region:
                continue  # made by this chain: fused
            self._write(key)
            if key not in self._read:
                self._read.add(key)
                self.bytes[where] += _nbytes(t)
        for t in outputs:
            key = storage_key(t)
            self._made[key] = [_nbytes(t), where, self.region, False]
            if where[1] and where[2]:
                self._write(key)

    def standalone(self, scope: int) -> None:
        """A kernel of its own that moves next to nothing: an update of a buffer the step mutates (inductor writes
        a mutated graph input back in a kernel apart). Counted once for BatchNorm's `num_batches_tracked` update
        (H200 kernel profile of compiled ResNet-50, bench/results/zoo_h200_profile_2026-12-01c.jsonl: 53
        `add_copy_` kernels, one a BatchNorm) and once, assumed, for its running statistics' write-back, which
        the profile does not isolate (that step ran about 830 kernels; 652 are counted with these)."""
        self.kernels[(scope, self.backward, True)] += 1

    def _reduction_kernels(self, where: tuple, outputs_numel: int, reduced: int) -> None:
        """A reduction's kernels (inductor's heuristics: _PERSISTENT_RNUMEL, _SPLIT_OUTPUTS). A persistent row
        reduction fuses with the ops around it, one more kernel if the loop holds a reduction already; a split
        reduction (few outputs: a bias or norm weight's gradient, batch-norm statistics) runs in a kernel of its
        own (unless it opened this one) and a second that combines the parts; a longer row reduction in a kernel
        of its own. After the last two, the ops that read the result run in a new kernel."""
        split = outputs_numel < _SPLIT_OUTPUTS and reduced > 32
        if not split and reduced <= _PERSISTENT_RNUMEL:
            self._reductions += 1
            if self._reductions > 1:
                self.kernels[where] += 1
            return
        self.kernels[where] += (1 if split else 0) + (1 if self._reductions else 0)
        self._open, self._reductions = False, 0

    def _write(self, key: Any) -> None:
        made = self._made.get(key)
        if made is not None and not made[3]:
            made[3] = True
            self.bytes[made[1]] += made[0]
