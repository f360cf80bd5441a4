"""Choosing a plan.

This version chooses by a simple, documented rule (`rule_plan`); the cost model and search that rank
every candidate by predicted step time replace it in a later version. The rule:

1. Data parallel over every process, keeping the global batch: micro-batch = global batch / processes,
   no accumulation (so the user's plain loop keeps working). One node: FSDP2 over all its GPUs
   (dp_shard = world). Several nodes: HSDP, sharded within a node and replicated across nodes
   (dp_shard = GPUs per node, dp_replicate = nodes), so the per-step all-gathers stay on NVLink.
2. Precision: bf16 on a GPU that has it (fp32 master weights and optimizer state), fp32 elsewhere.
3. torch.compile on GPUs (Triton available), off on CPU (compiling costs more than a short CPU run saves).
4. Memory: model states take 16 bytes per parameter (fp32 weights, gradients, Adam's two moments;
   ZeRO, Rajbhandari et al. 2020), divided by the shard degree; activations are the profile's bytes
   saved for backward, scaled to the micro-batch (halved for bf16 if the profile ran in fp32). If the
   sum exceeds 85% of a GPU's memory, checkpoint every block fully (activations fall to about 1/17:
   Korthikanti et al. 2022, 2sbh against 34sbh per layer); if that still does not fit, offload
   parameters and optimizer state to CPU; if even that does not fit, raise InfeasiblePlanError.
"""

from __future__ import annotations

import importlib.util

from .errors import InfeasiblePlanError, PlanError
from .plans import Plan
from .profile import ModelProfile
from .topology import Topology

# Fraction of a GPU's memory the rule plans to use; the rest is the CUDA context, the allocator's
# fragmentation and transient buffers (source: the 2-3.4 GiB reserved-over-allocated gap measured on
# one H200, ../shared/anchors/published.md).
MEMORY_BUDGET_FRACTION = 0.85
# Bytes of model state per parameter with fp32 master weights and Adam (ZeRO paper, K = 12 + 4 grad).
STATE_BYTES_PER_PARAM = 16
# Full recomputation keeps 2sbh of the 34sbh bytes a layer saves (Korthikanti et al. 2022).
FULL_RECOMPUTE_FRACTION = 2 / 34


def _split_batch(global_batch_size: int, dp: int) -> int:
    if global_batch_size % dp:
        raise PlanError(
            f"the global batch of {global_batch_size} samples does not split over {dp} data-parallel ranks: use "
            f"a global batch divisible by {dp} (e.g. {max(dp, global_batch_size - global_batch_size % dp)}), "
            f"or pass a plan with fewer data-parallel ranks."
        )
    return global_batch_size // dp


def estimate_memory_bytes(profile: ModelProfile, *, micro_batch_size: int, shard: int, precision: str,
                          checkpointing: str, cpu_offload: bool) -> float:
    """The rule's rough per-GPU memory (model states + saved activations); the cost model replaces it."""
    states = 0.0 if cpu_offload else profile.num_params * STATE_BYTES_PER_PARAM / shard
    scale = micro_batch_size / profile.sample_batch_size
    if precision == "bf16" and profile.profile_precision == "fp32":
        scale /= 2
    if checkpointing == "full":
        biggest = max((b.saved_bytes for b in profile.blocks), default=0)
        blocks = sum(b.saved_bytes for b in profile.blocks) * FULL_RECOMPUTE_FRACTION + biggest
        acts = (blocks + profile.saved_bytes_outside_blocks) * scale
    else:
        acts = profile.saved_bytes * scale
    return states + acts + profile.largest_transient_bytes * scale


def rule_plan(profile: ModelProfile, topology: Topology, *, world_size: int, global_batch_size: int) -> Plan:
    """The plan chosen by the rule in this module's docstring."""
    if not profile.traced:
        raise PlanError("choosing a plan needs a traced profile (FLOPs and activation bytes); pass a plan instead.")
    if topology.world_size != world_size and topology.is_gpu:
        # A detected topology describes this job; a spec for other hardware must match the world asked for.
        raise PlanError(
            f"the topology has {topology.world_size} GPUs but the job has {world_size} processes: "
            "give a topology for this job (Topology.detect() under torchrun, or a spec with that many GPUs)."
        )
    if world_size == 1:
        dp_replicate, dp_shard = 1, 1
    elif topology.num_nodes > 1 and world_size % topology.num_nodes == 0:
        dp_replicate, dp_shard = topology.num_nodes, world_size // topology.num_nodes
    else:
        dp_replicate, dp_shard = 1, world_size
    micro_batch = _split_batch(global_batch_size, dp_replicate * dp_shard)
    precision = "bf16" if topology.is_gpu and topology.device.supports("bf16") else "fp32"
    # Compile on GPUs; when planning for the GPUs here, only if Triton (inductor's GPU backend) is installed.
    compile_ = topology.is_gpu and (topology.source != "detected" or importlib.util.find_spec("triton") is not None)

    budget = MEMORY_BUDGET_FRACTION * topology.device.memory_bytes
    options = [("none", False), ("full", False)] + ([("full", True)] if topology.is_gpu else [])
    for checkpointing, offload in options:
        need = estimate_memory_bytes(profile, micro_batch_size=micro_batch, shard=dp_shard, precision=precision,
                                     checkpointing=checkpointing, cpu_offload=offload)
        if need <= budget:
            break
    else:
        raise InfeasiblePlanError(
            f"{profile.model_class} with a micro-batch of {micro_batch} needs about {need / 2**30:.1f} GiB per "
            f"device even with full checkpointing and CPU offload, more than {budget / 2**30:.1f} GiB: use more "
            "devices, a smaller batch, or a shorter sequence."
        )
    return Plan(
        dp_replicate=dp_replicate, dp_shard=dp_shard, micro_batch_size=micro_batch, grad_accum=1,
        checkpointing=checkpointing, cpu_offload=offload, precision=precision, compile=compile_,
        model_fingerprint=profile.fingerprint, topology_fingerprint=topology.fingerprint(),
        prediction={"memory_bytes": float(need)},
    )
