"""What `Topology.detect` reads from this machine: nodes and processes per node from torchrun's environment,
and, with CUDA, the node's GPUs as one DeviceSpec (the table's figures for a known GPU, measured ones for
another) with the link inside the node that NVML found."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch

from .._util.env import LOCAL_RANK, LOCAL_WORLD_SIZE, WORLD_SIZE, env_int, env_positive_int
from ..errors import EnvironmentVariableError, TopologyError
from .device import DeviceSpec
from .gpus import _TABLE
from .microbench import _measure_device
from .nvml import _DEFAULT_PCIE_BYTES_PER_S, GpuFacts, _gpu_facts
from .spec import lookup_device

# Warnings point at the caller of Topology.detect: warn <- helper here <- detect_gpus <- Topology.detect.
_CALLER_OF_DETECT = 4


# ---- the torchrun environment ---------------------------------------------------------------------
def _torchrun_count(name: str) -> int | None:
    """torchrun's `name` (a process count) as a positive integer, None where unset; TopologyError otherwise."""
    try:
        return env_positive_int(name)
    except EnvironmentVariableError as exc:
        raise TopologyError(str(exc)) from None


def _world_from_env() -> tuple[int | None, int | None]:
    """(WORLD_SIZE, LOCAL_WORLD_SIZE) from the environment torchrun sets; None where unset."""
    world, local = _torchrun_count(WORLD_SIZE), _torchrun_count(LOCAL_WORLD_SIZE)
    if world is not None and local is not None and world % local:
        raise _uneven_nodes(world, local)
    if world is None and local is not None:
        world = local
    return world, local


def _uneven_nodes(world: int, local: int) -> TopologyError:
    return TopologyError(
        f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}: autopar plans for nodes with "
        "the same number of processes each. Launch the same number of processes on every node."
    )


def _local_device_index(visible: int) -> int:
    """This process's GPU: LOCAL_RANK, or 0 where it is unset, not a non-negative integer or not visible."""
    try:
        local_rank = env_int(LOCAL_RANK, 0, minimum=0)
    except EnvironmentVariableError:
        local_rank = 0  # it only picks the GPU to measure: a bad LOCAL_RANK measures the first
    return local_rank if local_rank < visible else 0


# ---- the node's GPUs ------------------------------------------------------------------------------
@dataclass(frozen=True)
class DetectedGpus:
    """The job's GPUs as detected: `num_nodes` nodes of `devices_per_node` GPUs like `device`."""

    num_nodes: int
    devices_per_node: int
    device: DeviceSpec
    nvlink_pairs: tuple[tuple[int, int], ...] | None  # None: unknown (NVML could not be asked)


def detect_gpus(world: int | None, local: int | None) -> DetectedGpus:
    """This job's GPUs, with CUDA available; `world` and `local` are torchrun's WORLD_SIZE and
    LOCAL_WORLD_SIZE (None where unset: one node with every visible GPU)."""
    visible = torch.cuda.device_count()
    if visible < 1:
        raise TopologyError(
            "torch.cuda.is_available() is True but no CUDA device is visible; check CUDA_VISIBLE_DEVICES."
        )
    if local is None:
        local = visible if world is None else min(world, visible)
    world = world if world is not None else local
    if world % local:
        raise _uneven_nodes(world, local)
    facts = _gpu_facts(local)
    if len(facts.names) > 1:
        _warn_mixed(facts.names)
    known = lookup_device(facts.name)
    device = _table_device(known, facts) if known is not None else _measured_device(facts, visible)
    return DetectedGpus(
        num_nodes=world // local,
        devices_per_node=local,
        device=_with_node_link(device, facts, local),
        nvlink_pairs=facts.nvlink_pairs,
    )


def _warn_mixed(names: tuple[str, ...]) -> None:
    warnings.warn(
        f"this node has different GPUs ({', '.join(names)}); autopar plans for identical GPUs and uses the "
        "one with the least memory. Restrict CUDA_VISIBLE_DEVICES to one kind for better plans.",
        stacklevel=_CALLER_OF_DETECT,
    )


def _table_device(known: DeviceSpec, facts: GpuFacts) -> DeviceSpec:
    """The table's figures for a known GPU, with the memory (and compute capability) the GPU reports."""
    device = dataclasses.replace(known, memory_bytes=facts.memory_bytes,
                                 source=f"{known.source}; memory from {facts.via}")
    if facts.compute_capability != known.compute_capability:
        warnings.warn(
            f"GPU {facts.name!r} reports compute capability {facts.compute_capability} but the "
            f"table has {known.compute_capability} for {known.name}; using the reported one.",
            stacklevel=_CALLER_OF_DETECT,
        )
        device = dataclasses.replace(device, compute_capability=facts.compute_capability)
    return device


def _measured_device(facts: GpuFacts, visible: int) -> DeviceSpec:
    """A GPU that is not in the table: its rates measured on this process's GPU (a few seconds, a warning)."""
    warnings.warn(
        f"GPU {facts.name!r} is not in autopar's table of known GPUs "
        f"({', '.join(_TABLE)}): its matmul rates and memory bandwidth are measured now "
        "(a few seconds; no fp8 rate), and the planner's estimates are only as good as that "
        "measurement. To skip it, plan with Topology.from_spec('<N>x<known GPU>').",
        stacklevel=_CALLER_OF_DETECT,
    )
    index = _local_device_index(visible)
    measured = _measure_device(index)
    return DeviceSpec(
        name=facts.name,
        memory_bytes=facts.memory_bytes,
        compute_capability=facts.compute_capability,
        bf16_flops=measured["bf16_flops"],
        fp8_flops=None,
        fp32_flops=measured["fp32_flops"],
        tf32_flops=measured.get("tf32_flops"),
        hbm_bytes_per_s=measured["hbm_bytes_per_s"],
        intra_node_link="pcie",
        intra_node_bytes_per_s=facts.pcie_bytes_per_s or _DEFAULT_PCIE_BYTES_PER_S,
        source=f"measured on cuda:{index}; memory from {facts.via}",
    )


def _with_node_link(device: DeviceSpec, facts: GpuFacts, local: int) -> DeviceSpec:
    """The link inside the node: what was detected wins over the table, when anything was."""
    if local == 1 or facts.nvlink_pairs is None:
        return device
    if facts.nvlink_complete:
        link, bandwidth = "nvlink", facts.nvlink_bytes_per_s
    else:
        link = "pcie"
        bandwidth = facts.pcie_bytes_per_s or (
            device.intra_node_bytes_per_s if device.intra_node_link == "pcie" else _DEFAULT_PCIE_BYTES_PER_S
        )
    return dataclasses.replace(device, intra_node_link=link, intra_node_bytes_per_s=bandwidth)
