"""Step time of a plan, in parts, from the model's profile, the hardware and the plan.

All times are seconds of one optimizer step on the slowest rank. The FLOPs, bytes and op counts come
from the profile's trace; rates from the topology (datasheets, or micro-benchmarks) times the
calibration's efficiencies. Communication uses the alpha-beta model (latency + bytes / bandwidth) with
ring algorithms' traffic: an all-reduce moves 2 (n-1)/n of the buffer per rank, an all-gather or a
reduce-scatter (n-1)/n (Thakur et al. 2005, as NCCL implements them), at the link's rate times NCCL's
efficiency (NVLink inside a node, the network across nodes).

Matmul time is per GEMM: each traced Linear layer runs a forward, an input-gradient and a weight-gradient
GEMM whose rate falls with a shallow reduction and a small output (`_gemm_fraction`), from factors fitted on
Hopper (the H200 anchors) and scaled to the GPU's architecture (`calibration.matmul_arch`: its best-GEMM
fraction of peak, its tensor FLOPs per clock per SM). Checked on paper against Megatron-LM's Table 1 on
A100s (tests/cost/test_paper.py, bench/megatron_table1.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Mapping

from ..layout import split_stages, stage_ids
from ..plans import Plan
from ..profile import ModelProfile
from ..topology import Topology
from .calibration import Calibration, matmul_arch
from .memory import activation_profile, stage_blocks

_FILL_REFERENCE_WIDTH = 2048  # GEMM width at which Calibration.matmul_rows_half is stated (the Llama-1B anchors)


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


def _gemm_fraction(depth: float, out: float, eff: float, half: float, out_half: float) -> float:
    """Fraction of the datasheet peak one bf16 GEMM reaches: eff x depth / (depth + half) x out / (out + out_half).
    depth: the reduction dimension; every output tile pays fixed costs (loading the first operands, the
    epilogue) that the reduction amortises. out: output elements; too few output tiles leave SMs idle in the
    last wave (NVIDIA Deep Learning Performance Guide, "Matrix multiplication background": tile and wave
    quantization)."""
    return eff * depth / (depth + half) * out / (out + out_half)


def _linear_split(calls: tuple, hidden: int, tp: int) -> list[tuple[float, float]]:
    """(in, out) features of each Linear call on one TP rank: column-parallel layers (a group reading the
    hidden states) split `out`, the row-parallel layer after them (back to hidden) splits `in`, as
    autopar.strategies.tensor_parallel pairs them; other layers stay whole."""
    out: list[tuple[float, float]] = []
    group_input = None
    for c in calls:
        if group_input is not None and c.out_features == hidden and c.input_id != group_input:
            out.append((c.in_features / tp, c.out_features))  # row-parallel
            group_input = None
        elif c.in_features == hidden and (group_input is None or c.input_id == group_input):
            out.append((c.in_features, c.out_features / tp))  # column-parallel
            group_input = c.input_id
        else:
            out.append((c.in_features, c.out_features))
            group_input = None
    return out


def _compute_s(topology: Topology, plan: Plan, profile: ModelProfile, cal: Calibration, block_flops: float,
               head_flops: float) -> tuple[float, float]:
    """Seconds of this rank's matmul and attention FLOPs: (the blocks', the rest's: the head).

    bf16: datasheet peak x matmul_efficiency x the architecture's best-GEMM fraction (`matmul_arch`), per GEMM
    less the depth and fill losses of `_gemm_fraction`. Every Linear call the trace recorded runs three GEMMs
    of equal FLOPs (forward: depth `in`; input gradient: depth `out`; weight gradient: depth = the micro-batch's
    tokens), `in`/`out` split by TP (`_linear_split`; the head over its vocabulary when TP divides it). A block's
    FLOPs outside its Linear layers (attention's scores and values) run at depth = the sequence (flash
    attention loops over the keys), output tokens x hidden / tp. Without traced calls every GEMM is taken as
    hidden/sqrt(tp) deep and wide. fp32 (no tensor cores): peak x fp32_matmul_efficiency x the fill loss."""
    arch = matmul_arch(topology.device)
    tp = plan.tp
    seq = profile.tokens_per_sample or 1
    rows = plan.micro_batch_size * seq  # tokens of one micro-batch: the GEMMs' M
    hidden = profile.hidden_dim or 4096
    width = hidden / tp ** 0.5
    out_half = cal.matmul_rows_half * _FILL_REFERENCE_WIDTH  # output elements at which the fill loss halves
    if plan.precision != "bf16":
        fill = rows * width / (rows * width + out_half)
        rate = topology.device.peak_flops("fp32") * cal.fp32_matmul_efficiency * fill
        return block_flops / rate, head_flops / rate
    peak = topology.device.peak_flops("bf16")
    eff = cal.matmul_efficiency * arch.efficiency_ratio
    half = cal.matmul_half_width * arch.half_width_ratio

    def fraction(shapes: list[tuple[float, float]]) -> float:
        """FLOP-weighted fraction of peak of these layers' forward, input-gradient and weight-gradient GEMMs.
        Eager, a layer with a dimension that is not a multiple of 8 elements (16 bytes of bf16; e.g. GPT-2's
        vocabulary of 50257) runs cuBLAS's unaligned kernels at `misaligned_gemm_factor` of the rate;
        compiled, inductor pads such dimensions (torch._inductor.config.shape_padding)."""
        flops = seconds = 0.0
        for k_in, k_out in shapes:
            f = 2 * k_in * k_out  # FLOPs per token of each of the three GEMMs
            flops += 3 * f
            slow = 1.0 if plan.compile or (k_in % 8 == 0 and k_out % 8 == 0) else cal.misaligned_gemm_factor
            seconds += (f / _gemm_fraction(k_in, rows * k_out, eff, half, out_half)
                        + f / _gemm_fraction(k_out, rows * k_in, eff, half, out_half)
                        + f / _gemm_fraction(rows, k_in * k_out, eff, half, out_half)) / slow
        return flops / seconds

    first = profile.blocks[0].name + "." if profile.blocks else "\0"
    container = profile.blocks_path + "." if profile.blocks_path else None
    inside = [c for c in profile.matmul_calls if c.name.startswith(first)]
    outside = [c for c in profile.matmul_calls if not (c.name.startswith(container) if container else
                                                        any(c.name.startswith(b.name + ".") for b in profile.blocks))]
    if not inside:
        whole = _gemm_fraction(width, rows * width, eff, half, out_half)
        return block_flops / (peak * whole), head_flops / (peak * whole)
    # One block on this rank, per token of the sample: its Linear layers, and the rest of its FLOPs (attention).
    shapes = _linear_split(inside, hidden, tp)
    linear = sum(6 * k_in * k_out for k_in, k_out in shapes)
    block = profile.blocks[0].flops / profile.sample_batch_size / seq / tp
    attention = _gemm_fraction(seq, rows * hidden / tp, eff, half, out_half) * cal.attention_efficiency
    block_fraction = block / (linear / fraction(shapes) + max(block - linear, 0.0) / attention) if block else 1.0
    # The rest (the head), split over the vocabulary by TP when it divides (vocab-parallel), else whole.
    split = tp > 1 and profile.vocab_size is not None and profile.vocab_size % tp == 0
    head = [(c.in_features, c.out_features / tp if split and c.out_features == profile.vocab_size else c.out_features)
            for c in outside]
    head_fraction = fraction(head) if head else _gemm_fraction(width, rows * width, eff, half, out_half)
    return block_flops / (peak * block_fraction), head_flops / (peak * head_fraction)


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


def _group_bandwidth(topology: Topology, size: int, stride: int, cal: Calibration) -> float:
    """Achieved bus bandwidth per GPU (bytes/s) of a group of `size` ranks `stride` apart in rank order: the
    network's (x network_efficiency) if the group spans nodes, else the link's inside a node (x comm_efficiency)."""
    if size <= 1:
        return float("inf")
    if topology.num_nodes > 1 and size * stride > topology.devices_per_node:
        if topology.inter_node_bytes_per_s < topology.device.intra_node_bytes_per_s:
            return topology.inter_node_bytes_per_s * cal.network_efficiency
    return topology.device.intra_node_bytes_per_s * cal.comm_efficiency


def time_terms(profile: ModelProfile, plan: Plan, topology: Topology, cal: Calibration, *,
               variants: Mapping[str, ModelProfile] | None = None) -> tuple[TimePrediction, TimeTerms]:
    """The step time of `plan` on its slowest rank, and the terms a calibration fit scales. Of a pipeline:
    the first stage's rank (embeddings), the last's (head, loss) and the one with the most block FLOPs
    (an uneven split, e.g. 105 blocks over 70 stages, makes a middle rank the slowest)."""
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

    # Compute: the stage's blocks' FLOPs and, on the last stage, the rest's (the head; embeddings are lookups),
    # split by TP; seconds; FLOPs from the trace, rates from _compute_s.
    block_flops = sum(profile.blocks[i].flops for i in blocks)
    head_flops = max(profile.flops - sum(b.flops for b in profile.blocks), 0.0) if last else 0.0
    compute_blocks, compute_head = _compute_s(topology, plan, profile, cal, block_flops / tp * scale,
                                              head_flops / tp * scale)
    compute = compute_blocks + compute_head

    # Memory-bound: the traced bytes of non-matmul ops (this stage's share; inductor fuses most away) over the
    # achieved HBM bandwidth; seconds; trace x anchor-fitted efficiency. TP splits them, but without SP not
    # the norms and residuals (about 30%: Korthikanti et al.'s 10 of 34 s b h).
    stage_share = (block_flops + head_flops) / max(profile.flops, 1.0)
    hbm = topology.device.hbm_bytes_per_s * cal.memory_efficiency
    factor = cal.compile_traffic_factor if plan.compile else cal.eager_traffic_factor
    # Weight-shaped traffic (gradient casts, accumulation) is paid per micro-batch, the rest per sample.
    per_micro = (prof.traffic_bytes - prof.weight_traffic_bytes) * plan.micro_batch_size / profile.sample_batch_size \
        + prof.weight_traffic_bytes
    traffic = per_micro * n_micro * traffic_scale * stage_share * factor
    traffic /= tp if plan.sequence_parallel else (1 + (tp - 1) * 0.7) if tp > 1 else 1
    memory = traffic / hbm

    # Launches: CPU time launching the traced ops of every micro-batch (fewer when compiled) beyond the GPU
    # work that hides it; seconds; launch_s (PyTorch eager on x86).
    ops = prof.num_ops * stage_share * n_micro
    launch_total = ops * cal.launch_s * (cal.compile_launch_factor if plan.compile else 1.0)
    launch = max(0.0, launch_total - (compute + memory))

    # Recompute: full checkpointing runs each checkpointed block's forward again, a third of its forward +
    # backward FLOPs (Megatron's 4 x 24 in 96 B s l h^2) at the same GEMM rates, and a third of its memory-bound
    # work; selective checkpointing only the memory-bound third; seconds. Its TP all-reduces are in tp_comm.
    ckpt = sum(1 for k in range(len(blocks)) if k % plan.checkpoint_every == 0) / max(len(blocks), 1) \
        if plan.checkpointing != "none" else 0.0
    block_share = block_flops / max(block_flops + head_flops, 1.0)
    recompute_compute = ckpt * compute_blocks / 3 if plan.checkpointing == "full" else 0.0
    recompute_memory = ckpt * block_share * memory / 3 if plan.checkpointing != "none" else 0.0
    recompute = recompute_compute + recompute_memory

    # Tensor parallelism: per block and micro-batch, ring all-reduces of the hidden states (reduce-scatter +
    # all-gather under SP: the same bytes), two in forward and two in backward (Shoeybi et al. 2019), two more
    # when full checkpointing reruns the forward, and a pair for the embedding; not overlapped; seconds.
    elem = 2 if plan.precision == "bf16" else 4
    hidden_numel = _prod(profile.block_input_shape) / profile.sample_batch_size if profile.block_input_shape else 0.0
    hidden_bytes = hidden_numel * plan.micro_batch_size * elem  # one micro-batch's hidden states; bytes
    tp_bw = _group_bandwidth(topology, tp, 1, cal)
    recomputed = ckpt * len(blocks) if plan.checkpointing == "full" else 0.0  # blocks whose forward runs twice
    tp_collectives = 4 * len(blocks) + 2 + 2 * recomputed  # per micro-batch; count
    tp_comm = n_micro * tp_collectives * _collective_s(hidden_bytes, tp, tp_bw, cal, "all_reduce")

    # Data parallelism: FSDP2 gathers the stage's weights in the compute dtype for each micro-batch's forward
    # (and backward when resharding) and reduce-scatters fp32 gradients, prefetching hides most of it;
    # replicas all-reduce the sharded fp32 gradients once a step, about half hidden; seconds (ZeRO, FSDP2).
    params = sum(profile.blocks[i].num_params - profile.blocks[i].matmul_params * (1 - 1 / tp) for i in blocks)
    params += (profile.num_params - sum(b.num_params for b in profile.blocks)) * (0.5 * first + 0.5 * last
                                                                                  if plan.pp > 1 else 1.0) / tp
    dp_comm = 0.0
    if plan.uses_fsdp and plan.dp_shard > 1:
        bw = _group_bandwidth(topology, plan.dp_shard, tp, cal)
        gathers = 2 if plan.reshard_after_forward else 1
        per_micro = gathers * _collective_s(params * elem, plan.dp_shard, bw, cal, "all_gather") \
            + _collective_s(params * 4, plan.dp_shard, bw, cal, "reduce_scatter")
        total = n_micro * per_micro
        hidden_by = cal.fsdp_overlap * (compute + memory + recompute)
        dp_comm += max(total - hidden_by, total / max(len(blocks), 1))  # the first unit's gather never hides
    if plan.dp_replicate > 1:
        bw = _group_bandwidth(topology, plan.dp_replicate, plan.dp_shard * tp, cal)
        dp_comm += _collective_s(params * 4 / plan.dp_shard, plan.dp_replicate, bw, cal, "all_reduce") \
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
        bw = _group_bandwidth(topology, p, plan.dp_replicate * plan.dp_shard * tp, cal)
        pp_comm = n_micro * 2 * v * (cal.comm_latency_s + hidden_bytes / bw)

    # Optimizer: fused AdamW reads and writes fp32 weights, gradients and both moments of the shards over the
    # achieved HBM bandwidth; seconds.
    shard_params = params / plan.dp_shard
    optimizer = 0.0 if plan.cpu_offload else shard_params * cal.optimizer_bytes_per_param / hbm
    # Overhead: fixed costs per micro-batch and stage chunk (graph launches, hooks, the loss); seconds.
    overhead = n_micro * plan.pp_stages_per_rank * cal.microbatch_overhead_s
    # Offload: gradients to the host, weights back over PCIe, and Adam on the CPU; seconds.
    offload = 0.0
    if plan.cpu_offload:
        offload = shard_params * (4 + 4) / cal.pcie_bytes_per_s + shard_params * cal.optimizer_bytes_per_param \
            / cal.cpu_adam_bytes_per_s

    prediction = TimePrediction(compute_s=compute, memory_s=memory, launch_s=launch, recompute_s=recompute,
                                tp_comm_s=tp_comm, dp_comm_s=dp_comm, pp_bubble_s=pp_bubble, pp_comm_s=pp_comm,
                                optimizer_s=optimizer, offload_s=offload, overhead_s=overhead)
    fixed = tp_comm + dp_comm + pp_bubble + pp_comm + optimizer + offload + overhead
    terms = TimeTerms(matmul=compute + recompute_compute, memory=memory + recompute_memory,
                      launch=launch_total if launch > 0 else 0.0, fixed_s=fixed)
    return prediction, terms


def model_flops_per_step(profile: ModelProfile, plan: Plan) -> float:
    """The step's model FLOPs for MFU: 6 N + 12 L h s per token (PaLM, appendix B; no recomputation),
    over the global batch; the profile's traced FLOPs where the shape facts are missing."""
    formula = profile.formula_flops()
    per_sample = (formula if formula is not None else profile.flops) / profile.sample_batch_size
    return per_sample * plan.global_batch_size
