"""The profile's records: ModelProfile (what the planner knows about a model for one sample), BlockProfile,
MatmulCall, OpRecord and OpGroup (every op of the step by kind and shape), their dict/JSON round trip, and
model_fingerprint. No measuring here (build.py and trace.py measure)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Any, Mapping

import torch.nn as nn

from ..errors import ProfileError
from .live import Frontier

#: `ModelProfile.model_flops` takes the PaLM formula where the traced step's FLOPs are within this fraction of it
#: (the zoo's dense decoder LMs: 1-3%; the formula counts attention over all positions, as torch's SDPA count does).
FORMULA_AGREES_WITHIN = 0.15


@dataclass(frozen=True)
class BlockProfile:
    """One unit of the model (a transformer layer, or a top-level child where nothing repeats)."""

    name: str  # fully qualified module name, e.g. "transformer.h.3"
    num_params: int  # parameters in the block (tied ones counted where first seen)
    param_bytes: int  # bytes of those parameters in the model's dtype
    forward_flops: float  # FLOPs of the block's forward on the sample
    flops: float  # forward + backward FLOPs of the block on the sample
    saved_bytes: int  # activation bytes the block saves for backward on the sample (no checkpointing)
    matmul_params: int = 0  # parameters of the block's Linear-like layers (what tensor parallelism splits)
    saved_hidden_bytes: int = 0  # of saved_bytes, tensors shaped like the hidden states (batch, seq, hidden)
    selective_saved_bytes: int = 0  # outputs of matmuls and attention in the forward (what selective AC keeps)
    alternate_saved_bytes: int = 0  # of those, what "alternate" AC keeps: the first, third, ... GEMM's outputs and
    # the rest of the matmul and attention outputs
    alternate_recompute_flops: float = 0.0  # forward FLOPs of the GEMMs "alternate" AC recomputes (the second,
    # fourth, ...)
    gemm_saved_bytes: int | None = None  # of selective_saved_bytes, the dense GEMMs' outputs, which "gemms" AC
    # recomputes (None: a profile written before the tally)
    gemm_forward_flops: float | None = None  # the forward FLOPs of those GEMMs (None: the same)
    num_trainable_params: int | None = None  # of num_params, those that require grad (None: all of them)
    compiled_saved_bytes: int | None = None  # what a torch.compile'd step saves for backward instead of saved_bytes
    #                                          (autopar.profile.remat; None: not partitioned)
    compiled_unfused_bytes: int = 0  # of compiled_saved_bytes, the score matrices of attention calls whose mask
    # only a whole-graph compile builds (autopar.profile.hf_masks): none under per-block compile (FSDP, pipelines)

    @property
    def alternate_tallied(self) -> bool:
        """Whether the trace tallied "alternate" checkpointing for this block: a block that keeps any matmul or
        attention output keeps its first under "alternate" too; a profile written before the tally has 0 there."""
        return self.alternate_saved_bytes > 0 or self.selective_saved_bytes == 0


@dataclass(frozen=True)
class MatmulCall:
    """One call of a Linear-like layer during the traced step: what tensor parallelism splits."""

    name: str  # fully qualified module name
    kind: str  # "linear" (nn.Linear, weight out x in) or "conv1d" (Hugging Face Conv1D, weight in x out)
    input_id: int  # calls with one input_id read the same tensor (e.g. q, k and v projections)
    in_features: int
    out_features: int
    output_id: int = -1  # the input_id a later call reading this call's output (or a view of it) has; -1: unknown
    consumer: str = ""  # the first op on its output ("view 2,16,4,3,8", "split -1", ...): how a fused one is cut


@dataclass(frozen=True)
class NormCall:
    """One call of a norm layer (a module whose class name ends in "Norm", nn.LayerNorm) in the traced step: which
    tensor it normalized (a MatmulCall's output_id where it read a projection's output) and its weight's width."""

    name: str  # fully qualified module name
    input_id: int
    width: int  # its weight's last dim (0: no weight)


@dataclass(frozen=True)
class OpRecord:
    """Ops of one kind, shape and dtype in the traced step, `count` of them (in one block, or before or after the
    blocks): what the per-op time model reads (autopar.cost.ops). `shape` by kind:

    - "gemm": (batch, M, N, K) of mm, addmm, bmm, baddbmm, _scaled_mm (batch 1 for the 2-d ones)
    - "conv": (M, N, K, groups, channels_last) of a convolution as its implicit GEMM per group: forward
      M = N H_out W_out, N = C_out / groups, K = C_in / groups kh kw; of its backward's input gradient
      M = N H_in W_in, N = C_in / groups, K = C_out / groups kh kw; of its weight gradient M = C_out / groups,
      N = C_in / groups kh kw, K = N H_out W_out
    - "attention": (batch, heads, kv_heads, q_len, k_len, qk_head_dim, v_head_dim, causal, window, masked,
      dropout) of a fused attention kernel (SDPA's flash, memory-efficient, cuDNN or CPU flash kernels); window 0:
      none; masked 1: an explicit mask or bias; causal 2: causal with a mask only torch.compile would build, masked
      2: not causal with such a mask (a Hugging Face model's mask that it skips eagerly: autopar.profile.hf_masks);
      dropout 1: the call's dropout_p is over 0 (records written before it have 10 fields: no dropout)
    - "grouped_gemm": (groups, M, N, K) of torch._grouped_mm, M N K the mean GEMM of a group
    - memory-bound kinds, shape (): "elementwise", "reduction", "norm", "softmax", "copy" (casts, cat, gather,
      indexing, padding), "weight" (casts of the weights, and gradient casts and sums on weight-shaped tensors:
      paid once per micro-batch, not per sample)
    - what torch.compile would leave of the memory-bound ops, shape (): "fused" (count: kernels, bytes: what
      they read and write once each chain of memory-bound ops between compute ops is one loop) and
      "fused_weight" (the weight-shaped part; autopar.profile.fusion.FusionModel)
    """

    kind: str
    backward: bool
    shape: tuple[int, ...]
    dtype: str  # of the first floating input ("bfloat16", "float32"; "" where none)
    count: int
    flops: float  # FLOPs of all `count` ops (attention: of its full score matrix, causal or not, as traced)
    bytes: int  # bytes all `count` ops read and write
    batch_dim: int = -1  # the index in `shape` that grows with the batch (-1: none)
    weight_dims: tuple[int, ...] = ()  # indices in `shape` of a weight's two dimensions (what TP splits)


@dataclass(frozen=True)
class OpGroup:
    """The op records of identical blocks (one group for all of them), or of the ops outside the blocks."""

    where: str  # "blocks"; "before": ops before the first block (embeddings); "after": the rest of the model's
    # forward (head); "loss": what runs after the model's forward returns (the loss, and their backward)
    blocks: tuple[int, ...]  # indices of the blocks with exactly these records (where == "blocks")
    ops: tuple[OpRecord, ...]

    def __hash__(self) -> int:
        """Computed once per object: the cost model caches its timings by group."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.where, self.blocks, self.ops))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_hash", None)  # string hashes differ between processes
        return state


@dataclass(frozen=True)
class ModelProfile:
    """What the planner knows about a model, for the sample it was profiled with.

    FLOPs and saved bytes are for one forward and backward of the sample (`sample_batch_size` samples);
    `*_per_sample` helpers scale them, since both are linear in the batch.
    """

    model_class: str
    fingerprint: str  # hash of parameter names and shapes: identifies the architecture, not the weights
    blocks_path: str | None  # container of the blocks ("transformer.h"), None if given as paths/classes
    block_class: str | None
    repeated: bool  # False: no repeated blocks, top-level children are the units
    blocks: tuple[BlockProfile, ...]
    num_params: int  # unique parameters
    num_trainable_params: int
    num_params_outside_blocks: int
    num_lookup_params: int  # parameters of embeddings not tied to a matmul: looked up, no FLOPs
    param_bytes: int  # unique parameter bytes in the model's dtype
    param_dtype: str
    tied_params: tuple[tuple[str, ...], ...]  # groups of names that share one Parameter
    forward_flops: float
    flops: float  # forward + backward FLOPs of one step on the sample
    saved_bytes_outside_blocks: int  # activations saved for backward outside the blocks (embeddings, head, loss)
    largest_transient_bytes: int  # the largest single tensor created by the step
    largest_transient_op: str
    sample_batch_size: int
    tokens_per_sample: int | None  # sequence length for token inputs, else None
    profile_precision: str  # "fp32", "bf16" (autocast) or "bf16-pure" (bf16 weights, as FSDP's mixed precision)
    traced: bool = True  # False: structure only (trace=False), FLOPs and bytes unknown (zero)
    matmul_calls: tuple[MatmulCall, ...] = ()  # Linear-like calls in order (empty when not traced)
    norm_calls: tuple[NormCall, ...] = ()  # norm calls in the blocks, in order (empty when not traced)
    op_groups: tuple[OpGroup, ...] = ()  # every op of the step by kind, shape and dtype (empty when not traced)
    value_reads: int = 0  # reads of tensor values in the model's forward (`.item()`, `bool()`, ops shaped by
    # values: autopar.profile.shadow): where torch.compile's graph breaks (dynamo cannot trace past them)
    graph_breaks: int | None = None  # breaks dynamo makes in the forward (autopar.profile.graphs; None: not known)
    graph_breaks_in_blocks: bool | None = None  # whether one lies in a block's forward, where it recurs in every
    # block and cuts its fusion (GraphCount.in_forward_of; None: not known)
    block_input: str | None = None  # how a block receives the hidden states: "arg0" or "kwarg:NAME"
    block_input_shape: tuple[int, ...] | None = None  # shape of those hidden states for the sample (batch first)
    block_num_args: int = 1  # positional arguments a block is called with
    block_input_bytes: int = 0  # bytes of those hidden states (what full checkpointing keeps per block)
    block_output_arity: int = 0  # 0: a block returns a tensor; n: a tuple of n items, hidden states first
    pipeline_chain: str = ""  # where the forward's blocks are not one chain a pipeline can split, or ""
    # (autopar.profile.chain: a value between blocks, one block's value read by another, ...)
    modules_before_blocks: tuple[str, ...] = ()  # modules with parameters called before the first block
    modules_after_blocks: tuple[str, ...] = ()  # ... after the last block (final norm, head)
    root_param_names: tuple[str, ...] = ()  # parameters held by the model itself, not by a submodule
    num_ops: int = 0  # ops that allocate an output in one step (eager kernel launches)
    traffic_bytes: int = 0  # bytes read and written by the non-matmul ops of one step (memory-bound work)
    weight_traffic_bytes: int = 0  # the part of traffic_bytes on weight-shaped tensors (gradient casts and
    #                                accumulation): paid once per micro-batch, not per sample
    hidden_dim: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    num_layers: int | None = None
    vocab_size: int | None = None
    ffn_dim: int | None = None
    notes: tuple[str, ...] = field(default=())
    buffer_bytes: int = 0  # unique buffers (BatchNorm running statistics, position ids): on every GPU, not sharded
    compiled_saved_bytes_outside_blocks: int | None = None  # saved_bytes_outside_blocks of a torch.compile'd step
    live_frontier: Frontier = ()  # the eager step's live bytes on the sample at the
    # moments that can peak, as (other, gradient, weight-cast) bytes (autopar.profile.live); empty: not known; a
    # cast figure of None (a profile written before casts were summed apart): every cast alive at every point
    allocator_reserve_bytes: int | None = None  # the CUDA caching allocator's reserve over the allocated peak in a
    # loop of the traced step (autopar.profile.allocator); bytes; None: not known
    allocator_replay_on_cuda: bool = False  # whether that step was traced on a fake CUDA device (CUDA's dispatch and
    # so its allocations); a CPU trace's replay can miss CUDA's (bench/results/allocator_reserve_2026-12-02.md)
    traced_with_weight_values: bool = False  # whether the step was traced with the weights' values beside the fake
    # tensors (it reads values they compute): a trace of it in another precision goes there at once
    largest_transient_where: str = ""  # where the step made its largest tensor ("the forward of block model.layers.0")
    sparse_grad_modules: tuple[str, ...] = ()  # embeddings built with sparse=True (a sparse gradient, which FSDP2
    # cannot shard or reduce: plans that manage parameters with FSDP are refused for them)
    hooked_params: tuple[str, ...] = ()  # parameters with a gradient hook of the user's (Tensor.register_hook,
    # register_post_accumulate_grad_hook), which FSDP2 drops with the parameter: plans that use FSDP are refused
    differentiating_forward: str = ""  # where the forward takes a gradient (torch.autograd.grad with create_graph, as
    # a gradient penalty does: "the forward of block NAME"), found by the trace; FSDP2 frees a unit's gathered weights
    # at that inner backward, which the outer one then reads: plans that manage parameters with FSDP are refused
    params_written: tuple[str, ...] = ()  # parameters the forward writes in place (nn.Embedding(max_norm=) renorms
    # the rows it reads), found by the trace: each rank would write its own copy or FSDP's gathered one, lost at once
    params_unused: tuple[str, ...] = ()  # trainable parameters the traced step gave no gradient: unused by the sample
    # (a pooler an LM never reads, a task head the sample's task skips); found by the trace
    buffers_written: tuple[str, ...] = ()  # buffers the forward writes (BatchNorm's running statistics, an EMA
    # codebook), found by the trace: under data parallelism each rank updates its own copy from its own samples
    sequence_first: str = ""  # a batch_first=False module (an nn.LSTM, nn.TransformerEncoderLayer) called with the
    # sample's dim 0 as its sequence, found by the trace: "NAME (CLASS, batch_first=False, called with SHAPE)";
    # autopar cuts batches along dim 0, so plans that split the batch are refused for it
    bf16_refusal: str | None = None  # why the step cannot run in bf16 on a GPU (an op a bf16 input reaches has no CUDA
    # bf16 kernel: autopar.profile.cuda_autocast.NoCudaBf16KernelError), found by its bf16 trace: plans are fp32 then
    bf16_weights: tuple[str, ...] = ()  # trainable weights a matmul read in fp32 under bf16 autocast (autocast did not
    # reach it: a custom op's, an MoE's grouped GEMM), which autopar's autocast gives the forward in bf16 and this
    # bf16 trace did (autopar.strategies.precision); empty for other precisions

    def __post_init__(self) -> None:
        assert self.num_params > 0 and self.sample_batch_size > 0, "profile of an empty model or batch"

    def __hash__(self) -> int:
        """Computed once per object: the cost model caches by profile (pipeline stage splits, TP pairs), and
        hashing every block each time was half of an 80-block model's search."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in dataclass_fields(self)))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_hash", None)  # string hashes differ between processes
        state.pop("_op_index", None)
        return state

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def block_containers(self) -> tuple[str, ...]:
        """The modules holding the blocks, in the blocks' order: one for a single stack ("model.layers"), several
        for an encoder-decoder's two stacks, a two-tower model's towers or a vision model's stages ("" where the
        model itself holds them). Pipeline parallelism needs one; FSDP and checkpointing take any number."""
        out: list[str] = []
        for block in self.blocks:
            parent = block.name.rpartition(".")[0]
            if parent not in out:
                out.append(parent)
        return tuple(out)

    def ops_of(self, where: str, block: int | None = None) -> OpGroup | None:
        """The op records of block `block` (where="blocks"), of the ops "before" or "after" the blocks, or of the
        "loss"; None where the trace recorded none. A block past the recorded ones (extrapolate_profile's copies
        of the last block) has the last recorded block's records."""
        index = self.__dict__.get("_op_index")
        if index is None:  # where -> group, block -> group, the last recorded block (computed once per profile)
            by_block = {i: g for g in self.op_groups for i in g.blocks}
            index = ({g.where: g for g in reversed(self.op_groups)}, by_block, max(by_block, default=-1))
            object.__setattr__(self, "_op_index", index)
        outside, by_block, last = index
        if where != "blocks":
            return outside.get(where)
        return by_block.get(last if block is None or block > last else block)

    @property
    def num_params_in_blocks(self) -> int:
        return sum(b.num_params for b in self.blocks)

    @property
    def saved_bytes(self) -> int:
        """All activation bytes saved for backward by one step on the sample."""
        return sum(b.saved_bytes for b in self.blocks) + self.saved_bytes_outside_blocks

    @property
    def flops_per_sample(self) -> float:
        return self.flops / self.sample_batch_size

    @property
    def saved_bytes_per_sample(self) -> float:
        return self.saved_bytes / self.sample_batch_size

    @property
    def tokens_per_step(self) -> int | None:
        return None if self.tokens_per_sample is None else self.tokens_per_sample * self.sample_batch_size

    def formula_flops(self) -> float | None:
        """6 N + 12 L h s FLOPs per token times the sample's tokens (Kaplan 2020 / PaLM appendix B), or None.

        N counts the parameters that take part in matmuls: lookup-only embeddings are left out (Kaplan's
        non-embedding count, with a tied output head kept since it is a matmul).
        """
        if None in (self.tokens_per_sample, self.hidden_dim, self.num_layers):
            return None
        s = self.tokens_per_sample
        per_token = 6 * (self.num_params - self.num_lookup_params) + 12 * self.num_layers * self.hidden_dim * s
        return per_token * s * self.sample_batch_size

    def model_flops(self) -> float:
        """The sample's model FLOPs for MFU: `formula_flops` (the PaLM count users compare with) where the traced
        step agrees with it within FORMULA_AGREES_WITHIN, else the traced FLOPs (`flops`, no recomputation). The
        formula puts every parameter in every token's matmuls; a mixture of experts routes each token to a few of
        its experts (3-5x over its trace in the zoo, an MFU of 158% for OLMoE on an H200), an encoder-decoder's
        halves and a two-tower model's towers read different tokens (T5 1.6x, CLIP 1.3x), frozen weights get no
        weight gradient (LoRA 1.4x), and a state-space scan's FLOPs are not in 6 N (Mamba-2 0.76x)."""
        formula = self.formula_flops()
        if formula is not None and self.flops > 0 and abs(formula / self.flops - 1) <= FORMULA_AGREES_WITHIN:
            return formula
        return self.flops

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["blocks"] = [asdict(b) for b in self.blocks]
        d["tied_params"] = [list(g) for g in self.tied_params]
        d["notes"] = list(self.notes)
        d["matmul_calls"] = [asdict(c) for c in self.matmul_calls]
        d["norm_calls"] = [asdict(c) for c in self.norm_calls]
        d["op_groups"] = [asdict(g) for g in self.op_groups]
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelProfile":
        """The profile `to_dict` wrote, also after a JSON round trip (lists become the tuples they were):
        `ModelProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p`."""
        if not isinstance(data, Mapping):
            raise ProfileError(f"a profile must be a mapping of field names to values, got {type(data).__name__}.")
        names = {f.name for f in dataclass_fields(cls)}
        unknown = sorted(set(map(str, data)) - names)
        if unknown:
            raise ProfileError(f"unknown profile field(s) {', '.join(unknown)}; ModelProfile.to_dict writes: "
                               f"{', '.join(sorted(names))}.")
        values = dict(data)
        values["blocks"] = tuple(b if isinstance(b, BlockProfile) else BlockProfile(**b)
                                 for b in values.get("blocks", ()))
        values["matmul_calls"] = tuple(c if isinstance(c, MatmulCall) else MatmulCall(**c)
                                       for c in values.get("matmul_calls", ()))
        values["norm_calls"] = tuple(c if isinstance(c, NormCall) else NormCall(**c)
                                     for c in values.get("norm_calls", ()))
        values["op_groups"] = tuple(_op_group(g) for g in values.get("op_groups", ()))
        values["tied_params"] = tuple(tuple(g) for g in values.get("tied_params", ()))
        values["live_frontier"] = tuple(_live_point(p) for p in values.get("live_frontier", ()))
        for name in ("notes", "modules_before_blocks", "modules_after_blocks", "root_param_names", "bf16_weights",
                     "sparse_grad_modules", "buffers_written", "hooked_params",
                     "params_written", "params_unused"):
            if name in values:
                values[name] = tuple(values[name])
        if values.get("block_input_shape") is not None:
            values["block_input_shape"] = tuple(values["block_input_shape"])
        try:
            return cls(**values)
        except TypeError as exc:
            raise ProfileError(f"not a profile written by ModelProfile.to_dict: {exc}") from None

    def describe(self) -> str:
        """A few lines for people: the blocks, parameters, shape facts, sample and per-step costs."""
        n = _si
        blocks = (_describe_blocks(self) if self.repeated
                  else f"{self.num_blocks} top-level units (no repeated blocks found)")
        lines = [
            f"model {self.model_class} ({self.fingerprint})",
            f"  parameters    {n(self.num_params)} ({n(self.num_params_in_blocks)} in blocks, "
            f"{n(self.num_params_outside_blocks)} outside), {self.param_dtype}, {self.param_bytes / 2**20:.1f} MiB",
            f"  blocks        {blocks}",
        ]
        if self.tied_params:
            lines.append("  tied          " + "; ".join(" = ".join(g) for g in self.tied_params))
        shape = [f"{k}={v}" for k, v in (("hidden", self.hidden_dim), ("heads", self.num_heads),
                                          ("kv_heads", self.num_kv_heads), ("layers", self.num_layers),
                                          ("ffn", self.ffn_dim), ("vocab", self.vocab_size)) if v is not None]
        if shape:
            lines.append("  shape         " + ", ".join(shape))
        tokens = f", {self.tokens_per_sample} tokens each" if self.tokens_per_sample else ""
        memory = (f"{self.saved_bytes / 2**20:.1f} MiB saved for backward ({self.profile_precision}), "
                  f"largest tensor {self.largest_transient_bytes / 2**20:.1f} MiB ({self.largest_transient_op}"
                  f"{', in ' + self.largest_transient_where if self.largest_transient_where else ''})") \
            if self.traced else "activation bytes not traced"
        lines += [
            f"  sample        {self.sample_batch_size} samples{tokens}",
            f"  per step      {n(self.flops)}FLOP (forward {n(self.forward_flops)}FLOP), {memory}",
        ]
        for note in self.notes:
            lines.append(f"  note          {note}")
        return "\n".join(lines)


def _op_group(g: OpGroup | Mapping[str, Any]) -> OpGroup:
    """An OpGroup from its dict (lists where it had tuples, after JSON)."""
    if isinstance(g, OpGroup):
        return g
    ops = tuple(r if isinstance(r, OpRecord) else OpRecord(**{**r, "shape": tuple(r["shape"]),
                                                              "weight_dims": tuple(r.get("weight_dims", ()))})
                for r in g["ops"])
    return OpGroup(**{**g, "blocks": tuple(g["blocks"]), "ops": ops})


def _live_point(point: Any) -> tuple[int, int, int | None]:
    """A live-frontier point from its list (after JSON); a pair, written before the weights' casts were summed
    apart, has no cast figure (None: the cost model counts every cast alive)."""
    other, grads, *casts = point
    return int(other), int(grads), (int(casts[0]) if casts and casts[0] is not None else None)


def _describe_blocks(profile: ModelProfile) -> str:
    """"4 x Block at blocks", or for blocks in several containers "24 x T5Block in 2 containers: encoder.block
    (12), decoder.block (12)"."""
    what = f"{profile.num_blocks} x {profile.block_class}" if profile.block_class else f"{profile.num_blocks} blocks"
    containers = profile.block_containers
    if len(containers) <= 1:
        return f"{what} at {profile.blocks_path or '(listed paths)'}"
    counts = [sum(b.name.rpartition(".")[0] == c for b in profile.blocks) for c in containers]
    listed = ", ".join(f"{c or '<root>'} ({n})" for c, n in zip(containers[:6], counts))
    return f"{what} in {len(containers)} containers: {listed}{', ...' if len(containers) > 6 else ''}"


def _si(x: float) -> str:
    """`x` with a T/G/M/k suffix and two decimals (plain integer below a thousand)."""
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.2f}{unit}"
    return f"{x:.0f}"


def model_fingerprint(model: nn.Module) -> str:
    """A short hash of the model class and its parameter names and shapes (not values, not dtype)."""
    items = [type(model).__qualname__] + [
        f"{name}:{tuple(p.shape)}" for name, p in model.named_parameters(remove_duplicate=False)
    ]
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]
