"""Per-rank peak memory of a plan, in parts, from the model's profile, the hardware and the plan.

Every term is bytes on one GPU (the most loaded rank: the first pipeline stage, which holds the most
micro-batches in flight). Sources: the ZeRO paper (Rajbhandari et al. 2020) for model states (of the
parameters that require grad: frozen ones have neither gradients nor optimizer state), Korthikanti et al.
2022 for how tensor/sequence parallelism and recomputation divide activations, the profile's own trace of
the model for the activation bytes themselves (eager, and what inductor's partitioner would save compiled:
autopar.profile.remat), and measurements on an H200 for the CUDA context and what the caching allocator
reserves (bench/results/zoo_h200_2026-12-01.jsonl; bench/memory_check.py re-predicts them). `Calibration`
holds the measured factors.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Mapping

from ..layout import float8_weight_params, pairs_from_calls, split_stages, stage_ids
from ..plans import Plan
from ..profile import BlockProfile, ModelProfile
from .calibration import Calibration

GiB = 2**30


@dataclass(frozen=True)
class MemoryPrediction:
    """Peak bytes on the most loaded GPU, by what holds them."""

    parameters_bytes: float  # master weights kept between steps (sharded by FSDP, split by TP/PP)
    gradients_bytes: float  # gradients kept until the optimizer step (sharded like the weights)
    optimizer_bytes: float  # optimizer state (Adam: two fp32 moments per weight)
    gathered_bytes: float  # weights gathered (or cast to bf16) for compute, and unsharded gradients in flight
    activations_bytes: float  # activations saved for backward at the peak, every micro-batch in flight
    transient_bytes: float  # short-lived buffers at the peak: logits, loss and their gradients
    overhead_bytes: float  # what the caching allocator reserves beyond the allocated peak, and the CUDA context
    buffers_bytes: float = 0.0  # the model's buffers (BatchNorm running statistics, position ids): on every GPU
    context_bytes: float = 0.0  # the CUDA context: the part of overhead_bytes outside the caching allocator

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            assert value >= 0, f"negative memory term {f.name}={value}"

    @property
    def allocated_bytes(self) -> float:
        """The peak of allocated memory (torch.cuda.max_memory_allocated)."""
        return (self.parameters_bytes + self.buffers_bytes + self.gradients_bytes + self.optimizer_bytes
                + self.gathered_bytes + self.activations_bytes + self.transient_bytes)

    @property
    def peak_bytes(self) -> float:
        """What must fit on the GPU: the reserved peak plus the CUDA context."""
        return self.allocated_bytes + self.overhead_bytes

    def parts(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _bytes(precision: str) -> int:
    return 2 if precision == "bf16" else 4


def weight_element_bytes(profile: ModelProfile) -> float:
    """The model's weights' bytes an element in the dtype they were built in (4: float32; 8: float64, as scientific
    models train; 2: weights the user cast to bf16; a mix: their mean): the weights, their gradients and Adam's
    moments (torch keeps them in the weight's dtype) are held so."""
    return profile.param_bytes / profile.num_params if profile.num_params else 4.0


def compute_bytes(profile: ModelProfile, plan: Plan) -> float:
    """Bytes an element of the weights as the step computes with them: a bf16 plan casts float32 weights to bf16
    (autocast, FSDP's mixed precision); autocast leaves float64 alone, and bf16 weights are bf16 already."""
    elem = weight_element_bytes(profile)
    return 2.0 if plan.precision == "bf16" and elem <= 4 else elem


def stage_blocks(profile: ModelProfile, plan: Plan, pp_rank: int = 0) -> tuple[list[int], bool, bool]:
    """The block indices a pipeline rank holds (rank 0: the first stage, which holds the most micro-batches
    in flight), and whether it holds the embeddings / the head."""
    if plan.pp == 1:
        return list(range(len(profile.blocks))), True, True
    split = split_stages(profile, plan.pp * plan.pp_stages_per_rank)
    stages = stage_ids(plan, pp_rank)
    blocks = [i for s in stages for i in split[s]]
    return blocks, True, (plan.pp * plan.pp_stages_per_rank - 1) in stages


def in_flight_microbatches(plan: Plan, pp_rank: int = 0) -> float:
    """Micro-batches whose activations the first stage holds at once (Narayanan et al. 2021, Korthikanti
    et al. 2022): all of them under GPipe; pp under 1F1B (fewer if there are fewer); interleaved 1F1B
    adds (pp - 1) / v more chunks' worth; zero-bubble schedules defer weight gradients and hold about one
    more."""
    n, p, v = plan.grad_accum, plan.pp, plan.pp_stages_per_rank
    if p == 1:
        return 1.0  # micro-batches run one after another; each frees its activations in its backward
    if plan.pp_schedule == "gpipe":
        return float(n)
    base = float(min(n, p - pp_rank))  # 1F1B: stage s holds p - s micro-batches
    if plan.pp_schedule == "interleaved_1f1b":
        return base * (1 + (p - 1) / (p * v))
    if plan.pp_schedule == "zero_bubble":
        return min(float(n), base + 1)
    return base


def predict_memory(profile: ModelProfile, plan: Plan, cal: "Calibration", *,
                   variants: Mapping[str, ModelProfile] | None = None,
                   optimizer_state_bytes_per_param: int = 8) -> MemoryPrediction:
    """Peak memory of `plan` on its most loaded GPU (of a pipeline: the first stage's rank, with the most
    micro-batches in flight, or the last's, with the head and the loss). `variants`: the model traced in
    other precisions, for the activation bytes of bf16 plans."""
    ranks = (0,) if plan.pp == 1 else (0, plan.pp - 1)
    profile = plan_profile(profile, plan, variants)
    return max((_rank_memory(profile, plan, cal, variants, optimizer_state_bytes_per_param, r) for r in ranks),
               key=lambda m: m.peak_bytes)


@dataclass(frozen=True)
class _RankParams:
    """Parameters on one rank (counts, before FSDP's sharding)."""

    params: float  # every parameter the rank holds (weights are kept for frozen ones too)
    trainable: float  # of those, the ones that require grad: only they have gradients and optimizer state
    outside: float  # of `params`, those outside the blocks (embeddings, head) on this stage
    largest_unit: float  # the largest block's parameters on this rank (what FSDP gathers at once)
    grouped: float = 0.0  # of `params`, the weights of grouped GEMMs (MoE experts): bf16 autocast leaves them
    # in fp32 (torch._grouped_mm and transformers' fallback are on none of autocast's lists), so no copy is cast
    float8_share: float = 0.0  # of the largest unit's parameters, the float8 layers' weights (layout.float8_layers)

    @classmethod
    def of(cls, profile: ModelProfile, plan: Plan, blocks: list[int], first: bool, last: bool) -> "_RankParams":
        """The stage's blocks, their matmul weights split by TP; the modules around the blocks on the first/last
        stage (the vocabulary split by TP where it divides). Tied weights count once (the profile counts a
        shared Parameter where it is first seen)."""
        tp = plan.tp
        on_rank = {i: profile.blocks[i].num_params - profile.blocks[i].matmul_params * (1 - 1 / tp) for i in blocks}
        trainable = sum(on_rank[i] * trainable_share(profile.blocks[i]) for i in blocks)
        outside = float(profile.num_params - sum(b.num_params for b in profile.blocks))
        outside_trainable = outside_trainable_params(profile)
        share = 1.0
        if plan.pp > 1:
            # Embeddings on the first stage, head on the last; a head tied to the embedding is a full copy on
            # both (autopar keeps tied copies in step across stages).
            share = float(first or last) if profile.tied_params else 0.5 * first + 0.5 * last
        if profile.vocab_size is not None and tp > 1 and profile.vocab_size % tp == 0:
            share /= tp
        largest = max(blocks, key=lambda i: on_rank[i], default=None)
        largest_unit = on_rank[largest] if largest is not None else 0.0
        float8 = 0.0
        if plan.float8 and largest_unit > 0:
            float8 = min(1.0, float8_weight_params(profile, [largest]) / tp / largest_unit)
        return cls(params=sum(on_rank.values()) + outside * share,
                   trainable=trainable + max(outside_trainable, 0.0) * share,
                   outside=outside * share, largest_unit=largest_unit,
                   grouped=sum(_grouped_weights(profile, i) for i in blocks), float8_share=float8)


def _grouped_weights(profile: ModelProfile, block: int) -> float:
    """Elements of the weights block `block`'s grouped GEMMs read in forward: a record (groups, M, N, K) of
    tokens times the experts' weights (its batch dim M) reads groups x K x N weights per call
    (autopar.profile.watch); 0 without op records."""
    group = profile.ops_of("blocks", block)
    if group is None:
        return 0.0
    return float(sum(r.count * r.shape[0] * r.shape[2] * r.shape[3] for r in group.ops
                     if r.kind == "grouped_gemm" and not r.backward and r.batch_dim == 1))


def outside_trainable_params(profile: ModelProfile) -> float:
    """Trainable parameters outside the blocks (embeddings, head), as the profile counts them."""
    return float(profile.num_trainable_params - sum(
        b.num_params if b.num_trainable_params is None else b.num_trainable_params for b in profile.blocks))


def trainable_share(b: BlockProfile) -> float:
    if b.num_trainable_params is None or b.num_params == 0:
        return 1.0
    return b.num_trainable_params / b.num_params


def _rank_memory(profile: ModelProfile, plan: Plan, cal: "Calibration", variants: Mapping[str, ModelProfile] | None,
                 optimizer_state_bytes_per_param: int, pp_rank: int) -> MemoryPrediction:
    # Issue 10's terms, where each is counted (bytes on this rank unless said):
    # - convolution activations: the trace's saved tensors of each conv (its input, for the weight gradient), in
    #   `activations`; bytes; the fake trace (autopar.profile.trace), no per-layer-type rule;
    # - BatchNorm buffers: running statistics, `buffers`, replicated; bytes; the profile's buffer_bytes (the
    #   batch statistics BatchNorm saves are activations, from the trace);
    # - cuDNN/cuBLAS workspaces: inside the caching allocator's reserve, in `overhead`; bytes; H200 measured
    #   (calibration.context_bytes, reserve_bytes: bench/results/zoo_h200_2026-12-01.jsonl);
    # - MoE experts and routing buffers: experts are parameters (every expert on the rank, split by TP as matmul
    #   weights; autopar has no expert parallelism), router logits, top-k indices and the permuted tokens are saved
    #   activations; bytes; the trace;
    # - frozen parameters (LoRA's base weights): weights kept, no gradient, no optimizer state; bytes; ZeRO's
    #   accounting over `_RankParams.trainable` (the profile's per-block num_trainable_params);
    # - tied weights: one Parameter counted once (where first seen); bytes; the profile's per-block counts;
    # - compiled graphs' own buffers: what inductor's partitioner saves (`_compiled_ratio`, autopar.profile.remat),
    #   the zero gradient AOTAutograd makes for an unused output (`_transient_bytes`); bytes; torch's partitioner
    #   replayed, H200 zoo runs.
    blocks, first, last = stage_blocks(profile, plan, pp_rank)
    rp = _RankParams.of(profile, plan, blocks, first, last)
    shard, compute, elem = plan.dp_shard, compute_bytes(profile, plan), weight_element_bytes(profile)

    # Model states (ZeRO: 4 bytes weight + 4 gradient + K optimizer per parameter), sharded over dp_shard;
    # parameters that do not require grad (LoRA's base weights, a frozen backbone) have no gradient and no
    # optimizer state. The peak comes as backward starts (every activation saved, the loss's buffers
    # alive): gradients exist then only if earlier micro-batches left them (accumulation, pipelines);
    # otherwise a share of them (the head's, the first blocks') is counted (calibration.gradient_peak_fraction).
    on_gpu = 0.0 if plan.cpu_offload else 1.0
    parameters = elem * rp.params / shard * on_gpu  # fp32 master weights (the model's dtype); bytes; ZeRO-3
    buffers = float(profile.buffer_bytes)  # BatchNorm running statistics and the like: replicated, not sharded
    # Under GPipe every forward runs before the first backward: no gradient exists at its peak.
    grads_live = 1.0 if plan.grad_accum > 1 and plan.pp_schedule != "gpipe" else cal.gradient_peak_fraction
    # fp32 gradients; bytes; ZeRO-3, and ZeRO-2 (Plan.zero_stage 2); under stage 1 they accumulate whole (FSDP2
    # keeps the unsharded gradients in its reduce dtype until the last micro-batch's reduce-scatter)
    all_gradients = elem * rp.trainable / (shard if plan.zero_stage > 1 else 1) * on_gpu
    gradients = all_gradients * grads_live
    optimizer = optimizer_state_bytes_per_param * elem / 4 * rp.trainable / shard * on_gpu  # Adam m, v; bytes
    gathered = _gathered_bytes(plan, rp, blocks, compute, elem)

    act = _Activations.of(profile, plan, cal, variants, blocks, (first, last), pp_rank)
    transient, largest = _transient_bytes(act.prof, plan, cal, last)

    live = _live_peak(act.prof, plan, all_gradients, gathered)
    if live is not None:  # the trace's own replay of the eager step: every moment, no rule
        activations, gradients, gathered = live
        allocated = parameters + buffers + gradients + optimizer + gathered + activations
        overhead = _replayed_overhead(act.prof, plan, cal, _overhead_bytes(act.prof, plan, cal, allocated, largest))
        return MemoryPrediction(parameters_bytes=parameters, gradients_bytes=gradients, optimizer_bytes=optimizer,
                                gathered_bytes=gathered, activations_bytes=activations, transient_bytes=0.0,
                                overhead_bytes=overhead, buffers_bytes=buffers, context_bytes=cal.context_bytes)
    # The peak is the largest of these moments (measured with the exact check, autopar.exact):
    # (a) backward starts: every block's saved activations, the head's and the loss's buffers;
    # (b) a checkpointed block recomputes during backward: the head's buffers are gone, one block's full
    #     activations exist again;
    # (d) the last block's backward / the optimizer step: nearly every gradient alive, that block's activations
    #     (recomputed under checkpointing) still held.
    moment_a = act.blocks + act.outside + transient
    moment_b = act.blocks + act.recompute
    moment_d = act.recompute + act.first_block if plan.checkpointing != "none" else act.first_block
    states = parameters + buffers + gradients + optimizer + gathered
    step_states = parameters + buffers + all_gradients + optimizer
    if states + max(moment_a, moment_b) >= step_states + moment_d:
        activations = max(moment_a, moment_b) - (transient if moment_a >= moment_b else 0.0)
        transient = transient if moment_a >= moment_b else 0.0
    else:  # the end of backward / the optimizer step: gradients all alive, little gathered or saved
        unit = 0.0 if not plan.uses_fsdp else (compute + elem) * rp.largest_unit  # the last unit's gathered weights
        gradients, gathered, activations, transient = all_gradients, unit, moment_d, 0.0

    allocated = parameters + buffers + gradients + optimizer + gathered + activations + transient
    return MemoryPrediction(parameters_bytes=parameters, gradients_bytes=gradients, optimizer_bytes=optimizer,
                            gathered_bytes=gathered, activations_bytes=activations, transient_bytes=transient,
                            overhead_bytes=_overhead_bytes(act.prof, plan, cal, allocated, largest),
                            buffers_bytes=buffers, context_bytes=cal.context_bytes)


def _live_peak(prof: ModelProfile, plan: Plan, all_gradients: float,
               gathered: float) -> tuple[float, float, float] | None:
    """(activations, gradients, gathered) in bytes at the eager step's peak, from the trace's replay of what is
    alive op by op (the profile's live_frontier: autopar.profile.live), for the plans whose step is the traced
    one split by data parallelism only: eager, no checkpointing, no tensor or pipeline parallelism. The
    activations (saved tensors, transients, the loss's buffers: all but weights, gradients and casts) scale with
    the micro-batch; the gradients alive at that moment are their traced share of the rank's gradients (all of
    them with accumulation: earlier micro-batches left them); the weights' bf16 copies are those alive at that
    moment where the plan casts as the trace did (autocast, no FSDP: each copy dies after its GEMMs' backward, as
    the gradients appear), else `gathered` (FSDP's gathered units) throughout. None for other plans, or without
    a frontier."""
    if not prof.live_frontier or plan.compile or plan.checkpointing != "none" or plan.tp > 1 or plan.pp > 1:
        return None
    scale = plan.micro_batch_size / prof.sample_batch_size
    traced_gradients = max(g for _, g, _ in prof.live_frontier)
    casts_as_traced = plan.precision == "bf16" and not plan.uses_fsdp

    def at(point: tuple[int, int, int | None]) -> tuple[float, float, float]:
        other, grads, casts = point
        copies = float(casts) if casts_as_traced and casts is not None else gathered
        if plan.grad_accum > 1:
            return scale * other, all_gradients, copies
        return scale * other, all_gradients * (grads / traced_gradients if traced_gradients else 0.0), copies

    return max((at(p) for p in prof.live_frontier), key=sum)


#: A training process's own host memory beside what CPU offload puts there: the interpreter, torch and the CUDA,
#: cuBLAS, cuDNN and NCCL libraries it maps, the data loader's batches; bytes per rank; a stated allowance, not
#: measured by autopar (such processes commonly hold 2-4 GiB resident).
HOST_PROCESS_BYTES = 4 * GiB


@dataclass(frozen=True)
class HostMemoryPrediction:
    """Host (CPU) memory one node needs for a plan: what each of its ranks keeps there, times its ranks."""

    ranks_per_node: int  # the plan's ranks on one node
    offloaded_bytes_per_rank: float  # CPU offload: the rank's shard of fp32 weights, gradients and optimizer states
    process_bytes_per_rank: float  # the process itself (HOST_PROCESS_BYTES)

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1:
            raise ValueError(f"HostMemoryPrediction.ranks_per_node must be at least 1, got {self.ranks_per_node}.")
        if self.offloaded_bytes_per_rank < 0 or self.process_bytes_per_rank < 0:
            raise ValueError("HostMemoryPrediction: host memory bytes must be >= 0, got "
                             f"{self.offloaded_bytes_per_rank} and {self.process_bytes_per_rank}.")

    @property
    def node_bytes(self) -> float:
        """What must fit in one node's host memory."""
        return self.ranks_per_node * (self.offloaded_bytes_per_rank + self.process_bytes_per_rank)


def predict_host_memory(profile: ModelProfile, plan: Plan, *, ranks_per_node: int,
                        optimizer_state_bytes_per_param: int = 8) -> HostMemoryPrediction:
    """Host memory of one node of `ranks_per_node` of the plan's ranks. Under CPU offload (FSDP2's
    CPUOffloadPolicy: sharded states live in host memory and the optimizer steps there) each rank keeps its
    shard of the model states that `predict_memory` then leaves off the GPU (ZeRO's accounting over the same
    `_RankParams`); without offload, nothing but the process. Every rank of an offload plan holds the same
    (offload plans have no pipeline), so the first one's stands for all."""
    offloaded = 0.0
    if plan.cpu_offload:
        blocks, first, last = stage_blocks(profile, plan)
        rp = _RankParams.of(profile, plan, blocks, first, last)
        elem = weight_element_bytes(profile)  # 4: float32
        weights = elem * rp.params  # fp32 master weights, as the offload holds them; bytes; ZeRO-3
        gradients = elem * rp.trainable  # fp32 gradients, offloaded after their reduce-scatter; bytes; ZeRO-3
        optimizer = optimizer_state_bytes_per_param * elem / 4 * rp.trainable  # Adam's m and v; bytes; ZeRO
        offloaded = (weights + gradients + optimizer) / plan.dp_shard
    return HostMemoryPrediction(ranks_per_node=ranks_per_node, offloaded_bytes_per_rank=offloaded,
                                process_bytes_per_rank=float(HOST_PROCESS_BYTES))


def _gathered_bytes(plan: Plan, rp: _RankParams, blocks: list[int], compute: float, elem: float) -> float:
    """Weights gathered (or cast) for compute. FSDP all-gathers a unit's weights in the compute dtype for its
    forward and again for its backward; at the peak (backward of a unit) the unit, the prefetched next one and
    the root's (embeddings, head) are gathered, with the unit's unsharded gradient (compute dtype) and its fp32
    reduce-scatter buffer; without resharding after forward every block stays gathered. Without FSDP, bf16
    autocast keeps a bf16 copy of every weight used in forward until its backward (saved for it), frozen
    weights' too (their casts are saved by the GEMMs that need them for the input gradients), but not the
    grouped GEMMs' expert weights, which autocast leaves in fp32 (their GEMMs run in fp32). `elem`: the weights' own
    bytes an element (4: float32; the reduce-scatter runs in it; autocast copies only float32 weights)."""
    if plan.uses_fsdp:
        units = (len(blocks) if not plan.reshard_after_forward else 2) * rp.largest_unit
        # under float8 all-gather (Plan.float8_all_gather) the float8 layers' weights arrive in float8, 1 byte an
        # element, and their GEMMs read them so: no compute-dtype copy (torchao's WeightWithDynamicFloat8CastTensor)
        share = rp.float8_share if plan.float8_all_gather else 0.0
        gathered = (compute * (1 - share) + share) * units + compute * rp.outside \
            + (compute + elem) * rp.largest_unit
        if plan.cpu_offload:  # sharded states live in host memory; gathered copies come over PCIe
            gathered += elem * rp.largest_unit
        return gathered
    return 2 * max(rp.params - rp.grouped, 0.0) if plan.precision == "bf16" and elem == 4 else 0.0


@dataclass(frozen=True)
class _Activations:
    """Activation bytes on one rank at the micro-batch (the profile's trace scaled from its sample; a bf16 plan
    reads the bf16 trace, or half the fp32 one under FSDP's all-bf16 compute)."""

    prof: ModelProfile  # the profile in the plan's precision
    blocks: float  # saved by the stage's blocks, every micro-batch in flight
    outside: float  # saved outside the blocks (embeddings, head, loss)
    recompute: float  # one block's full activations while it recomputes (checkpointing)
    first_block: float  # the stage's first block's (what the last backward holds)

    @classmethod
    def of(cls, profile: ModelProfile, plan: Plan, cal: "Calibration", variants: Mapping[str, ModelProfile] | None,
           blocks: list[int], ends: tuple[bool, bool], pp_rank: int) -> "_Activations":
        """`ends`: whether the rank holds the embeddings (first stage) and the head (last stage)."""
        prof, scale_dtype = activation_profile(profile, plan, cal, variants)
        scale = plan.micro_batch_size / prof.sample_batch_size * scale_dtype
        tp = plan.tp
        per_block = []
        for index, i in enumerate(blocks):
            b = prof.blocks[i]
            # Korthikanti et al.: TP splits what lies between a column and a row layer; the norm inputs and the
            # column layers' inputs stay whole on every rank unless sequence parallelism splits them.
            checkpointed = plan.checkpointing != "none" and index % plan.checkpoint_every == 0
            if not checkpointed:
                per_block.append(_tp_block_bytes(prof, b, plan) * _compiled_ratio(b, plan, cal))
            elif plan.checkpointing == "full":  # only the block's input is kept (2sbh of 34sbh at 16 bit)
                per_block.append(_hidden_tensor(prof, plan, tp))
            elif plan.checkpointing == "alternate":  # of those, every other GEMM's output, and the block's input
                per_block.append(_alternate_saved(b) / tp + _hidden_tensor(prof, plan, tp))
            elif plan.checkpointing == "gemms":  # of those, all but the dense GEMMs' outputs, and the block's input
                per_block.append(_gemms_saved(b) / tp + _hidden_tensor(prof, plan, tp))
            else:  # selective: matmul and attention outputs (split by TP) and the block's input
                per_block.append(b.selective_saved_bytes / tp + _hidden_tensor(prof, plan, tp))
        recompute = 0.0
        if plan.checkpointing != "none":  # one block's full activations exist again during its recompute
            b = max((prof.blocks[i] for i in blocks), key=lambda blk: blk.saved_bytes, default=None)
            if b is not None:
                recompute = _tp_block_bytes(prof, b, plan) * _compiled_ratio(b, plan, cal)
        first, last = ends
        outside = _outside_saved(prof, plan, cal) * (0.5 * first + 0.5 * last if plan.pp > 1 else 1.0)
        return cls(prof=prof, blocks=scale * sum(per_block) * in_flight_microbatches(plan, pp_rank),
                   outside=scale * outside, recompute=scale * recompute,
                   first_block=scale * per_block[0] if per_block else 0.0)


def _alternate_saved(b: BlockProfile) -> float:
    """What "alternate" checkpointing keeps of a block (autopar.strategies.checkpointing): its trace's tally, or for
    a profile written before it had one, what selective keeps (at least as much: never under-predicted)."""
    return b.alternate_saved_bytes if b.alternate_tallied else b.selective_saved_bytes


def _gemms_saved(b: BlockProfile) -> float:
    """What "gemms" checkpointing keeps of a block (autopar.strategies.checkpointing): selective's tally less the
    dense GEMMs' outputs; for a profile written before that tally, what "alternate" keeps (never under-predicted)."""
    if b.gemm_saved_bytes is None:
        return _alternate_saved(b)
    return max(0.0, b.selective_saved_bytes - b.gemm_saved_bytes)


def _compiled_ratio(b: BlockProfile, plan: Plan, cal: "Calibration") -> float:
    """A block's saved bytes under the plan / eagerly: under torch.compile what inductor's partitioner keeps
    (the profile's `compiled_saved_bytes`, autopar.profile.remat; under per-block compile without the score
    matrices of attention whose mask only a whole-graph compile builds), or for a profile without it the
    calibrated ratio (compile_activation_factor); 1 eagerly."""
    if not plan.compile:
        return 1.0
    if b.compiled_saved_bytes is None:
        return cal.compile_activation_factor
    saved = b.compiled_saved_bytes
    if not plan.compiles_whole_model:  # per-block compile: the model builds its masks eagerly, and skips them
        saved -= b.compiled_unfused_bytes
    return saved / b.saved_bytes if b.saved_bytes else 1.0


def _outside_saved(prof: ModelProfile, plan: Plan, cal: "Calibration") -> float:
    """Bytes saved outside the blocks on the profile's sample (compiled: the partitioner's)."""
    if not plan.compile:
        return float(prof.saved_bytes_outside_blocks)
    if prof.compiled_saved_bytes_outside_blocks is None:
        return prof.saved_bytes_outside_blocks * cal.compile_activation_factor
    return float(prof.compiled_saved_bytes_outside_blocks)


def _transient_bytes(prof: ModelProfile, plan: Plan, cal: "Calibration", last: bool) -> tuple[float, float]:
    """(the short-lived bytes at the peak, the largest tensor's bytes) per micro-batch, on the stage with the
    head; split over the vocabulary under TP (vocab-parallel loss). From the trace in the plan's precision (the
    fp32 trace of a GQA model runs the math attention kernel, whose attention matrix a GPU's fused kernel
    never makes).

    Eagerly: the largest tensor (the logits, in fp32 for the loss) and its gradient: an upcast copy (the loss's
    logits.float() under autocast) lives beside the tensor it copies (upcast_transient_factor copies, else
    transient_factor). Compiled: inductor fuses the upcast and the loss, so no fp32 copy is made; at backward's
    start the logits' gradient and the zero gradient AOTAutograd makes for the logits output (a model output no
    loss reads) exist, each in the compute dtype: together the fp32 copy's bytes where the largest tensor is an
    upcast copy, else one largest tensor (its gradient). Profiles without the partition (compiled_saved_bytes)
    keep the calibrated compile_transient_factor."""
    if not last:
        return 0.0, 0.0
    vocab_split = prof.vocab_size is not None and plan.tp > 1 and prof.vocab_size % plan.tp == 0
    largest = prof.largest_transient_bytes * plan.micro_batch_size / prof.sample_batch_size \
        / (plan.tp if vocab_split else 1)
    upcast = prof.largest_transient_op == "_to_copy"
    if not plan.compile:
        return (cal.upcast_transient_factor if upcast else cal.transient_factor) * largest, largest
    if prof.compiled_saved_bytes_outside_blocks is None:
        copies = cal.upcast_transient_factor if upcast else cal.transient_factor
        return copies * largest * cal.compile_transient_factor, largest
    return largest, largest


def _replayed_overhead(prof: ModelProfile, plan: Plan, cal: "Calibration", rule: float) -> float:
    """What must fit beyond the allocated peak of an eager step the trace replayed: the CUDA context and the
    caching allocator's reserve in a loop of that step (autopar.profile.allocator: the allocator's own rules
    over the traced allocations, which no single factor fits). `rule` (the largest-tensor rule's overhead, bytes)
    where the profile has no replay or the replay is not of this plan's loop (`_replays`), and at least `rule`
    where the trace did not dispatch as CUDA (a CPU trace's allocations can differ from CUDA's)."""
    if prof.allocator_reserve_bytes is None or not _replays(prof, plan):
        return rule
    replayed = cal.context_bytes + prof.allocator_reserve_bytes
    return replayed if prof.allocator_replay_on_cuda else max(replayed, rule)


def _replays(prof: ModelProfile, plan: Plan) -> bool:
    """Whether the allocator's replay is of this plan's loop: one GPU's whole weights, gradients and optimizer
    state (no data parallelism, no offload), one micro-batch a step, of the traced size (the reserve is not
    linear in the micro-batch: a block cached for one size is carved differently at another)."""
    return (plan.dp_size == 1 and not plan.cpu_offload and plan.grad_accum == 1
            and plan.micro_batch_size == prof.sample_batch_size)


def _overhead_bytes(prof: ModelProfile, plan: Plan, cal: "Calibration", allocated: float, largest: float) -> float:
    """What must fit beyond the allocated peak: the CUDA context (measured: device memory in use that the caching
    allocator does not hold) and the allocator's reserve over the peak. The reserve is the block of the largest
    tensor freed before the peak, which the allocator keeps cached (it returns no segment without memory
    pressure) while the smaller tensors allocated after it split it and new segments are reserved: where the
    largest tensor is the loss's upcast copy, the tensor it copied (the logits in the compute dtype: freed as
    the loss starts eagerly, their gradient freed after the head's backward compiled), else the largest tensor
    itself; at least reserve_bytes (block rounding: 2 MiB segments for small tensors, 20 MiB for 1-10 MiB ones,
    2 MiB multiples above; a pipeline stage without the head), plus a part growing with the peak
    (fragmentation_fraction)."""
    freed = largest * (_bytes(plan.precision) / 4 if prof.largest_transient_op == "_to_copy" else 1.0)
    return cal.context_bytes + cal.fragmentation_fraction * allocated \
        + max(cal.reserve_bytes, cal.largest_reserve_factor * freed)


@functools.lru_cache(maxsize=64)
def _tp_pairs(profile: ModelProfile) -> tuple[int, int]:
    """(TP pairs, column-parallel layers) in one block; cached per profile (the search asks often)."""
    if not (profile.blocks and profile.hidden_dim is not None and profile.matmul_calls):
        return (0, 0)

    prefix = profile.blocks[0].name + "."
    pairs = pairs_from_calls([c for c in profile.matmul_calls if c.name.startswith(prefix)], profile.hidden_dim, None,
                             num_heads=profile.num_heads)
    return (len(pairs), sum(len(p.colwise) for p in pairs))


def replicated_hidden_bytes(profile: ModelProfile, block_saved_hidden: float) -> float:
    """Of a block's saved hidden-state-shaped bytes, those tensor parallelism without sequence parallelism
    keeps whole on every rank: each TP pair's input and the norm input before it (Korthikanti et al. 2022:
    the 10 s b h of s b h (10 + 24/t), less dropout masks). Queries, keys, values and the attention output
    have the hidden states' size too, but are split over the heads."""
    pairs = _tp_pairs(profile)[0]
    if pairs == 0:
        return block_saved_hidden
    return min(block_saved_hidden, 2 * pairs * profile.block_input_bytes)


def plan_profile(profile: ModelProfile, plan: Plan, variants: Mapping[str, ModelProfile] | None) -> ModelProfile:
    """The profile a plan is predicted from: for an fp32 plan of a profile traced in bf16 (the planner traces in
    bf16 where the GPUs have it, since it offers only bf16 plans there), the fp32 trace among `variants` where
    there is one (a mapping that traces on first read makes it then); else the profile itself."""
    if plan.precision == "fp32" and profile.profile_precision != "fp32" and variants:
        fp32 = variants.get("fp32")
        if fp32 is not None:
            return fp32
    return profile


def activation_profile(profile: ModelProfile, plan: Plan, cal: "Calibration",
                       variants: Mapping[str, ModelProfile] | None) -> tuple[ModelProfile, float]:
    """The profile whose activation bytes match the plan's precision, and a factor on them: the autocast
    trace for bf16 without FSDP (times a measured factor: CPU autocast, where the trace runs, keeps fewer
    ops in fp32 than CUDA's), the bf16-weights trace under FSDP's mixed precision, or half the fp32 trace."""
    variants = variants or {}
    if plan.precision == "bf16":
        key = "bf16-pure" if plan.uses_fsdp else "bf16"
        traced = variants.get(key)  # a mapping that traces on first read gives None where the trace failed
        if traced is not None:
            return traced, (cal.autocast_activation_factor if key == "bf16" else 1.0)
        return profile, 0.5 if profile.profile_precision == "fp32" else 1.0
    return profile, 1.0


def _tp_block_bytes(prof: ModelProfile, b: "BlockProfile", plan: Plan) -> float:
    """A block's saved bytes on one TP rank (bytes, on the profile's sample)."""
    tp = plan.tp
    if tp == 1:
        return float(b.saved_bytes)
    if plan.sequence_parallel:
        # All split, except that torch's ColwiseParallel all-gathers each column layer's input on its own (GPT:
        # q, k, v and the MLP's first layer) and each matmul saves it whole, while the pair's sharded input
        # (the norm's output) is not saved (Megatron-LM gathers once and re-gathers in backward, which
        # Korthikanti et al.'s 34/t assumes). Measured with the exact check (tests/cost/test_exact.py).
        pairs, columns = _tp_pairs(prof)
        return b.saved_bytes / tp + prof.block_input_bytes * (columns - pairs / tp)
    whole = replicated_hidden_bytes(prof, b.saved_hidden_bytes)
    return whole + (b.saved_bytes - whole) / tp


def _hidden_tensor(profile: ModelProfile, plan: Plan, tp: int) -> float:
    """Bytes of a block's input on the profile's sample: what full checkpointing keeps per block (2sbh of
    Korthikanti's 34sbh); split by TP only under sequence parallelism."""
    one = profile.block_input_bytes
    return one / tp if plan.sequence_parallel else one
