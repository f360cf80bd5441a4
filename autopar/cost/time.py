"""Step time of a plan, in parts, from the model's profile, the hardware and the plan.

All times are seconds of one optimizer step on the slowest rank. The FLOPs, bytes and op counts come
from the profile's trace; rates from the topology (datasheets, or micro-benchmarks) times the
calibration's efficiencies. Communication uses the alpha-beta model (latency + bytes / bandwidth) with
ring algorithms' traffic: an all-reduce moves 2 (n-1)/n of the buffer per rank, an all-gather or a
reduce-scatter (n-1)/n (Thakur et al. 2005, as NCCL implements them), at the link's rate times NCCL's
efficiency (NVLink inside a node, the network across nodes).

Compute and memory-bound time are per op (autopar.cost.ops): the trace recorded every GEMM, convolution,
attention and grouped GEMM with its real shape, forward and backward, and every memory-bound op's bytes;
each runs at its class's rate for its shape, from factors fitted on Hopper (the H200 anchors and kernel
profiles) and scaled to the GPU's architecture (`calibration.matmul_arch`). Compiled, the memory-bound work
is what fusion leaves of it (autopar.profile.fusion.FusionModel) and the launches are its kernels. Checked on
paper against Megatron-LM's Table 1 on A100s (tests/cost/test_paper.py, bench/megatron_table1.py) and on the
H200 runs (bench/step_time_check.py).
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass, fields, replace
from typing import Mapping

from ..layout import float8_weight_params, float8_weight_shapes, pairs_from_calls, split_stages, stage_ids
from ..plans import Plan
from ..profile import BlockProfile, ModelProfile
from ..profile.model_profile import OpGroup
from ..topology import Topology
from .calibration import Calibration, matmul_arch
from .memory import (activation_profile, compute_bytes, outside_trainable_params, plan_profile, stage_blocks,
                     trainable_share, weight_element_bytes)
from .ops import OpsTime, Rates, TPSplit, group_time

@dataclass(frozen=True)
class TimePrediction:
    """Seconds of one optimizer step, by what takes them."""

    compute_s: float  # GEMMs, convolutions, attention and grouped GEMMs, each at its shape's achieved rate
    memory_s: float  # memory-bound ops (norms, activations, softmax, elementwise) over achieved bandwidth
    launch_s: float  # CPU time launching kernels beyond what the GPU work hides
    recompute_s: float  # activation checkpointing: forward work done again in backward
    tp_comm_s: float  # tensor-parallel all-reduces (or reduce-scatter + all-gather), not overlapped
    dp_comm_s: float  # data-parallel communication not hidden behind compute (FSDP gathers, reduce-scatters)
    pp_bubble_s: float  # pipeline bubble: stage time idle while the pipeline fills and drains
    pp_comm_s: float  # pipeline send/receive of activations and their gradients
    optimizer_s: float  # the optimizer step
    offload_s: float  # CPU offload: host-device copies and the CPU optimizer
    overhead_s: float = 0.0  # fixed costs per micro-batch (launching graphs, hooks, the loss)

    def __post_init__(self) -> None:
        for f in fields(self):
            assert getattr(self, f.name) >= 0, f"negative time term {f.name}"

    @property
    def step_s(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    def parts(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class TimeTerms:
    """The terms the calibration fits (seconds at the current calibration) and the rest (fixed)."""

    matmul: float
    memory: float
    launch: float
    fixed_s: float


@dataclass(frozen=True)
class _Group:
    """One micro-batch of one group of ops as it runs: its times (memory-bound time already times its traffic
    factor) and what the host pays per launch and view (eager, or inside a compiled graph)."""

    ops: OpsTime
    host: "HostCosts"


@dataclass(frozen=True)
class _StageWork:
    """One micro-batch of a pipeline rank's ops on one TP rank: its blocks' and the rest's (embeddings on the
    first stage, head and loss on the last), and its groups in the order they run (before, each block, after,
    the loss)."""

    blocks: OpsTime
    outside: OpsTime
    order: tuple[_Group, ...] = ()

    @property
    def total(self) -> OpsTime:
        return self.blocks + self.outside

    def host_s(self) -> float:
        """CPU seconds the host spends issuing the micro-batch's ops."""
        return sum(g.host.forward_s(g.ops) + g.host.backward_s(g.ops) for g in self.order)


@functools.lru_cache(maxsize=256)
def _tp_splits(profile: ModelProfile, tp: int) -> tuple[TPSplit, TPSplit]:
    """(inside the blocks, outside them): what TP splits, from the first block's Linear-like calls paired as
    autopar.strategies.tensor_parallel pairs them (autopar.layout.pairs_from_calls), and the head over its
    vocabulary when TP divides it (vocab-parallel). Cached per profile (the search asks often)."""
    if tp <= 1:
        return TPSplit(), TPSplit()
    prefix = profile.blocks[0].name + "." if profile.blocks else "\0"
    calls = [c for c in profile.matmul_calls if c.name.startswith(prefix)]
    pairs = pairs_from_calls(calls, profile.hidden_dim, None, num_heads=profile.num_heads) \
        if profile.hidden_dim and calls else []
    features = {c.name: (c.in_features, c.out_features) for c in calls}
    colwise = frozenset(features[n] for p in pairs for n in p.colwise)
    rowwise = frozenset(features[p.rowwise] for p in pairs)
    vocab = profile.vocab_size if profile.vocab_size and profile.vocab_size % tp == 0 else None
    return TPSplit(tp, colwise, rowwise, heads=bool(pairs)), TPSplit(tp, vocab=vocab)


def _stage_work(profile: ModelProfile, prof: ModelProfile, plan: Plan, topology: Topology, cal: Calibration,
                stage: tuple[list[int], bool, bool], traffic_scale: float) -> _StageWork | None:
    """The stage's op records (read from `prof`, the trace in the plan's precision) timed for one micro-batch
    on one TP rank (autopar.cost.ops); None where the profile has no op records (not traced, or written by an
    autopar that did not record them). Compiled, the blocks run in inductor's graphs; the ops outside them too
    where the whole model's forward is compiled (one process, no pipeline: autopar.strategies.compile), else
    eagerly; the loss (after the model's forward returns) always eagerly."""
    if not prof.op_groups:
        return None
    blocks, first, last = stage
    scale = plan.micro_batch_size / prof.sample_batch_size
    inside, outside = _tp_splits(profile, plan.tp)
    whole = plan.compiles_whole_model
    graphs = plan.cuda_graphs  # the compiled graphs replayed as CUDA graphs (whole model, one process)
    modes = {compiled: (Rates.of(topology.device, replace(plan, compile=compiled, cuda_graphs=graphs and compiled,
                                                          max_autotune=plan.max_autotune and compiled), cal,
                                 trace_precision=prof.profile_precision), HostCosts.of(cal, compiled, graphs),
                        1.0 if compiled else cal.eager_traffic_factor)
             for compiled in {plan.compile, whole, False}}

    float8 = float8_weight_shapes(prof) if plan.float8 else frozenset()  # the blocks' float8 linears' weights

    def timed(group: OpGroup, split: TPSplit, compiled: bool, in_blocks: bool = False) -> _Group:
        rates, host, traffic = modes[compiled]
        rates = rates.with_float8(float8) if in_blocks and float8 else rates
        return _Group(group_time(group, scale, split, rates, traffic_scale).memory_times(traffic), host)

    groups = [g for g in (prof.ops_of("blocks", i) for i in blocks) if g is not None]
    per_block = {id(g): timed(g, inside, plan.compile, in_blocks=True) for g in groups}  # equal blocks: timed once
    work = OpsTime()
    for key, count in collections.Counter(id(g) for g in groups).items():
        work = work + per_block[key].ops.times(count)
    ends = {where: timed(group, outside, compiled)
            for where, held, compiled in (("before", first, whole), ("after", last, whole), ("loss", last, False))
            if held and (group := prof.ops_of(where)) is not None}
    rest = OpsTime()
    for g in ends.values():
        rest = rest + g.ops
    order = ([ends["before"]] if "before" in ends else []) + [per_block[id(g)] for g in groups] \
        + [ends[w] for w in ("after", "loss") if w in ends]
    return _StageWork(blocks=work, outside=rest, order=tuple(order))


@dataclass(frozen=True)
class HostCosts:
    """CPU seconds the host spends per op of a step, forward (issued from the model's Python) and backward
    (issued by autograd's C++ engine): per kernel launch and per view (no kernel); from the Calibration."""

    launch_s: float  # per forward kernel (eager: launch_s; compiled: compiled_kernel_launch_s); seconds
    backward_launch_s: float  # per backward kernel (eager: backward_launch_s; compiled: the same as forward)
    view_s: float = 0.0  # per forward view (eager: view_host_s; none compiled); seconds
    backward_view_s: float = 0.0  # per backward view (eager: backward_view_host_s); seconds
    conv_s: float = 0.0  # per convolution call, beyond its launch (cuDNN's own host work, eager or compiled); seconds

    @classmethod
    def of(cls, cal: Calibration, compiled: bool, graphs: bool = False) -> "HostCosts":
        """Compiled, inductor's Python wrapper launches the kernels of both graphs (the backward's from the
        compiled autograd function), so one cost a kernel both ways; replayed as CUDA graphs (`graphs`), the GPU
        launches them (cuDNN's host work was done when the graph was recorded)."""
        if compiled and graphs:
            return cls(cal.graph_kernel_launch_s, cal.graph_kernel_launch_s)
        if compiled:
            return cls(cal.compiled_kernel_launch_s, cal.compiled_kernel_launch_s, conv_s=cal.conv_host_s)
        return cls(cal.launch_s, cal.backward_launch_s, cal.view_host_s, cal.backward_view_host_s, cal.conv_host_s)

    def forward_s(self, t: OpsTime) -> float:
        return (t.launches - t.backward_launches) * self.launch_s + (t.views - t.backward_views) * self.view_s \
            + (t.convs - t.backward_convs) * self.conv_s

    def backward_s(self, t: OpsTime) -> float:
        return t.backward_launches * self.backward_launch_s + t.backward_views * self.backward_view_s \
            + t.backward_convs * self.conv_s


def _queued_s(order: tuple[_Group, ...], memory_scale: float) -> float:
    """GPU seconds of one micro-batch's ops with the CPU launching them: the host issues each group's kernels
    (its `host` costs a kernel and a view) in the order they run, the forward's groups first to last, then the
    backward's last to first; the GPU runs a group's work once the host has issued it and the GPU is done with
    the one before: end = max(GPU end before + the group's GPU time, host end of issuing it). A queue fed at a
    group's grain: the host runs ahead during GPU-heavy groups (large GEMMs) and the GPU waits through
    launch-bound ones (a CNN's late stages of small kernels, whose backward runs first), which a whole-step
    max(host, GPU) hides. `memory_scale`: on the groups' memory-bound time (tensor parallelism's split)."""
    phases = [(g.ops.compute_forward_s + g.ops.memory_forward_s * memory_scale, g.host.forward_s(g.ops))
              for g in order]
    phases += [(g.ops.compute_backward_s + g.ops.memory_backward_s * memory_scale, g.host.backward_s(g.ops))
               for g in reversed(order)]
    issued = gpu = 0.0
    for gpu_s, host_s in phases:
        issued += host_s
        gpu = max(gpu + gpu_s, issued)
    return gpu


def _flops_only_s(topology: Topology, plan: Plan, cal: Calibration, flops: float) -> float:
    """Seconds of `flops` where no op records say their shapes: at the best GEMM's rate (bf16: peak x
    matmul_efficiency x the architecture's ratio; fp32: x fp32_matmul_efficiency)."""
    if plan.precision != "bf16":
        return flops / (topology.device.peak_flops("fp32") * cal.fp32_matmul_efficiency)
    eff = cal.matmul_efficiency * matmul_arch(topology.device).efficiency_ratio
    return flops / (topology.device.peak_flops("bf16") * eff)


def _prod(shape: tuple[int, ...]) -> float:
    out = 1.0
    for d in shape:
        out *= d
    return out


def _collective_s(bytes_: float, n: int, bandwidth: float, cal: Calibration, kind: str) -> float:
    """Seconds of one ring collective over `n` ranks moving `bytes_` per rank at an achieved bus `bandwidth`."""
    if n <= 1 or bytes_ <= 0:
        return 0.0
    traffic = (2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n) * bytes_
    return cal.comm_latency_s + traffic / bandwidth


def _group_bandwidth(topology: Topology, size: int, stride: int, cal: Calibration, *, rings: bool = True) -> float:
    """Achieved bus bandwidth per GPU (bytes/s) of a group of `size` ranks `stride` apart in rank order: inside
    a node the link's (x comm_efficiency); across nodes a collective's members on one node each drive their own
    network card, rings in parallel (Topology.link_bytes_per_s), so the network's times the fewest members
    the group has on a node (x network_efficiency), held back by the node's link (x comm_efficiency) where
    that is slower. `rings=False`: point-to-point sends (a pipeline's), each through one card."""
    if size <= 1:
        return float("inf")
    intra = topology.device.intra_node_bytes_per_s * cal.comm_efficiency
    if topology.num_nodes > 1 and size * stride > topology.devices_per_node:
        cards = _ranks_per_node(topology, size, stride) if rings else 1
        return min(intra, cards * topology.inter_node_bytes_per_s * cal.network_efficiency)
    return intra


def _ranks_per_node(topology: Topology, size: int, stride: int) -> int:
    """The fewest members a group of `size` ranks `stride` apart (the one with rank 0) has on a node it
    touches: its ring is as fast as the node with the fewest cards in it."""
    per_node = collections.Counter(i * stride // topology.devices_per_node for i in range(size))
    return min(per_node.values())


def _trainable_params(profile: ModelProfile, plan: Plan, blocks: list[int], first: bool, last: bool) -> float:
    """Of a rank's parameters (TP-split, before FSDP's sharding), those that require grad: what has gradients
    to reduce and optimizer state to update (LoRA's frozen base weights have neither)."""
    tp = plan.tp
    trainable = sum((b.num_params - b.matmul_params * (1 - 1 / tp)) * trainable_share(b)
                    for b in (profile.blocks[i] for i in blocks))
    outside = max(outside_trainable_params(profile), 0.0)
    return trainable + outside * (0.5 * first + 0.5 * last if plan.pp > 1 else 1.0) / tp


def time_terms(profile: ModelProfile, plan: Plan, topology: Topology, cal: Calibration, *,
               variants: Mapping[str, ModelProfile] | None = None) -> tuple[TimePrediction, TimeTerms]:
    """The step time of `plan` on its slowest rank, and the terms a calibration fit scales. Of a pipeline:
    the first stage's rank (embeddings), the last's (head, loss) and the one with the most block FLOPs
    (an uneven split, e.g. 105 blocks over 70 stages, makes a middle rank the slowest)."""
    profile = plan_profile(profile, plan, variants)
    ranks = {0, plan.pp - 1}
    if plan.pp > 2:
        split = split_stages(profile, plan.pp * plan.pp_stages_per_rank)
        ranks.add(max(range(plan.pp), key=lambda r: sum(profile.blocks[i].flops for s in stage_ids(plan, r)
                                                        for i in split[s])))
    return max((_rank_time(profile, plan, topology, cal, variants, r) for r in sorted(ranks)),
               key=lambda t: t[0].step_s)


def _rank_time(profile: ModelProfile, plan: Plan, topology: Topology, cal: Calibration,
               variants: Mapping[str, ModelProfile] | None, pp_rank: int) -> tuple[TimePrediction, TimeTerms]:
    blocks, first, last = stage_blocks(profile, plan, pp_rank)
    tp, n_micro = plan.tp, plan.grad_accum
    samples = plan.micro_batch_size * n_micro  # this data-parallel rank's samples per step
    scale = samples / profile.sample_batch_size
    prof, _ = activation_profile(profile, plan, cal, variants)
    traffic_scale = 0.5 if plan.precision == "bf16" and prof.profile_precision == "fp32" else 1.0

    # Compute and memory-bound work: every traced op of the stage, timed by its class and shape for one
    # micro-batch on one TP rank (autopar.cost.ops), times the micro-batches; seconds. Memory-bound work: TP
    # splits it, but without SP not the norms and residuals (about 30%: Korthikanti et al.'s 10 of 34 s b h).
    block_flops = sum(profile.blocks[i].flops for i in blocks)
    head_flops = max(profile.flops - sum(b.flops for b in profile.blocks), 0.0) if last else 0.0
    stage_share = (block_flops + head_flops) / max(profile.flops, 1.0)
    tp_memory = tp if plan.sequence_parallel else (1 + (tp - 1) * 0.7) if tp > 1 else 1
    hbm = topology.device.hbm_bytes_per_s * cal.memory_efficiency
    work = _stage_work(profile, prof, plan, topology, cal, (blocks, first, last), traffic_scale)
    if work is not None:
        total = work.total
        compute = total.compute_s * n_micro
        # (eager groups' memory-bound time is already times eager_traffic_factor: _stage_work)
        per_memory = n_micro / tp_memory
        memory = total.memory_s * per_memory
        block_forward = (work.blocks.compute_forward_s * n_micro, work.blocks.memory_forward_s * per_memory)
        # Launches: CPU time per kernel of every micro-batch: eager, every traced op (launch_s forward,
        # backward_launch_s backward); compiled, the compute ops (SDPA's math path: its GEMMs and softmax kernels),
        # the fused kernels and the weights' casts (compiled_kernel_launch_s); each group at its own costs (the
        # loss eager); seconds.
        # Eager, the ops that launch no kernel (views) cost host time too (view_host_s each); the backward's
        # kernels and views, issued by autograd's C++ engine, cost backward_launch_s and backward_view_host_s.
        launch_total = work.host_s() * n_micro
        queued = n_micro * _queued_s(work.order, 1.0 / tp_memory)
    else:  # no op records: the FLOPs at the best GEMM's rate, the traced bytes over the bandwidth
        compute = _flops_only_s(topology, plan, cal, (block_flops + head_flops) / tp * scale)
        per_micro = (prof.traffic_bytes - prof.weight_traffic_bytes) * plan.micro_batch_size \
            / profile.sample_batch_size + prof.weight_traffic_bytes
        factor = cal.compile_traffic_factor if plan.compile else cal.eager_traffic_factor
        memory = per_micro * n_micro * traffic_scale * stage_share * factor / tp_memory / hbm
        share = block_flops / max(block_flops + head_flops, 1.0)
        block_forward = (compute * share / 3, memory * share / 3)
        launch_total = prof.num_ops * stage_share * n_micro * cal.launch_s * (
            cal.compile_launch_factor if plan.compile else 1.0)
        queued = launch_total
    launch = max(0.0, queued - (compute + memory))

    # Recompute: full checkpointing runs each checkpointed block's forward again (its compute and memory-bound
    # ops, at the same rates); selective checkpointing keeps the matmul and attention outputs and reruns the
    # memory-bound forward ops; "alternate" reruns those and every other GEMM, its share of the blocks' forward
    # compute their share of its FLOPs (BlockProfile.alternate_recompute_flops); "gemms" every dense GEMM, their
    # share of it (BlockProfile.gemm_forward_flops: at the blocks' mean rate, which attention's slower kernels
    # lower, so never under-predicted); seconds. Its TP all-reduces are in tp_comm.
    ckpt = sum(1 for k in range(len(blocks)) if k % plan.checkpoint_every == 0) / max(len(blocks), 1) \
        if plan.checkpointing != "none" else 0.0
    recompute_compute = ckpt * block_forward[0] * _recompute_share(prof, blocks, plan.checkpointing)
    recompute_memory = ckpt * block_forward[1] if plan.checkpointing != "none" else 0.0
    recompute = recompute_compute + recompute_memory

    # Tensor parallelism: per block and micro-batch, ring all-reduces of the hidden states (reduce-scatter +
    # all-gather under SP: the same bytes), two in forward and two in backward (Shoeybi et al. 2019), two more
    # when full checkpointing reruns the forward, and a pair for the embedding; not overlapped; seconds.
    elem = compute_bytes(profile, plan)  # the compute dtype's bytes an element (weights and hidden states)
    grad_elem = weight_element_bytes(profile)  # gradients, reduced in the weights' dtype (4: float32)
    hidden_numel = _prod(profile.block_input_shape) / profile.sample_batch_size if profile.block_input_shape else 0.0
    hidden_bytes = hidden_numel * plan.micro_batch_size * elem  # one micro-batch's hidden states; bytes
    tp_bw = _group_bandwidth(topology, tp, 1, cal)
    recomputed = ckpt * len(blocks) if plan.checkpointing == "full" else 0.0  # blocks whose forward runs twice
    tp_collectives = 4 * len(blocks) + 2 + 2 * recomputed  # per micro-batch; count
    tp_comm = n_micro * tp_collectives * _collective_s(hidden_bytes, tp, tp_bw, cal, "all_reduce")

    # Data parallelism: FSDP2 gathers the stage's weights in the compute dtype for each micro-batch's forward
    # (and backward when resharding) and reduce-scatters fp32 gradients, prefetching hides most of it;
    # replicas all-reduce the sharded fp32 gradients once a step, about half hidden; seconds (ZeRO, FSDP2).
    # ZeRO stages 2 and 1 (Plan.zero_stage) gather once a step, the first micro-batch's forward; stage 1 also
    # reduce-scatters once, after the last micro-batch (Rajbhandari et al. 2020, section 5).
    params = sum(profile.blocks[i].num_params - profile.blocks[i].matmul_params * (1 - 1 / tp) for i in blocks)
    params += (profile.num_params - sum(b.num_params for b in profile.blocks)) * (0.5 * first + 0.5 * last
                                                                                  if plan.pp > 1 else 1.0) / tp
    trainable = _trainable_params(profile, plan, blocks, first, last)  # gradients: reduced, and updated
    dp_comm = 0.0
    if plan.uses_fsdp and plan.dp_shard > 1:
        bw = _group_bandwidth(topology, plan.dp_shard, tp, cal)
        gathers = (2 if plan.reshard_after_forward else 1) * (n_micro if plan.zero_stage == 3 else 1)
        scatters = 1 if plan.zero_stage == 1 else n_micro
        # float8 all-gather (Plan.float8_all_gather): the float8 layers' weights gathered at 1 byte an element
        float8_params = float8_weight_params(profile, blocks) if plan.float8_all_gather else 0.0
        total = gathers * _collective_s((params - float8_params) * elem + float8_params, plan.dp_shard, bw, cal,
                                        "all_gather") \
            + scatters * _collective_s(trainable * grad_elem, plan.dp_shard, bw, cal, "reduce_scatter")
        hidden_by = cal.fsdp_overlap * (compute + memory + recompute)
        dp_comm += max(total - hidden_by, total / max(len(blocks), 1))  # the first unit's gather never hides
    if plan.dp_replicate > 1:
        bw = _group_bandwidth(topology, plan.dp_replicate, plan.dp_shard * tp, cal)
        dp_comm += _collective_s(trainable * grad_elem / plan.dp_shard, plan.dp_replicate, bw, cal, "all_reduce") \
            * (1 - cal.fsdp_overlap / 2)

    # Pipeline bubble: (p - 1) micro-batch stage-times over the m micro-batches, per chunk under interleaving
    # (Narayanan et al. 2021: (p - 1) / (m v)), a third of it for zero-bubble schedules (Qi et al. 2023);
    # seconds. Pipeline send/receive: each micro-batch's hidden states cross each chunk boundary forward and
    # back, blocking, whole on every TP rank (autopar gathers SP shards at stage ends; Megatron-LM's
    # scatter/gather sends 1/t a rank instead); seconds.
    stage_time = compute + memory + recompute + tp_comm
    pp_bubble = pp_comm = 0.0
    if plan.pp > 1:
        p, v = plan.pp, plan.pp_stages_per_rank
        bubble = (p - 1) / (n_micro * v) * stage_time
        if plan.pp_schedule == "zero_bubble":
            bubble *= cal.zero_bubble_factor
        pp_bubble = bubble
        bw = _group_bandwidth(topology, p, plan.dp_replicate * plan.dp_shard * tp, cal, rings=False)
        pp_comm = n_micro * 2 * v * (cal.comm_latency_s + hidden_bytes / bw)

    # Optimizer: fused AdamW reads and writes fp32 weights, gradients and both moments of the trainable shards
    # over the bandwidth its multi-tensor kernels achieve (optimizer_memory_efficiency); seconds.
    shard_params, shard_trainable = params / plan.dp_shard, trainable / plan.dp_shard
    optimizer_bytes_per_s = topology.device.hbm_bytes_per_s * cal.optimizer_memory_efficiency
    opt_bytes = cal.optimizer_bytes_per_param * grad_elem / 4  # per trainable weight (the fit's: float32)
    optimizer = 0.0 if plan.cpu_offload else shard_trainable * opt_bytes / optimizer_bytes_per_s
    # Overhead: fixed costs per micro-batch and stage chunk (graph launches, hooks, the loss); seconds.
    overhead = n_micro * plan.pp_stages_per_rank * cal.microbatch_overhead_s
    # Offload: gradients to the host, weights back over PCIe, and Adam on the CPU; seconds.
    offload = 0.0
    if plan.cpu_offload:
        offload = (shard_params + shard_trainable) * grad_elem / cal.pcie_bytes_per_s \
            + shard_trainable * opt_bytes / cal.cpu_adam_bytes_per_s

    prediction = TimePrediction(compute_s=compute, memory_s=memory, launch_s=launch, recompute_s=recompute,
                                tp_comm_s=tp_comm, dp_comm_s=dp_comm, pp_bubble_s=pp_bubble, pp_comm_s=pp_comm,
                                optimizer_s=optimizer, offload_s=offload, overhead_s=overhead)
    fixed = tp_comm + dp_comm + pp_bubble + pp_comm + optimizer + offload + overhead
    terms = TimeTerms(matmul=compute + recompute_compute, memory=memory + recompute_memory,
                      launch=launch_total if launch > 0 else 0.0, fixed_s=fixed)
    return prediction, terms


def _recompute_share(prof: ModelProfile, blocks: list[int], mode: str) -> float:
    """The share of the blocks' forward compute that checkpointing `mode` runs again: "full" all of it; "alternate"
    every other GEMM, "gemms" every dense GEMM, their share of the blocks' forward FLOPs (the trace's tallies,
    BlockProfile.alternate_recompute_flops and gemm_forward_flops); none for "none" and "selective" (whose rerun is
    the memory-bound ops'). A block of a profile written before a tally counts whole, as full checkpointing
    (never under-predicted)."""
    if mode == "full":
        return 1.0
    if mode == "alternate":
        def again(b: BlockProfile) -> float:
            return b.alternate_recompute_flops if b.alternate_tallied else b.forward_flops
    elif mode == "gemms":
        def again(b: BlockProfile) -> float:
            return b.gemm_forward_flops if b.gemm_forward_flops is not None else b.forward_flops
    else:
        return 0.0
    forward = sum(prof.blocks[i].forward_flops for i in blocks)
    return min(1.0, sum(again(prof.blocks[i]) for i in blocks) / forward) if forward > 0 else 0.0


def model_flops_per_step(profile: ModelProfile, plan: Plan) -> float:
    """The step's model FLOPs for MFU over the global batch: 6 N + 12 L h s per token (PaLM, appendix B; no
    recomputation) where the trace agrees with it, else the traced FLOPs (ModelProfile.model_flops)."""
    return profile.model_flops() / profile.sample_batch_size * plan.global_batch_size
