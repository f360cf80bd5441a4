"""The plan for a model whose step could not be traced on fake tensors, and the warning that says why.

`wrap` applies it, and `autopar.plan` returns it: pure data parallelism, no checkpointing, no compile, bf16 where
the GPUs have it; it has no prediction.
"""

from __future__ import annotations

from .errors import PlanError, TraceError
from .plans import Plan
from .profile import ModelProfile
from .topology import Topology


def safe_plan(profile: ModelProfile, topology: Topology, *, world_size: int, global_batch_size: int) -> Plan:
    """The plan for a model the cost model cannot plan (not traced): pure data parallelism (FSDP2 over every
    process when there are several), no checkpointing, no compile, bf16 where the GPUs have it, else fp32."""
    if global_batch_size % world_size:
        raise PlanError(f"the global batch of {global_batch_size} samples does not split over {world_size} "
                        f"data-parallel ranks: use a global batch divisible by {world_size}.")
    bf16 = topology.is_gpu and topology.device.supports("bf16")
    return Plan(dp_shard=world_size, micro_batch_size=global_batch_size // world_size,
                precision="bf16" if bf16 else "fp32", compile=False, model_fingerprint=profile.fingerprint,
                topology_fingerprint=topology.fingerprint())


def untraced_message(profile: ModelProfile, safe: Plan, exc: TraceError) -> str:
    """Why a model got a safe plan, what the plan is and what that costs: said once, on rank 0."""
    cause = exc.__cause__
    why = str(exc) if cause is None else f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
    parallel = f"FSDP2 over {safe.dp_shard} processes" if safe.dp_shard > 1 else "one process"
    precision = "fp32" if safe.precision != "bf16" else (
        "bf16 (FSDP2's mixed precision)" if safe.uses_fsdp else "bf16 autocast")
    return (f"one training step of {profile.model_class} could not be traced on fake tensors "
            f"({why}), so the cost model could not choose a plan. Applying a safe "
            f"plan from the model's structure instead: {parallel}, micro-batch {safe.micro_batch_size}, "
            f"{precision}, no checkpointing, no compile. It has no prediction (memory and speed were not "
            "estimated): it may run slower than a chosen plan, or out of memory where a chosen one would "
            "checkpoint or shard further. To have a plan chosen, make the step traceable (" + _trace_hint(why)
            + "), or pass wrap a plan (autopar.Plan or a YAML file).")


def _trace_hint(why: str) -> str:
    """What to change for the trace to run, by its failure."""
    if "FakeTensor" in why:  # a real tensor met the fake ones: from outside the sample and the model's state
        return ("the step used a real tensor that is neither in the sample nor a parameter or buffer of the "
                "model: a loss_fn that captures its targets, or a tensor the model keeps as a plain attribute; "
                "take the targets from the sample in loss_fn(output, sample), and register the model's tensors "
                "as buffers")
    return "a forward that reads tensor values, such as `if labels.max() >= vocab`, cannot be traced"
