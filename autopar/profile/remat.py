"""What a torch.compile'd step saves for backward, from the eager step's autograd graph (CompiledSaved).

Inductor's partitioner (torch._functorch.partitioners.min_cut_rematerialization_partition) saves, of the joint
forward-backward graph, the cheapest set of forward tensors from which backward can recompute the rest. Replayed
here on the autograd graph the traced eager step leaves (each node a forward op, `_input_metadata` its outputs'
shapes, `_saved_*` what its backward reads), with the partitioner's rules:

- compute ops (matmuls, convolutions, attention, embeddings, and ops it has no decomposition for) are never
  recomputed; a tensor a compute op's backward reads (a GEMM's input, for its weight gradient) must exist in
  backward, so it is saved, not recomputed ("materialized in backward"), unless that backward reads it through
  a cast: a float32 input of a GEMM under bf16 autocast, whose backward autocasts too (`_AUTOCAST_GEMMS`);
- pointwise ops, casts, views, norms and softmaxes (decomposed into pointwise ops and small reductions) are
  recomputed in backward where that saves bytes; reductions whose output is 4x smaller than their input, and
  random ops (dropout: its mask, a boolean) are saved;
- a pointwise op that reads a tensor after a compute op has read it (the residual stream: `x + attn(x)`) is
  not recomputed ("used far apart");
- weights (and casts of them) are free: they live between steps anyway (autopar counts the bf16 copies apart).

Then a minimum cut (max-flow, Dinic) between what must run in forward and what backward reads gives the saved
bytes, attributed to the block whose forward ran the op. One thing the partitioner does not decide: on the H200
(torch 2.11), an attention call that is neither causal nor masked eagerly runs unfused under compile where the
model's mask is one Hugging Face's masking_utils skips eagerly but builds while dynamo traces (transformers 5.17:
`_ignore_bidirectional_mask_sdpa` returns False whenever it is tracing): SDPA then gets an explicit mask and runs
its math path (bench/results/zoo_h200_2026-12-01.jsonl: compiled BERT and ViT hold 5.6 and 1.3 GiB more than the
partitioner's saved set, what the 4 bytes per score element of saved bf16 scores and probabilities, and BERT's
1-byte dropout mask, come to; neither gains speed from compile). That is counted per such call
(`unfused_attention_bytes`) only where the traced forward skipped such a mask (autopar.profile.hf_masks).
An attention call with no mask to build stays fused compiled: on the H200 Whisper's encoder (16 x 12 x 1500 x 64,
no mask) and timm's ViT ran `_scaled_dot_product_cudnn_attention` in their compiled graphs, and Hugging Face's ViT
did too once the mask was skipped while compiling (peak 6.67 -> 5.25 GiB, timm's ViT: 5.26); counting Whisper's
encoder calls unfused predicted 34.5 GiB for a measured 14.2.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves

from .._util.batch import default_loss
from .hf_masks import CompileMasks
from .watch import storage_key

_VIEWS = ("ViewBackward", "UnsafeViewBackward", "ReshapeAliasBackward", "TransposeBackward", "TBackward",
          "PermuteBackward", "ExpandBackward", "SqueezeBackward", "UnsqueezeBackward", "SelectBackward",
          "SliceBackward", "SplitBackward", "SplitWithSizesBackward", "UnbindBackward", "AsStridedBackward",
          "AliasBackward", "NarrowBackward", "DiagonalBackward", "UnfoldBackward", "ViewAsRealBackward",
          "ViewAsComplexBackward", "ChunkBackward")
# Recomputable in backward (the partitioner's allowlist: pointwise, casts, clones, indexing; norms and softmaxes
# as inductor decomposes them into pointwise ops and reductions).
_POINTWISE = frozenset((
    "Add", "Sub", "Rsub", "Mul", "Div", "Pow", "Neg", "Exp", "Exp2", "Expm1", "Log", "Log1p", "Log2", "Log10",
    "Tanh", "Sigmoid", "Relu", "Gelu", "Silu", "Mish", "Hardswish", "Hardsigmoid", "Hardtanh", "LeakyRelu", "Elu",
    "Softplus", "Threshold", "Clamp", "ClampMin", "ClampMax", "Where", "Rsqrt", "Sqrt", "Reciprocal", "ToCopy",
    "Clone", "MaskedFill", "Abs", "Erf", "Erfc", "Erfinv", "Addcmul", "Addcdiv", "Lerp", "Maximum", "Minimum", "Cos",
    "Sin", "Atan", "Sign", "Square", "Floor", "Ceil", "Round", "Trunc", "Frac", "Fmod", "Remainder", "NativeDropout",
    "NativeLayerNorm", "NativeBatchNorm", "CudnnBatchNorm", "NativeGroupNorm", "FusedRmsNorm", "BatchNormWithUpdate",
    "Softmax", "LogSoftmax", "SafeSoftmax", "Index", "Gather", "Fill", "Copy", "Lift", "TypeAs", "Tril", "Triu",
    "Roll", "Flip"))
# (Not there, as the partitioner's allowlist (torch._functorch.partitioners.get_default_op_list) does not hold them
# and inductor's decompositions leave them whole: constant_pad_nd, repeat, cumsum and prod; saved where backward
# needs them. Mamba-2's chunked scan pads and cumsums (L x L) segment sums: its compiled saved set was 34% under
# the partitioner's with them recomputable.)
_REDUCTIONS = frozenset(("Sum", "Mean", "Amax", "Amin", "Max", "Min", "Var", "Std", "VarMean", "StdMean", "Norm",
                         "LinalgVectorNorm", "Logsumexp", "NllLoss", "NllLoss2D"))
_ATTENTION = ("Attention",)  # ScaledDotProduct{Flash,Efficient,Cudnn}Attention..., FlashAttention, EfficientAttention
_NEVER_MATERIALIZES = frozenset(("Cat", "Stack"))  # unfusible producers that inputs fuse into (memory fusion)
# Compute ops on autocast's lower-precision list: under bf16 autocast, AOTAutograd traces their backward under it too,
# so the backward GEMM of one that ran in float32 in forward (inside an op that upcasts, as SDPA's math path does)
# reads bf16 casts of its saved float32 inputs: a fusible cast, which lets the partitioner recompute those inputs
# (the dropout output of T5's attention is rebuilt from the probabilities and the mask in backward: torch 2.13's
# partitioner on CPU; counted as materialized, T5's compiled allocated peak was predicted +35% over the H100's).
_AUTOCAST_GEMMS = frozenset(("Mm", "Bmm", "Addmm", "Baddbmm", "Addbmm", "Mv", "Addmv", "Dot", "Convolution"))
_INF = 1 << 62


def _kind(node: Any) -> str:
    """The node's op name without autograd's `Backward0` suffix ("Addmm", "NativeLayerNorm")."""
    name = type(node).__name__
    return name[:name.find("Backward")] if "Backward" in name else name


def _is_view(node: Any) -> bool:
    return type(node).__name__.startswith(_VIEWS)


def _fusible(node: Any) -> bool:
    """Whether inductor fuses the op into its neighbours' kernels (pointwise ops and reductions)."""
    kind = _kind(node)
    return kind in _POINTWISE or kind in _REDUCTIONS


def _itemsize(dtype: torch.dtype) -> int:
    if dtype == torch.bool:
        return 1
    return (torch.finfo(dtype).bits if dtype.is_floating_point else torch.iinfo(dtype).bits) // 8


def _output_bytes(node: Any) -> int:
    """Bytes of a node's outputs (the forward op's results), from the shapes autograd keeps for their gradients."""
    total = 0
    for meta in node._input_metadata:
        n = 1
        for s in meta.shape:
            n *= int(s)
        total += n * _itemsize(meta.dtype)
    return total


def _saved_tensors(node: Any) -> list[torch.Tensor]:
    """The tensors a node's backward reads (its `_saved_*` attributes)."""
    out = []
    for attr in dir(node):
        if attr.startswith("_saved_"):
            value = getattr(node, attr)
            out += [t for t in (value if isinstance(value, (tuple, list)) else (value,)) if isinstance(t, torch.Tensor)]
    return out


@dataclass(frozen=True)
class CompiledSaved:
    """Bytes a compiled step saves for backward on the traced sample: per block and outside the blocks, and of
    those per block, the unfused attention calls' share."""

    block_bytes: tuple[int, ...]
    outside_bytes: int
    unfused_attention_bytes: tuple[int, ...]


class _Graph:
    """The forward ops of one step as its autograd graph holds them, in forward order, views folded into the node
    whose output they view, leaves (parameters) left out."""

    def __init__(self, root: Any) -> None:
        seen, stack = {root}, [root]
        while stack:
            node = stack.pop()
            for f, _ in node.next_functions:
                if f is not None and f not in seen:
                    seen.add(f)
                    stack.append(f)
        self.nodes = sorted((n for n in seen if not _is_view(n) and type(n).__name__ != "AccumulateGrad"),
                            key=lambda n: n._sequence_nr())
        self.inputs = {n: [b for b in (self.base(f) for f, _ in n.next_functions if f is not None) if b is not None]
                       for n in self.nodes}
        self.users: dict[Any, list[Any]] = defaultdict(list)
        for n, ins in self.inputs.items():
            for u in ins:
                self.users[u].append(n)

    @staticmethod
    def base(node: Any) -> Any:
        """The node whose output `node`'s output views (itself where it is no view); None for a leaf."""
        while node is not None and _is_view(node):
            node = next((f for f, _ in node.next_functions if f is not None), None)
        return None if node is None or type(node).__name__ == "AccumulateGrad" else node


class _Partition:
    """The partitioner's decisions on one step's graph: what is banned from recomputation, the minimum cut."""

    def __init__(self, probe: "CompiledSavedProbe", root: Any) -> None:
        self.probe, self.graph = probe, _Graph(root)
        self.size = {n: _output_bytes(n) for n in self.graph.nodes}
        weights = probe.weight_storages()
        self.needed: set[Any] = set()  # nodes whose output backward reads
        self.materialized: set[Any] = set()  # ... read by an op that cannot be fused (a GEMM's input)
        self.constant = [0] * (probe.num_blocks + 1)  # saved tensors with no history (masks, statistics, ids)
        self.unfused = [0] * (probe.num_blocks + 1)
        counted: set[Any] = set()
        for n in self.graph.nodes:
            for t in _saved_tensors(n):
                key = storage_key(t)
                if key in weights:
                    continue
                base = _Graph.base(t.grad_fn) if t.grad_fn is not None else None
                if base is not None:
                    self.needed.add(base)
                    if not _fusible(n) and _kind(n) not in _NEVER_MATERIALIZES and not self._read_cast(n, t):
                        self.materialized.add(base)
                elif key not in counted:
                    counted.add(key)
                    self.constant[self.block(n)] += _constant_bytes(n, t)
            if probe.masks.bidirectional and any(a in _kind(n) for a in _ATTENTION):
                self.unfused[self.block(n)] += _unfused_attention_bytes(n)

    def _read_cast(self, node: Any, t: torch.Tensor) -> bool:
        """Whether `node`'s compiled backward reads `t` through a cast (see _AUTOCAST_GEMMS)."""
        return self.probe.autocast and t.dtype == torch.float32 and _kind(node) in _AUTOCAST_GEMMS

    def block(self, node: Any) -> int:
        """The node's block index, or num_blocks for the ops outside the blocks."""
        b = self.probe.block_of(node._sequence_nr())
        return self.probe.num_blocks if b is None else b

    def recomputable(self, node: Any) -> bool:
        kind = _kind(node)
        if kind in _REDUCTIONS:  # a reduction 4x smaller than its input is saved, not recomputed
            return 4 * self.size.get(node, 0) >= sum(self.size.get(u, 0) for u in self.graph.inputs.get(node, ()))
        return kind in _POINTWISE

    def banned(self) -> set[Any]:
        """Nodes the partitioner never recomputes: compute ops and reductions, tensors a compute op's backward
        reads, and pointwise ops that read a tensor after a compute op has read it (the residual stream)."""
        g = self.graph
        first_compute_use: dict[Any, int] = {}
        for n in reversed(g.nodes):  # users come later in forward order
            uses = [first_compute_use[v] if _fusible(v) else v._sequence_nr() for v in g.users.get(n, ())]
            first_compute_use[n] = min(uses, default=_INF)
        out = {n for n in g.nodes if not self.recomputable(n)} | self.materialized
        for n in g.nodes:
            if any(first_compute_use[u] < n._sequence_nr() for u in g.inputs[n]):
                out.add(n)
        return out

    def run(self) -> CompiledSaved:
        cut, banned = _Cut(), self.banned()
        for n in self.graph.nodes:
            cut.edge(("in", n), ("out", n), self.size[n])
            if n in banned:
                cut.edge("source", ("in", n), _INF)
            if n in self.needed:
                cut.edge(("out", n), "sink", _INF)
            for u in self.graph.inputs[n]:
                cut.edge(("out", u), ("in", n), _INF)
        reach = cut.source_side("source", "sink")
        saved, casts = list(self.constant), set()
        for n in self.graph.nodes:
            if ("in", n) in reach and ("out", n) not in reach:
                if _kind(n) == "ToCopy":  # inductor computes equal casts of one tensor once (eager autocast
                    key = (tuple(self.graph.inputs[n]), str(n._input_metadata[0].dtype))  # casts per op)
                    if key in casts:
                        continue
                    casts.add(key)
                saved[self.block(n)] += self.size[n]
        blocks = self.probe.num_blocks
        return CompiledSaved(block_bytes=tuple(s + u for s, u in zip(saved[:blocks], self.unfused)),
                             outside_bytes=saved[blocks] + self.unfused[blocks],
                             unfused_attention_bytes=tuple(self.unfused[:blocks]))


def _constant_bytes(consumer: Any, t: torch.Tensor) -> int:
    """Bytes of a saved tensor without autograd history. A dropout mask (a floating tensor multiplied into one
    that requires grad, as CPU dropout makes it) is a boolean on CUDA and under inductor: one byte an element."""
    if _kind(consumer) == "Mul" and t.is_floating_point() and \
            any(s is not t and s.requires_grad for s in _saved_tensors(consumer)):
        return t.numel()
    return t.untyped_storage().nbytes()


def _unfused_attention_bytes(node: Any) -> int:
    """What an attention call that is neither causal nor masked saves when compiled (unfused on the H200, see the
    module's docstring): its scores and probabilities in the query's dtype (4 bytes a score element in bf16),
    and with dropout its mask (1 byte)."""
    q, k = getattr(node, "_saved_query", None), getattr(node, "_saved_key", None)
    masked = any(isinstance(getattr(node, a, None), torch.Tensor) for a in ("_saved_attn_mask", "_saved_attn_bias"))
    causal = bool(getattr(node, "_saved_is_causal", False)) or int(getattr(node, "_saved_custom_mask_type", 0) or 0)
    if q is None or k is None or q.dim() != 4 or masked or causal:
        return 0
    elements = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
    dropout = float(getattr(node, "_saved_dropout_p", 0.0) or 0.0) > 0
    return int(elements) * (2 * q.element_size() + (1 if dropout else 0))


class _Cut:
    """A minimum s-t cut by Dinic's max-flow on integer capacities."""

    def __init__(self) -> None:
        self.cap: dict[Any, dict[Any, int]] = defaultdict(dict)

    def edge(self, a: Any, b: Any, c: int) -> None:
        self.cap[a][b] = self.cap[a].get(b, 0) + c
        self.cap[b].setdefault(a, 0)

    def source_side(self, s: Any, t: Any) -> set[Any]:
        """Runs the max-flow; the vertices reachable from `s` in the residual graph."""
        while True:
            level = self._levels(s)
            if t not in level:
                return set(level)
            pointer = {v: list(self.cap[v]) for v in level}
            while self._augment(s, t, level, pointer):
                pass

    def _levels(self, s: Any) -> dict[Any, int]:
        level, queue = {s: 0}, deque([s])
        while queue:
            v = queue.popleft()
            for w, c in self.cap[v].items():
                if c > 0 and w not in level:
                    level[w] = level[v] + 1
                    queue.append(w)
        return level

    def _augment(self, s: Any, t: Any, level: dict[Any, int], pointer: dict[Any, list]) -> bool:
        """One augmenting path in the level graph (iterative depth-first search); False when none is left."""
        path, v = [], s
        while v != t:
            nxt = pointer[v]
            while nxt and not (self.cap[v][nxt[-1]] > 0 and level.get(nxt[-1]) == level[v] + 1):
                nxt.pop()
            if nxt:
                path.append((v, nxt[-1]))
                v = nxt[-1]
            elif not path:
                return False
            else:  # a dead end: leave it out of this level graph
                level.pop(v)
                v = path.pop()[0]
                pointer[v].pop()
        flow = min(self.cap[a][b] for a, b in path)
        for a, b in path:
            self.cap[a][b] -= flow
            self.cap[b][a] += flow
        return True


class CompiledSavedProbe:
    """Attached to a StepTrace (as its `loss_fn`, with `hooked(units)` around the run): after the loss, reads the
    step's autograd graph and partitions it as inductor would. `result()` is None where the graph could not be
    read (an autograd attribute this torch lacks): the cost model then uses its calibrated ratio instead."""

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor] | None, num_blocks: int) -> None:
        self.loss_fn, self.num_blocks = loss_fn, num_blocks
        self.weight_storages: Callable[[], set[Any]] = set  # the trace's weight storages, set by the caller
        self._ranges: list[tuple[int, int, int]] = []  # (block, last sequence nr before it, its last one)
        self._starts: dict[int, list[int]] = defaultdict(list)
        self._result: CompiledSaved | None = None
        self.masks = CompileMasks()  # which masks torch.compile would build (the trace's, set by build.py)
        self.autocast = False  # whether the traced step ran under bf16 autocast (set by build.py)

    def __call__(self, output: Any, sample: Any) -> torch.Tensor:
        loss = self.loss_fn(output, sample) if self.loss_fn is not None else default_loss(output)
        if isinstance(loss, torch.Tensor) and loss.grad_fn is not None:
            self._result = self._partition(loss.grad_fn)
        return loss

    def _partition(self, root: Any) -> CompiledSaved | None:
        """The partition of the graph under `root`, read with no mode, hook or autograd recording active (the
        trace's fake mode, FLOP counter, watcher and CUDA autocast policy see none of its reads), and
        leaving nothing behind: the nodes and saved tensors it reads are dropped on return, the weights'
        storages too. None where the graph cannot be read (internals another torch lacks): the profile then
        says so (no compiled_saved_bytes) and the cost model uses its calibrated ratio."""
        try:
            with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.no_grad():
                return _Partition(self, root).run()
        except Exception:  # never stops the profile
            return None
        finally:
            self.weight_storages = set

    def result(self) -> CompiledSaved | None:
        return self._result

    @contextlib.contextmanager
    def hooked(self, units: list[tuple[str, nn.Module]]) -> Iterator[None]:
        """Hooks on the blocks: the range of autograd sequence numbers each block's forward made."""
        handles = []
        for i, (_, m) in enumerate(units):
            handles.append(m.register_forward_pre_hook(_BlockStart(self, i), with_kwargs=True))
            handles.append(m.register_forward_hook(_BlockEnd(self, i), with_kwargs=True))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def block_of(self, seq: int) -> int | None:
        """The innermost block whose forward made the node numbered `seq` (None: outside every block)."""
        best: tuple[int, int] | None = None
        for block, start, end in self._ranges:
            if start < seq <= end and (best is None or end - start < best[1]):
                best = (block, end - start)
        return best[0] if best else None


class _BlockStart:
    def __init__(self, probe: CompiledSavedProbe, index: int) -> None:
        self.probe, self.index = probe, index

    def __call__(self, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.probe._starts[self.index].append(_last_sequence_nr((args, kwargs)))


class _BlockEnd:
    def __init__(self, probe: CompiledSavedProbe, index: int) -> None:
        self.probe, self.index = probe, index

    def __call__(self, _module: nn.Module, _args: tuple, _kwargs: dict, out: Any) -> None:
        starts = self.probe._starts[self.index]
        start = starts.pop() if starts else -1
        self.probe._ranges.append((self.index, start, _last_sequence_nr(out)))


def _last_sequence_nr(tree: Any) -> int:
    """The largest autograd sequence number among the tensors in `tree` (-1: none has a history)."""
    return max((t.grad_fn._sequence_nr() for t in tree_leaves(tree)
                if isinstance(t, torch.Tensor) and t.grad_fn is not None), default=-1)
