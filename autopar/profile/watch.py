"""What every op of the traced step does (StepWatcher, a TorchDispatchMode): the largest tensor, which storages
are weights, kernel launches, memory-bound bytes, what selective checkpointing keeps, and every op by kind,
shape and dtype (OpRecords: GEMMs, convolutions, attention, grouped GEMMs, memory-bound ops), in the block
that ran it, forward and backward, with what torch.compile's fusion would leave of the memory-bound work
(autopar.profile.fusion's FusionModel), and attention marked with the masks only a compiled run builds
(autopar.profile.hf_masks)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from .._util.batch import tensors_of
from .flops import FlopTally, fp32_grouped_mm, gemm_ops, matmul_ops
from .fusion import (_NORM, _REDUCING, _REDUCTION, _SOFTMAX, FusionModel, _nbytes, reduction_loops,
                     storage_key)
from .hf_masks import CompileMasks
from .live import LiveMemory
from .model_profile import OpGroup, OpRecord

# batch-norm kernels whose schema does not mark the running statistics they update in training as written
_BATCH_NORMS = frozenset({"native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm"})


def _argument(func: Any, args: tuple, kwargs: dict, name: str) -> Any:
    """The value an op was given for its schema argument `name` (positional or keyword), or None."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == name:
            return args[i] if i < len(args) else kwargs.get(name)
    return None


BEFORE, AFTER, LOSS = -1, -2, -3  # scopes of ops outside the blocks: before the first block runs, the rest of the
# model's forward, and the loss (what runs after the model's forward returns: the user's loss, outside a compiled
# model's graph)

_GEMMS = {"mm": 0, "addmm": 1, "bmm": 0, "baddbmm": 1, "_scaled_mm": 0}  # name: index of the first matrix
_GROUPED = ("_grouped_mm", "_scaled_grouped_mm", "grouped_mm_fallback")  # the last: transformers' custom op
_GROUPED_BACKWARD = "grouped_mm_fallback_backward"  # transformers' (input, weight, offs, grad) -> both gradients
_ATTENTION = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
              "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
              "_efficient_attention_forward")
_ATTENTION_BACKWARD = tuple(n.replace("_forward", "") + "_backward" for n in _ATTENTION)
_SEQ_FIRST = ("_flash_attention", "_efficient_attention")  # (batch, seq, heads, dim) layouts; the rest heads first
_COPY = frozenset((
    "_to_copy", "copy", "copy_", "clone", "cat", "stack", "index_select", "gather", "scatter", "scatter_add",
    "index", "index_put", "index_add", "embedding", "embedding_dense_backward", "constant_pad_nd", "repeat",
    "repeat_interleave", "_unsafe_index", "_unsafe_index_put", "flip", "roll", "slice_scatter", "select_scatter",
    "masked_scatter", "new_zeros", "new_empty", "zeros", "zeros_like", "empty_like", "full", "fill", "fill_"))
# The ops recorded as compute (_ComputeOp), not memory-bound.
_COMPUTE = frozenset((*_GEMMS, *_GROUPED, _GROUPED_BACKWARD, "convolution", "convolution_backward", *_ATTENTION,
                      *_ATTENTION_BACKWARD))


_VIEWS = ("view", "_unsafe_view", "reshape")
_SPLITS = ("split", "split_with_sizes", "unsafe_split", "unsafe_split_with_sizes", "unbind", "slice", "narrow")


def _consumer(func: Any, args: Any, kwargs: dict, tensors_out: list[torch.Tensor]) -> str:
    """The first op that read a Linear-like call's output, in words: "view" and the shape it made ("view 2,16,4,3,16"),
    a split or slice, the dim it cut (counted from the end) and its pieces' widths there ("split -1 64,64,64"), else
    the op's name."""
    name = func.overloadpacket.__name__
    source = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if name in _VIEWS and tensors_out:
        return "view " + ",".join(str(int(d)) for d in tensors_out[0].shape)
    if name in _SPLITS and source is not None:
        at = 1 if name in ("unbind", "slice", "narrow") else 2  # where the op's schema has its dim
        dim = kwargs.get("dim", args[at] if len(args) > at else 0)
        dim = int(dim) if isinstance(dim, int) else 0
        dim = dim - source.dim() if dim >= 0 else dim
        widths = ",".join(str(int(t.shape[dim])) for t in tensors_out if t.dim() >= -dim)
        return f"split {dim} {widths}"
    return name


def _dtype_of(tensors: list[torch.Tensor]) -> str:
    """The dtype of an op's first floating input ("bfloat16"), or "" where it has none."""
    floating = next((t for t in tensors if t.is_floating_point()), None)
    return str(floating.dtype).replace("torch.", "") if floating is not None else ""


def _prod(xs: Any) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


def memory_kind(name: str) -> str:
    """The memory-bound kind of an op packet's name (everything that is not a GEMM, convolution or attention)."""
    if name in _NORM:
        return "norm"
    if name in _SOFTMAX:
        return "softmax"
    if name in _REDUCTION:
        return "reduction"
    return "copy" if name in _COPY else "elementwise"


# ---------------------------------------------------------------------------------------------------
# Compute ops as records: (kind, shape, flops, batch_dim, weight_dims)
# ---------------------------------------------------------------------------------------------------
class _ComputeOp:
    """One compute-bound op's record fields, from its arguments; `weights(t)` says whether a tensor is a
    weight (derived from parameters only) and `weight_shaped(t)` whether it has a parameter's shape."""

    def __init__(self, weights: Callable[[torch.Tensor], bool], weight_shaped: Callable[[torch.Tensor], bool],
                 backward: bool, masks: CompileMasks) -> None:
        self.weights, self.weight_shaped, self.backward = weights, weight_shaped, backward
        self.masks = masks

    def of(self, name: str, func: Any, args: tuple, kwargs: dict, out: Any) -> list[tuple]:
        if name in _GEMMS:
            return [self._gemm(args[_GEMMS[name]], args[_GEMMS[name] + 1], out)]
        if name == "convolution":
            return [_conv(args[0], args[1], out, transposed=bool(args[6]), groups=int(args[8]))]
        if name == "convolution_backward":
            return _conv_backward(*args[:11])
        if name in _GROUPED:
            return [_grouped(args[0], args[1])]
        if name == _GROUPED_BACKWARD:  # input (T, K), weight (E, K, N): dX = dY W^T per group, dW = X^T dY
            (t, k), (e, _, n) = args[0].shape, args[1].shape
            per = max(1, int(t) // int(e))
            return [("grouped_gemm", (int(e), per, int(k), int(n)), 2.0 * t * k * n, 1, ()),
                    ("grouped_gemm", (int(e), int(k), int(n), per), 2.0 * t * k * n, 3, ())]
        named = _named(func, args, kwargs)
        return [_attention(name, named, backward=name in _ATTENTION_BACKWARD, masks=self.masks)]

    def _gemm(self, a: torch.Tensor, b: torch.Tensor, out: Any) -> tuple:
        """(batch, M, N, K): the batch-growing dim is M where B is a weight (x W), N where A is (W x), K for a
        weight gradient (dY^T x X, a parameter-shaped output in backward), else the batch (bmm) or M."""
        batch = a.shape[0] if a.dim() == 3 else 1
        m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
        shape = (int(batch), int(m), int(n), int(k))
        out_t = out if isinstance(out, torch.Tensor) else tensors_of(out)[0]
        if self.weights(b):
            grow, dims = 1, (3, 2)
        elif self.weights(a):
            grow, dims = 2, (1, 3)
        elif self.backward and a.dim() == 2 and self.weight_shaped(out_t):
            grow, dims = 3, (1, 2)
        else:
            grow, dims = (0 if batch > 1 else 1), ()
        return ("gemm", shape, 2.0 * _prod(shape), grow, dims)


def _channels_last(x: torch.Tensor) -> int:
    return int(x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous())


def _conv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *, transposed: bool, groups: int) -> tuple:
    """A convolution's forward as its implicit GEMM per group (M, N, K, groups, channels_last, input channels a
    group)."""
    k, cl = _prod(w.shape[2:]), _channels_last(x)
    if transposed:  # the input gradient of a convolution: rows over the input positions
        m, n, kd = x.shape[0] * _prod(x.shape[2:]), w.shape[1] * k, w.shape[0] // groups
    else:
        m, n, kd = x.shape[0] * _prod(out.shape[2:]), w.shape[0] // groups, w.shape[1] * k
    c_in = w.shape[0] // groups if transposed else w.shape[1]
    shape = (int(m), int(n), int(kd), int(groups), cl, int(c_in))
    return ("conv", shape, 2.0 * m * n * kd * groups, 0, ())


def _conv_backward(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, _bias_sizes: Any, _stride: Any,
                   _padding: Any, _dilation: Any, transposed: bool, _output_padding: Any, groups: int,
                   mask: Any) -> list[tuple]:
    """The input-gradient and weight-gradient GEMMs of a convolution's backward (those `mask` asks for); each
    does the forward's FLOPs (the input gradient's depth is what gives them: strided convolutions' rows see
    fewer taps each)."""
    k, cl = _prod(w.shape[2:]), _channels_last(x)
    out_positions = _prod((x if transposed else grad).shape[2:])
    flops = 2.0 * x.shape[0] * out_positions * _prod(w.shape)
    c_out, c_in = (w.shape[1] * groups, w.shape[0]) if transposed else (w.shape[0], w.shape[1] * groups)
    per = int(c_in // groups)  # the forward's input channels a group (what its loads are aligned by)
    records = []
    if mask[0]:
        m, n = x.shape[0] * _prod(x.shape[2:]), c_in // groups
        kd = max(1, round(flops / (2.0 * m * n * groups)))
        records.append(("conv", (int(m), int(n), int(kd), int(groups), cl, per), flops, 0, ()))
    if mask[1]:
        m, n, kd = c_out // groups, c_in // groups * k, x.shape[0] * out_positions
        records.append(("conv", (int(m), int(n), int(kd), int(groups), cl, per), flops, 2, ()))
    return records


def _grouped(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """torch._grouped_mm as (groups, M, N, K), the mean GEMM of a group (the split is data: routing)."""
    if a.dim() == 2 and b.dim() == 3:  # tokens sorted by expert (T, K) x experts' weights (E, K, N)
        e, (t, k), n = b.shape[0], a.shape, b.shape[-1]
        shape, grow = (e, max(1, t // e), n, k), 1
    elif a.dim() == 3 and b.dim() == 3:  # (E, M, K) x (E, K, N)
        shape, grow = (a.shape[0], a.shape[1], b.shape[-1], a.shape[-1]), 1
    elif a.dim() == 2 and b.dim() == 2:  # a weight gradient: (M, T) x (T, N) -> (E, M, N), T split by expert
        e = 1  # the number of groups is offs' length, not visible in the shapes: taken from the output below
        shape, grow = (e, a.shape[0], b.shape[1], a.shape[1]), 3
    else:  # (E, M, K) x (K, T): T split by expert
        shape, grow = (a.shape[0], a.shape[1], max(1, b.shape[-1] // a.shape[0]), a.shape[-1]), 2
    shape = tuple(int(s) for s in shape)
    return ("grouped_gemm", shape, 2.0 * _prod(shape), grow, ())


def _named(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """An op's arguments by their schema names."""
    names = [a.name for a in func._schema.arguments]
    return {**dict(zip(names, args)), **kwargs}


def _compile_marks(causal: int, masked: int, a: dict[str, Any], masks: CompileMasks) -> tuple[int, int]:
    """A forward call's (causal, masked) with the marks of masks only torch.compile builds: causal 2 (a causal
    call masked compiled), masked 2 (an uncausal one). A call the trace masks with a mask of one head
    (batch or 1, 1, queries, keys: Hugging Face's padding and causal masks, not a per-head bias) that a real eager
    run skips (an all-ones padding mask) runs as the eager run does: causal unmasked, or unmasked."""
    if not masked:
        if causal and masks.causal:
            return 2, 0
        if not causal and masks.bidirectional:
            return 0, 2
        return causal, masked
    mask = next((a[m] for m in ("attn_mask", "attn_bias", "bias") if isinstance(a.get(m), torch.Tensor)), None)
    if not causal and mask is not None and mask.dim() == 4 and mask.shape[1] == 1:
        if masks.eager_skips_causal:
            return 2, 0
        if masks.eager_skips_bidirectional:
            return 0, 2
    return causal, masked


def _attention(name: str, a: dict[str, Any], *, backward: bool, masks: CompileMasks) -> tuple:
    """A fused attention kernel's record: (batch, heads, kv_heads, q_len, k_len, qk_dim, v_dim, causal, window,
    masked, dropout); FLOPs as autopar.profile.flops counts them (the full score matrix). A forward call without a
    mask whose mask torch.compile would build (autopar.profile.hf_masks) is marked: causal 2, or masked 2 where it
    is not causal."""
    q, k, v = a["query"], a["key"], a["value"]
    if name.startswith(_SEQ_FIRST):  # (batch, seq, heads, dim)
        (b, sq, hq, d), (sk, hk), dv = q.shape, (k.shape[1], k.shape[2]), v.shape[-1]
    else:
        b, hq, sq, d = (q.shape if q.dim() == 4 else (1, 1, *q.shape[-2:]))
        sk, hk, dv = k.shape[-2], (k.shape[1] if k.dim() == 4 else 1), v.shape[-1]
    causal = int(bool(a.get("is_causal", False)) or a.get("custom_mask_type", 0) in (1, 2))
    window = a.get("window_size_left", a.get("window_size", None))
    window = int(window) if isinstance(window, int) and window >= 0 else 0
    masked = int(any(isinstance(a.get(m), torch.Tensor) for m in ("attn_mask", "attn_bias", "bias")))
    key = (tuple(int(s) for s in (b, hq, hk, sq, sk, d, dv)), causal, masked)
    if backward:  # as its forward was marked (matched by shape and the kernel's own causality and mask)
        causal, masked = masks.marked.get(key, (causal, masked))
    else:
        marks = _compile_marks(causal, masked, a, masks)
        if marks != (causal, masked):
            masks.marked[key] = marks
        causal, masked = marks
    dropout = int(float(a.get("dropout_p", 0.0) or 0.0) > 0.0)  # the kernel draws a dropout mask (both directions)
    shape = tuple(int(s) for s in (b, hq, hk, sq, sk, d, dv, causal, window, masked, dropout))
    per = (3 * d + 2 * dv) if backward else (d + dv)
    return ("attention", shape, 2.0 * b * hq * sq * sk * per, 0, ())


# ---------------------------------------------------------------------------------------------------
# The watcher
# ---------------------------------------------------------------------------------------------------
class StepWatcher(TorchDispatchMode):
    """Watches every op of the traced step: the largest tensor it creates (bytes, op); which storages derive
    from parameters only (casts, transposes and views of weights, e.g. autocast's bf16 weight copies: those
    are weights, not activations, and do not grow with the batch); how many ops run (kernel launches); the
    bytes the non-matmul ops read and write (memory-bound time); per block in the forward, the bytes of
    matmul and attention outputs (what selective checkpointing keeps); and every op that allocates as an
    OpRecord of its scope (`op_groups()`), with the FusionModel's fused bytes and kernels. Of the other ops,
    casts of the weights and in-place ops are records too (kernels), and views, reshapes, transposes and
    expands count in one record of kind "view" per scope and direction (count only, no bytes): no kernel,
    but an eager op's host time all the same (Python binding, dispatcher, an autograd node: autopar.cost.ops).

    The scope of a forward op is the running block (`running_block()`, the index of the innermost block whose
    forward is running, or None: then BEFORE until a block has run, else AFTER); of a backward op, the scope
    of the forward op that made the autograd node running it (each node is labelled when a later forward op
    reads a tensor it made). `forward` is set False by the trace before backward."""

    def __init__(self, param_storages: set[Any], param_shapes: set[tuple[int, ...]], num_blocks: int,
                 running_block: Callable[[], int | None], *, compile_masks: CompileMasks | None = None) -> None:
        super().__init__()
        self.param_shapes = param_shapes  # an op whose every output has a parameter's shape works on weights
        self.weight_storages = set(param_storages)
        self.running_block = running_block
        self.chain: Any = None  # the trace's BlockChain (autopar.profile.chain): told of each forward op outside blocks
        self.forward = True
        self.in_loss = False  # set by the trace once the model's forward has returned: the loss's ops
        # which masks torch.compile would build (autopar.profile.hf_masks), the trace's
        self.compile_masks = compile_masks if compile_masks is not None else CompileMasks()
        self.largest_bytes, self.largest_op = 0, "none"
        self.largest_scope, self.largest_backward = AFTER, False  # where the largest output was made
        self.differentiated_in: int | None = None  # the scope whose forward ran a backward (torch.autograd.grad)
        self.written: set[Any] = set()  # the storages of weights and buffers an op of the forward wrote
        self.num_ops = 0
        self.traffic_bytes = 0
        self.weight_traffic_bytes = 0
        self.selective_bytes = [0] * num_blocks
        self.alternate_bytes = [0] * num_blocks  # of selective_bytes, what "alternate" keeps: every other GEMM's
        self.alternate_recompute_flops = [0.0] * num_blocks  # the forward FLOPs of the GEMMs "alternate" recomputes
        self.gemm_bytes = [0] * num_blocks  # of selective_bytes, the dense GEMMs' outputs ("gemms" recomputes them)
        self.gemm_flops = [0.0] * num_blocks  # the forward FLOPs of those GEMMs
        self._gemms_seen = [0] * num_blocks  # GEMMs of each block's forward so far
        self._gemm = gemm_ops()
        self.num_blocks = num_blocks
        self._matmul = matmul_ops()
        self._records: dict[int, dict[tuple, list]] = defaultdict(dict)  # scope -> key -> [count, flops, bytes]
        self._scope_of: WeakIdKeyDictionary = WeakIdKeyDictionary()  # forward tensor -> the scope that made it
        self._node_scope: dict[int, int] = {}  # id(autograd node) -> scope
        self._nodes: list[Any] = []  # the labelled nodes, alive so that their ids stay theirs
        self._after_blocks = False
        self._backward_started = False
        self.fusion = FusionModel()
        self.flops = FlopTally()  # the step's FLOPs, in all and by scope (block), as torch's FlopCounterMode counts
        self.live = LiveMemory()  # the bytes alive op by op: the eager step's peak (autopar.profile.live)
        # Under autocast (set by the trace: trainable parameters' storages by name), the trainable weights a forward
        # matmul read in float32: autocast did not reach it (a custom op's, an MoE's grouped GEMM)
        self.autocast_weights: dict[Any, str] = {}
        self.fp32_matmul_weights: set[str] = set()
        self.matmul_weights: set[str] = set()  # of autocast_weights, those a forward matmul read (in any dtype)
        # Set by the trace: a Linear-like call's output storage -> the call's index; the first op that reads it is
        # described in `consumers` (index -> "view 2,16,4,3,8", "split -1", ...): how the model takes a fused
        # projection's output apart (tensor parallelism's layout, autopar.layout.fused_parts_layout)
        self.watch_consumers: dict[Any, int] = {}
        self.consumers: dict[int, str] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # (strided tensors: a sparse one, an embedding's sparse gradient, has no storage of its own to follow)
        tensors_in = [t for t in tensors_of((args, kwargs)) if t.layout == torch.strided]
        scope = self._scope(tensors_in)
        if self.forward and self.differentiated_in is None and torch._C._current_graph_task_id() != -1:
            self.differentiated_in = scope  # autograd's engine runs this op inside the forward
        if self.forward and (func._schema.is_mutable or func.overloadpacket.__name__ in _BATCH_NORMS):
            self._note_writes(func, args, kwargs or {})
        out = fp32_grouped_mm(func, args, kwargs or {})  # the fake kernel refuses fp32 grouped GEMMs
        if out is None:
            out = self.flops.run(func, args, kwargs or {}, scope)
        else:
            self.flops.count(func, args, kwargs or {}, out, scope)
        tensors_out = [t for t in tensors_of(out) if t.layout == torch.strided]
        inputs = [storage_key(t) for t in tensors_in]
        if self.watch_consumers and self.forward and func.namespace != "prim" and \
                func.overloadpacket.__name__ not in ("detach", "alias"):  # (the trace's own calls)
            for key in inputs:
                if key in self.watch_consumers:
                    self.consumers[self.watch_consumers.pop(key)] = _consumer(func, args, kwargs or {}, tensors_out)
        if self.autocast_weights and self.forward:
            self._fp32_matmul(func, tensors_in, inputs)
        from_weights = bool(inputs) and all(k in self.weight_storages for k in inputs)
        allocated = self._allocated(func, inputs, tensors_out, from_weights, scope)
        if self.forward:
            for t in tensors_out:
                self._scope_of[t] = scope
            if scope < 0 and self.chain is not None and func.namespace != "prim":  # (prim: metadata, no values)
                self.chain.op(func.overloadpacket.__name__, scope == BEFORE, tensors_in, tensors_out)
        if allocated:
            self.num_ops += 1
            if func.overloadpacket in self._matmul:
                self._count_matmul(func, args, allocated, tensors_out)
            else:
                self._count_traffic(allocated, tensors_in, tensors_out, from_weights)
            self._record(func, args, kwargs or {}, out, scope, (tensors_in, inputs), tensors_out, allocated,
                         from_weights)
        else:
            self._count_unallocated(func, scope, tensors_in, tensors_out, inputs, from_weights)
        return out

    def _fp32_matmul(self, func: Any, tensors_in: list[torch.Tensor], inputs: list[Any]) -> None:
        """A forward matmul that reads a trainable weight in float32 under autocast: the weight's name noted."""
        name = func.overloadpacket.__name__
        if name in _GEMMS or name in _GROUPED:
            read = {self.autocast_weights[k] for k in inputs if k in self.autocast_weights}
            self.matmul_weights.update(read)
            if _dtype_of(tensors_in) == "float32":
                self.fp32_matmul_weights.update(read)

    def _count_unallocated(self, func: Any, scope: int, tensors_in: list[torch.Tensor],
                           tensors_out: list[torch.Tensor], inputs: list[Any], from_weights: bool) -> None:
        """An op that allocates no activation, as a record: a cast of the weights alone (autocast's bf16 copies,
        a kernel each, issued by the dispatcher: no Python) as "weight_cast" traffic (paid once per micro-batch;
        compiled, a kernel of inductor's each); an in-place op (a kernel) as its memory-bound kind, its operands
        read and written (a buffer's update, a standalone kernel compiled too); a view, reshape, transpose or
        expand as a "view" (host time only). The trace's own calls are left out: prim ops (tensor.device) and detach (its
        saved-tensor hooks)."""
        name = func.overloadpacket.__name__
        if func.namespace == "prim" or name in ("detach", "alias"):
            return
        backward = not self.forward
        dtype = _dtype_of(tensors_in)
        made = [t for t in tensors_out if storage_key(t) not in inputs]
        if from_weights and made:
            nbytes = sum(_nbytes(t) for t in tensors_in) + sum(_nbytes(t) for t in made)
            self._add(scope, ("weight_cast", backward, (), dtype, -1, ()), 0.0, nbytes)
        elif func._schema.is_mutable and tensors_out:  # a kernel: counted as the allocating ones are
            if storage_key(tensors_out[0]) in self.weight_storages:  # a buffer's update (num_batches_tracked)
                self.fusion.standalone(scope)
            nbytes = sum(_nbytes(t) for t in tensors_in)
            self.num_ops += 1
            self.traffic_bytes += nbytes
            self._add(scope, (memory_kind(name), backward, (), dtype, -1, ()), 0.0, nbytes)
        else:
            self._add(scope, ("view", backward, (), "", -1, ()), 0.0, 0)

    def _note_writes(self, func: Any, args: tuple, kwargs: dict) -> None:
        """The weights and buffers a mutating op of the forward writes (its arguments marked `(a!)`: add_'s self,
        batch_norm's running statistics), by storage."""
        names = [a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        if func.overloadpacket.__name__ in _BATCH_NORMS and not names and _argument(func, args, kwargs, "training"):
            names = ["running_mean", "running_var"]  # written in training, though their schema does not say so
        for name in names:
            for t in tensors_of(_argument(func, args, kwargs, name)):
                if t.layout == torch.strided and storage_key(t) in self.weight_storages:
                    self.written.add(storage_key(t))

    def label_loss(self, loss: torch.Tensor) -> None:
        """The loss's own autograd node, which no later forward op reads: its backward runs in the scope that
        made it (the loss's, or the model's when the model returned it)."""
        node, made = loss.grad_fn, self._scope_of.get(loss)
        if node is not None and made is not None and id(node) not in self._node_scope:
            self._node_scope[id(node)] = made
            self._nodes.append(node)

    def made_in(self, t: torch.Tensor) -> int | None:
        """The scope of the forward op that made `t` (a block's index, BEFORE, AFTER or LOSS), or None."""
        return self._scope_of.get(t)

    def _scope(self, tensors_in: list[torch.Tensor]) -> int:
        """The scope of the op now running; in forward, labels the autograd nodes of its inputs first."""
        if not self.forward:
            if not self._backward_started:
                self._backward_started = True
                self.fusion.backward = True
                self.fusion.boundary()
            node = torch._C._current_autograd_node()
            return self._node_scope.get(id(node), AFTER) if node is not None else AFTER
        for t in tensors_in:
            if t._is_view() and not t._base.requires_grad:
                # A view of what needs no gradient has no node a forward op made (at most it is a leaf itself:
                # wav2vec2's `x = values[:, None]; x.requires_grad = True`), and reading its grad_fn takes the
                # view's lock, which torch may hold while it runs this op (a deadlock): not read.
                continue
            node = t.grad_fn
            if node is not None and id(node) not in self._node_scope:
                made = self._scope_of.get(t)
                if made is not None:
                    self._node_scope[id(node)] = made
                    self._nodes.append(node)
        block = self.running_block()
        if block is not None:
            self._after_blocks = True
            return block
        if self.in_loss:
            return LOSS
        return AFTER if self._after_blocks else BEFORE

    def _allocated(self, func: Any, inputs: list[Any], tensors_out: list[torch.Tensor], from_weights: bool,
                   scope: int) -> int:
        """Bytes of the op's new outputs (views of an input allocate nothing); outputs made from weights alone
        join the weights instead. Keeps the largest output seen, and the scope and pass that made it."""
        allocated = 0
        for t in tensors_out:
            key = storage_key(t)
            if from_weights:
                if key not in self.weight_storages:  # a new cast of weights, not a view of one
                    self.live.allocated(t, self._op_label(func), counted=False)
                self.weight_storages.add(key)
            elif key not in inputs:
                self.live.allocated(t, self._op_label(func))
                nbytes = _nbytes(t)
                allocated += nbytes
                if nbytes > self.largest_bytes:
                    self.largest_bytes, self.largest_op = nbytes, str(func.overloadpacket.__name__)
                    self.largest_scope, self.largest_backward = scope, not self.forward
        return allocated

    def _op_label(self, func: Any) -> str:
        name = str(func.overloadpacket.__name__)
        return name if self.forward else name + " (backward)"

    def _count_matmul(self, func: Any, args: tuple, allocated: int, tensors_out: list[torch.Tensor]) -> None:
        """A matmul's or attention's output, in a block's forward: what selective checkpointing keeps; of the
        GEMMs, "alternate" keeps the first, third, ... (in the order the block runs them) and recomputes the
        rest, whose FLOPs (2 x output elements x depth) are its recomputation's; "gemms" recomputes them all."""
        block = self.running_block()
        if not (self.forward and block is not None):
            return
        self.selective_bytes[block] += allocated
        if func.overloadpacket not in self._gemm:
            self.alternate_bytes[block] += allocated
            return
        self._gemms_seen[block] += 1
        flops = 0.0
        if tensors_out:
            depth = args[_GEMMS[func.overloadpacket.__name__]].shape[-1]  # the first matrix's columns
            flops = 2.0 * tensors_out[0].numel() * depth
        self.gemm_bytes[block] += allocated
        self.gemm_flops[block] += flops
        if self._gemms_seen[block] % 2:
            self.alternate_bytes[block] += allocated
        else:
            self.alternate_recompute_flops[block] += flops

    def _weight_traffic(self, tensors_in: list[torch.Tensor], tensors_out: list[torch.Tensor],
                        from_weights: bool) -> bool:
        """Weight traffic: casts of the weights (autocast's copies, forward) and, in backward, ops whose inputs
        and outputs all have a parameter's shape (gradient casts and accumulation). Inputs count too, so that
        an activation whose shape happens to match a weight's (tokens = hidden in a flattened 2-D layer) is
        not taken for one unless everything it touches is."""
        return from_weights or (not self.forward and all(tuple(t.shape) in self.param_shapes for t in tensors_in)
                                and all(tuple(t.shape) in self.param_shapes for t in tensors_out))

    def _count_traffic(self, allocated: int, tensors_in: list[torch.Tensor], tensors_out: list[torch.Tensor],
                       from_weights: bool) -> None:
        """A memory-bound op's bytes read and written, and whether they are weight traffic."""
        moved = allocated + sum(_nbytes(t) for t in tensors_in)
        self.traffic_bytes += moved
        if self._weight_traffic(tensors_in, tensors_out, from_weights):
            self.weight_traffic_bytes += moved

    # ---- op records ------------------------------------------------------------------------------
    def _is_weight(self, t: torch.Tensor) -> bool:
        return storage_key(t) in self.weight_storages

    def _weight_shaped(self, t: torch.Tensor) -> bool:
        return tuple(t.shape) in self.param_shapes or tuple(t.shape[::-1]) in self.param_shapes

    def _record(self, func: Any, args: tuple, kwargs: dict, out: Any, scope: int,
                inputs: tuple[list[torch.Tensor], list[Any]], tensors_out: list[torch.Tensor], allocated: int,
                from_weights: bool) -> None:
        """The op as OpRecord fields of its scope, and its part in the FusionModel."""
        tensors_in, keys_in = inputs
        name = func.overloadpacket.__name__
        dtype = _dtype_of(tensors_in)
        moved = allocated + sum(_nbytes(t) for t in tensors_in)
        if name in _COMPUTE:
            records = _ComputeOp(self._is_weight, self._weight_shaped, not self.forward, self.compile_masks).of(
                name, func, args, kwargs, out)
            for i, (kind, shape, flops, grow, dims) in enumerate(records):
                shape = self._grouped_count(kind, shape, tensors_out)
                self._add(scope, (kind, not self.forward, shape, dtype, grow, dims), flops,
                          moved if i == 0 else 0)
            self.fusion.compute_op(tensors_in)
            return
        weight = self._weight_traffic(tensors_in, tensors_out, from_weights)
        kind = "weight" if weight else memory_kind(name)
        self._add(scope, (kind, not self.forward, (), dtype, -1, ()), 0.0, moved)
        made = [t for t in tensors_out if storage_key(t) not in keys_in]
        loops = reduction_loops(name, tensors_in, tensors_out) if kind in _REDUCING else []
        self.fusion.memory_op(scope, kind, tensors_in, made, loops)
        if "batch_norm" in name and loops and self.forward and _named(func, args, kwargs).get(
                "running_mean") is not None:  # training with running statistics: their update, apart
            self.fusion.standalone(scope)

    def _grouped_count(self, kind: str, shape: tuple, tensors_out: list[torch.Tensor]) -> tuple:
        """A grouped weight gradient's number of groups, from its (groups, M, N) output."""
        if kind == "grouped_gemm" and shape[0] == 1 and tensors_out and tensors_out[0].dim() == 3:
            e = int(tensors_out[0].shape[0])
            return (e, shape[1], shape[2], max(1, shape[3] // e))
        return shape

    def _add(self, scope: int, key: tuple, flops: float, nbytes: int) -> None:
        entry = self._records[scope].setdefault(key, [0, 0.0, 0])
        entry[0] += 1
        entry[1] += flops
        entry[2] += nbytes

    def op_groups(self) -> tuple[OpGroup, ...]:
        """The records of the step: one group for the blocks with equal records, one before and one after."""
        by_content: dict[tuple[OpRecord, ...], list[int]] = {}
        for i in range(self.num_blocks):
            by_content.setdefault(self._scope_records(i), []).append(i)
        groups = [OpGroup(where="blocks", blocks=tuple(ids), ops=ops) for ops, ids in by_content.items()]
        for scope, where in ((BEFORE, "before"), (AFTER, "after"), (LOSS, "loss")):
            if self._records.get(scope):
                groups.append(OpGroup(where=where, blocks=(), ops=self._scope_records(scope)))
        return tuple(groups)

    def _scope_records(self, scope: int) -> tuple[OpRecord, ...]:
        """A scope's records, in a fixed order, and the FusionModel's "fused" and "fused_weight" ones."""
        ops = [OpRecord(kind=k, backward=bw, shape=shape, dtype=dt, count=c, flops=f, bytes=b, batch_dim=grow,
                        weight_dims=dims)
               for (k, bw, shape, dt, grow, dims), (c, f, b) in self._records[scope].items()]
        for backward in (False, True):
            for weight in (False, True):
                where = (scope, backward, weight)
                if self.fusion.kernels.get(where) or self.fusion.bytes.get(where):
                    ops.append(OpRecord(kind="fused_weight" if weight else "fused", backward=backward, shape=(),
                                        dtype="", count=self.fusion.kernels.get(where, 0), flops=0.0,
                                        bytes=self.fusion.bytes.get(where, 0)))
        return tuple(sorted(ops, key=lambda r: (r.kind, r.backward, r.shape, r.dtype, r.batch_dim, r.weight_dims)))
