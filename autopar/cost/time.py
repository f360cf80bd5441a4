"""Step time of a plan, in parts, from the model's profile, the hardware and the plan.

All times are seconds of one optimizer step on the slowest rank. The FLOPs, bytes and op counts come
from the profile's trace; rates from the topology (datasheets, or micro-benchmarks) times the
calibration's efficiencies. Communication uses the alpha-beta model (latency + bytes / bandwidth) with
ring algorithms' traffic: an all-reduce moves 2 (n-1)/n of the buffer per rank, an all-gather or a
reduce-scatter (n-1)/n (Thakur et al. 2005, as NCCL implements them).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Mapping

from ..plans import Plan
from ..profile import ModelProfile
from ..topology import Topology
from .memory import activation_profile, stage_blocks

if TYPE_CHECKING:  # pragma: no cover
    from .calibration import Calibration


@dataclass(frozen=True)
class TimePrediction:
    """Seconds of one optimizer step, by what takes them."""

    compute_s: float  # matmul and attention FLOPs over the achieved rate
    memory_s: float  # memory-bound ops (norms, activations, softmax, elementwise) over achieved bandwidth
    launch_s: float  # CPU time launching kernels beyond what the GPU work hides
    recompute_s: float  # activation checkpointing: forward work done again in backward
    tp_comm_s: float  # tensor-parallel all-reduces (or reduce-scatter + all-gather), not overlapped
    dp_comm_s: float  # data-parallel communication not hidden behind compute (FSDP gathers, reduce-scatters)
    pp_bubble_s: float  # pipeline bubble: stage time idle while the pipeline fills and drains
    pp_comm_s: float  # pipeline send/receive of activations and their gradients
    optimizer_s: float  # the optimizer step
    offload_s: float  # CPU offload: host-device copies and the CPU optimizer

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


def _matmul_rate(topology: Topology, plan: Plan, profile: ModelProfile, cal: "Calibration") -> float:
    """Achieved matmul FLOP/s: peak x efficiency; bf16 GEMMs lose efficiency as they get narrow
    (eff x h / (h + h_half), h the hidden size over sqrt(tp): TP narrows the GEMMs)."""
    if plan.precision == "bf16":
        h = (profile.hidden_dim or 4096) / plan.tp ** 0.5
        return topology.device.peak_flops("bf16") * cal.matmul_efficiency * h / (h + cal.matmul_half_width)
    return topology.device.peak_flops("fp32") * cal.fp32_matmul_efficiency


def _collective_s(bytes_: float, n: int, bandwidth: float, cal: "Calibration", kind: str) -> float:
    if n <= 1 or bytes_ <= 0:
        return 0.0
    traffic = (2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n) * bytes_
    return cal.comm_latency_s + traffic / (bandwidth * cal.comm_efficiency)


def _group_bandwidth(topology: Topology, size: int, stride: int) -> float:
    """Per-GPU bandwidth of a group of `size` ranks `stride` apart in rank order: the network if the group
    spans nodes, else the link inside a node."""
    if size <= 1:
        return float("inf")
    if topology.num_nodes > 1 and size * stride > topology.devices_per_node:
        return min(topology.inter_node_bytes_per_s, topology.device.intra_node_bytes_per_s)
    return topology.device.intra_node_bytes_per_s


def time_terms(profile: ModelProfile, plan: Plan, topology: Topology, cal: "Calibration", *,
               variants: Mapping[str, ModelProfile] | None = None) -> tuple[TimePrediction, TimeTerms]:
    """The step time of `plan` (and the terms a calibration fit scales)."""
    blocks, first, last = stage_blocks(profile, plan)
    tp, n_micro = plan.tp, plan.grad_accum
    samples = plan.micro_batch_size * n_micro  # this data-parallel rank's samples per step
    scale = samples / profile.sample_batch_size
    prof, _ = activation_profile(profile, plan, cal, variants)
    traffic_scale = 0.5 if plan.precision == "bf16" and prof.profile_precision == "fp32" else 1.0

    # FLOPs on this rank: the stage's blocks split by TP, and its share of the rest (embeddings: none; head).
    block_flops = sum(profile.blocks[i].flops for i in blocks)
    head_flops = max(profile.flops - sum(b.flops for b in profile.blocks), 0.0) if last else 0.0
    flops = (block_flops / tp + head_flops / tp) * scale
    compute = flops / _matmul_rate(topology, plan, profile, cal)

    # Memory-bound work: the traced bytes of non-matmul ops, for this stage's share, mostly split by TP.
    stage_share = (sum(profile.blocks[i].flops for i in blocks) + head_flops) / max(profile.flops, 1.0)
    hbm = topology.device.hbm_bytes_per_s * cal.memory_efficiency
    factor = cal.compile_traffic_factor if plan.compile else cal.eager_traffic_factor
    traffic = prof.traffic_bytes * traffic_scale * scale * stage_share * factor
    traffic /= tp if plan.sequence_parallel else (1 + (tp - 1) * 0.7) if tp > 1 else 1  # norms not split without SP
    memory = traffic / hbm

    # Launches: each micro-batch launches the traced ops (fewer when compiled); GPU work hides them unless
    # the kernels are shorter than their launch.
    ops = prof.num_ops * stage_share * n_micro
    launch_total = ops * cal.launch_s * (cal.compile_launch_factor if plan.compile else 1.0)
    launch = max(0.0, launch_total - (compute + memory))

    # Recompute: full checkpointing runs each checkpointed block's forward again (a third of its work);
    # selective only its memory-bound part.
    ckpt = sum(1 for k in range(len(blocks)) if k % plan.checkpoint_every == 0) / max(len(blocks), 1) \
        if plan.checkpointing != "none" else 0.0
    block_share = block_flops / max(block_flops + head_flops, 1.0)
    recompute_compute = ckpt * block_share * compute / 3 if plan.checkpointing == "full" else 0.0
    recompute_memory = ckpt * block_share * memory / 3 if plan.checkpointing != "none" else 0.0
    recompute = recompute_compute + recompute_memory

    # Tensor parallelism: per block and micro-batch, two all-reduces in forward and two in backward of the
    # hidden states (reduce-scatter + all-gather under SP, the same bytes); one more pair for the embedding.
    elem = 2 if plan.precision == "bf16" else 4
    hidden_bytes = profile.block_input_bytes / profile.sample_batch_size * plan.micro_batch_size * elem / 4 \
        if profile.block_input_bytes else 0.0
    tp_bw = _group_bandwidth(topology, tp, 1)
    tp_comm = n_micro * (4 * len(blocks) + 2) * _collective_s(hidden_bytes, tp, tp_bw, cal, "all_reduce")

    # Data parallelism (FSDP2): per micro-batch, gather the stage's weights in the compute dtype for forward
    # (and again for backward when resharding) and reduce-scatter fp32 gradients; replicas all-reduce the
    # sharded gradients once per step. Prefetching hides most of it behind compute.
    params = sum(profile.blocks[i].num_params - profile.blocks[i].matmul_params * (1 - 1 / tp) for i in blocks)
    params += (profile.num_params - sum(b.num_params for b in profile.blocks)) * (0.5 * first + 0.5 * last
                                                                                  if plan.pp > 1 else 1.0) / tp
    dp_comm = 0.0
    if plan.uses_fsdp and plan.dp_shard > 1:
        bw = _group_bandwidth(topology, plan.dp_shard, tp)
        gathers = 2 if plan.reshard_after_forward else 1
        per_micro = gathers * _collective_s(params * elem, plan.dp_shard, bw, cal, "all_gather") \
            + _collective_s(params * 4, plan.dp_shard, bw, cal, "reduce_scatter")
        total = n_micro * per_micro
        hidden_by = cal.fsdp_overlap * (compute + memory + recompute)
        dp_comm += max(total - hidden_by, total / max(len(blocks), 1))  # the first unit's gather never hides
    if plan.dp_replicate > 1:
        bw = _group_bandwidth(topology, plan.dp_replicate, plan.dp_shard * tp)
        dp_comm += _collective_s(params * 4 / plan.dp_shard, plan.dp_replicate, bw, cal, "all_reduce") \
            * (1 - cal.fsdp_overlap / 2)

    # Pipeline: the bubble is (p - 1) micro-batch stage-times over the m micro-batches (per chunk under
    # interleaving; a third of it for zero-bubble schedules), and each micro-batch crosses each boundary twice.
    stage_time = compute + memory + recompute + tp_comm
    pp_bubble = pp_comm = 0.0
    if plan.pp > 1:
        p, v = plan.pp, plan.pp_stages_per_rank
        bubble = (p - 1) / (n_micro * v) * stage_time
        if plan.pp_schedule == "zero_bubble":
            bubble *= cal.zero_bubble_factor
        pp_bubble = bubble
        bw = _group_bandwidth(topology, p, plan.dp_replicate * plan.dp_shard * tp)
        pp_comm = n_micro * 2 * v * (cal.comm_latency_s + hidden_bytes / (bw * cal.comm_efficiency))

    # Optimizer (fused AdamW reads and writes fp32 weights, gradients and both moments) on the shards.
    shard_params = params / plan.dp_shard
    optimizer = 0.0 if plan.cpu_offload else shard_params * cal.optimizer_bytes_per_param / hbm
    offload = 0.0
    if plan.cpu_offload:  # gradients to the host, weights back, and Adam on the CPU
        offload = shard_params * (4 + 4) / cal.pcie_bytes_per_s + shard_params * cal.optimizer_bytes_per_param \
            / cal.cpu_adam_bytes_per_s

    prediction = TimePrediction(compute_s=compute, memory_s=memory, launch_s=launch, recompute_s=recompute,
                                tp_comm_s=tp_comm, dp_comm_s=dp_comm, pp_bubble_s=pp_bubble, pp_comm_s=pp_comm,
                                optimizer_s=optimizer, offload_s=offload)
    fixed = tp_comm + dp_comm + pp_bubble + pp_comm + optimizer + offload
    terms = TimeTerms(matmul=compute + recompute_compute, memory=memory + recompute_memory,
                      launch=launch_total if launch > 0 else 0.0, fixed_s=fixed)
    return prediction, terms


def predict_time(profile: ModelProfile, plan: Plan, topology: Topology, cal: "Calibration", *,
                 variants: Mapping[str, ModelProfile] | None = None) -> TimePrediction:
    return time_terms(profile, plan, topology, cal, variants=variants)[0]


def model_flops_per_step(profile: ModelProfile, plan: Plan) -> float:
    """The step's model FLOPs for MFU: 6 N + 12 L h s per token (PaLM, appendix B; no recomputation),
    over the global batch; the profile's traced FLOPs where the shape facts are missing."""
    formula = profile.formula_flops()
    per_sample = (formula if formula is not None else profile.flops) / profile.sample_batch_size
    return per_sample * plan.global_batch_size
