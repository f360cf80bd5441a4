"""The Topology: what the planner knows about the hardware, as one frozen value.

A Topology says how many nodes and GPUs per node a job has, what each GPU is (memory, compute capability,
peak matmul rate per dtype, memory bandwidth) and how fast the links between them are (NVLink or PCIe inside
a node, the network across nodes). Clusters are homogeneous: one `DeviceSpec` describes every GPU.

Three ways to make one:
  Topology.detect()                 the hardware this process runs on (NVML, torch, the torchrun environment)
  Topology.from_spec("2x8xH100")    hardware described by a string, for planning away from the cluster
  Topology.cpu(4)                   CPU processes (gloo), with rough nominal figures

Rates come from a table of datasheet figures (`lookup_device`); a GPU that is not in the table has its
rates measured when it is detected (`_measure_device`), with a warning.

Units are in the field names: bytes, FLOP/s, bytes/s. Bandwidths are one direction, per GPU. Rates are
dense (no 2:4 sparsity) peaks; what a model reaches is a fraction of them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import time
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .errors import TopologyError

_LINK_KINDS = ("nvlink", "pcie", "shm")
_DEVICE_TYPES = ("cuda", "cpu")
_TOPOLOGY_SOURCES = ("spec", "detected", "cpu")
_PRECISIONS = ("fp32", "tf32", "bf16", "fp8")

#: Default network bandwidth per GPU across nodes: one 400 Gb/s InfiniBand NDR NIC per GPU (as in DGX H100),
#: nominal line rate. NCCL maintainers report 46-48 GB/s measured per NDR NIC (docs/topology.md).
_DEFAULT_INTER_NODE_GBPS = 400.0

_SPEC_FORMAT = (
    "'GPU' (1 node x 1 GPU), 'NxGPU' (1 node x N GPUs) or 'MxNxGPU' (M nodes x N GPUs each), "
    "e.g. 'H200', '8xH100-SXM', '2x8xA100-80GB', '2x4xcpu'"
)


# ---- validation helpers ---------------------------------------------------------------------------
def _check_positive_int(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TopologyError(f"{owner}.{name} must be a positive integer, got {value!r}.")


def _positive_float(owner: str, name: str, value: Any, *, optional: bool = False) -> float | None:
    """`value` as a float, checked positive and finite (None allowed when `optional`)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        allowed = "a positive finite number" + (" or None" if optional else "")
        raise TopologyError(f"{owner}.{name} must be {allowed}, got {value!r}.")
    return float(value)


def _check_nonempty_str(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise TopologyError(f"{owner}.{name} must be a non-empty string, got {value!r}.")


# ---- one GPU --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or the CPU pseudo-device): memory, peak rates per dtype, memory and link bandwidth.

    Rates are dense peaks in FLOP/s: `bf16_flops` and `fp8_flops` on tensor cores, `tf32_flops` the
    tensor-core rate for fp32 matmuls when TF32 is allowed, `fp32_flops` the plain (non-tensor-core) rate.
    `intra_node_bytes_per_s` is one direction, per GPU, to the other GPUs of its node.
    """

    name: str
    memory_bytes: int
    compute_capability: tuple[int, int] | None
    bf16_flops: float
    fp8_flops: float | None
    fp32_flops: float
    tf32_flops: float | None
    hbm_bytes_per_s: float
    intra_node_link: str
    intra_node_bytes_per_s: float
    source: str

    def __post_init__(self) -> None:
        owner = "DeviceSpec"
        _check_nonempty_str(owner, "name", self.name)
        _check_positive_int(owner, "memory_bytes", self.memory_bytes)
        cc = self.compute_capability
        if cc is not None:
            if (
                not isinstance(cc, (tuple, list)) or len(cc) != 2
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in cc)
            ):
                raise TopologyError(
                    f"DeviceSpec.compute_capability must be (major, minor) as two non-negative integers, "
                    f"e.g. (9, 0), or None for a CPU; got {cc!r}."
                )
            object.__setattr__(self, "compute_capability", (cc[0], cc[1]))
        for name in ("bf16_flops", "fp32_flops", "hbm_bytes_per_s", "intra_node_bytes_per_s"):
            object.__setattr__(self, name, _positive_float(owner, name, getattr(self, name)))
        for name in ("fp8_flops", "tf32_flops"):
            object.__setattr__(self, name, _positive_float(owner, name, getattr(self, name), optional=True))
        if self.intra_node_link not in _LINK_KINDS:
            raise TopologyError(
                f"DeviceSpec.intra_node_link must be one of {', '.join(map(repr, _LINK_KINDS))}, "
                f"got {self.intra_node_link!r}."
            )
        _check_nonempty_str(owner, "source", self.source)

    def supports(self, precision: str) -> bool:
        """Whether matmuls in `precision` run natively here ('fp32', 'tf32', 'bf16' or 'fp8').

        fp32 always; bf16 from compute capability 8.0 (Ampere) and on CPUs; tf32 from 8.0 on GPUs that list
        a TF32 rate; fp8 from 8.9 (Ada, Hopper) on GPUs that list an fp8 rate.
        """
        _check_precision(precision)
        cc = self.compute_capability
        if precision == "fp32":
            return True
        if precision == "bf16":
            return cc is None or cc >= (8, 0)
        if precision == "tf32":
            return cc is not None and cc >= (8, 0) and self.tf32_flops is not None
        return cc is not None and cc >= (8, 9) and self.fp8_flops is not None  # fp8

    def peak_flops(self, precision: str) -> float:
        """Dense peak matmul FLOP/s in `precision`; TopologyError if this device does not support it."""
        if not self.supports(precision):
            cc = "CPU" if self.compute_capability is None else "compute capability %d.%d" % self.compute_capability
            usable = [p for p in _PRECISIONS if self.supports(p)]
            raise TopologyError(
                f"{self.name} ({cc}) has no {precision} tensor cores; use one of {', '.join(usable)}."
            )
        rate = {"fp32": self.fp32_flops, "tf32": self.tf32_flops, "bf16": self.bf16_flops,
                "fp8": self.fp8_flops}[precision]
        assert rate is not None  # supports() checked it
        return rate

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        cc = self.compute_capability
        out["compute_capability"] = None if cc is None else [cc[0], cc[1]]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DeviceSpec":
        if not isinstance(data, Mapping):
            raise TopologyError(f"a device spec must be a mapping of field names to values, got {type(data).__name__}.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(map(str, data)) - known)
        missing = sorted(known - set(map(str, data)))
        if unknown or missing:
            raise TopologyError(
                "device spec fields do not match: "
                + "; ".join(filter(None, [
                    f"unknown {', '.join(unknown)}" if unknown else "",
                    f"missing {', '.join(missing)}" if missing else "",
                ]))
                + f". A device spec has exactly: {', '.join(sorted(known))}."
            )
        return cls(**dict(data))


def _check_precision(precision: str) -> None:
    if precision not in _PRECISIONS:
        raise TopologyError(f"unknown precision {precision!r}; choose one of {', '.join(_PRECISIONS)}.")


# ---- the table of known GPUs ----------------------------------------------------------------------
# Dense (no sparsity) datasheet peaks. Where a datasheet gives only the 2:4-sparse tensor-core figure,
# the dense figure is half of it. Memory sizes are the datasheets' decimal GB (10^9 bytes), a little
# under what the GPU has (NVIDIA's "80 GB" is 80 GiB less reserved space); detection replaces them with
# what NVML reports. Compute capabilities are from NVIDIA's CUDA GPUs list (developer.nvidia.com/cuda-gpus).
# Link bandwidths are one direction per GPU: NVLink figures are NVIDIA's bidirectional totals / 2;
# PCIe x16 is 32e9 (Gen4) or 64e9 (Gen5) nominal per direction.
_TABLE: dict[str, DeviceSpec] = {
    "A100-SXM-40GB": DeviceSpec(
        name="A100-SXM-40GB",
        # memory: 40 GB HBM2, bytes (NVIDIA A100 datasheet)
        memory_bytes=40_000_000_000,
        # compute capability 8.0 (CUDA GPUs list)
        compute_capability=(8, 0),
        # bf16 tensor core, FLOP/s dense: 312 TFLOP/s (NVIDIA A100 datasheet)
        bf16_flops=312e12,
        # fp8: none, Ampere has no fp8 tensor cores (NVIDIA A100 datasheet)
        fp8_flops=None,
        # fp32 non-tensor, FLOP/s: 19.5 TFLOP/s (NVIDIA A100 datasheet)
        fp32_flops=19.5e12,
        # tf32 tensor core, FLOP/s dense: 156 TFLOP/s (NVIDIA A100 datasheet)
        tf32_flops=156e12,
        # memory bandwidth, bytes/s: 1,555 GB/s (NVIDIA A100 datasheet, 40GB SXM)
        hbm_bytes_per_s=1555e9,
        intra_node_link="nvlink",
        # NVLink 3, bytes/s one direction: 600 GB/s bidirectional / 2 (NVIDIA A100 datasheet)
        intra_node_bytes_per_s=300e9,
        source="NVIDIA A100 datasheet",
    ),
    "A100-SXM-80GB": DeviceSpec(
        name="A100-SXM-80GB",
        # memory: 80 GB HBM2e, bytes (NVIDIA A100 datasheet)
        memory_bytes=80_000_000_000,
        # compute capability 8.0 (CUDA GPUs list)
        compute_capability=(8, 0),
        # bf16 tensor core, FLOP/s dense: 312 TFLOP/s (NVIDIA A100 datasheet)
        bf16_flops=312e12,
        # fp8: none, Ampere has no fp8 tensor cores (NVIDIA A100 datasheet)
        fp8_flops=None,
        # fp32 non-tensor, FLOP/s: 19.5 TFLOP/s (NVIDIA A100 datasheet)
        fp32_flops=19.5e12,
        # tf32 tensor core, FLOP/s dense: 156 TFLOP/s (NVIDIA A100 datasheet)
        tf32_flops=156e12,
        # memory bandwidth, bytes/s: 2,039 GB/s (NVIDIA A100 datasheet, 80GB SXM)
        hbm_bytes_per_s=2039e9,
        intra_node_link="nvlink",
        # NVLink 3, bytes/s one direction: 600 GB/s bidirectional / 2 (NVIDIA A100 datasheet)
        intra_node_bytes_per_s=300e9,
        source="NVIDIA A100 datasheet",
    ),
    "A100-PCIe-80GB": DeviceSpec(
        name="A100-PCIe-80GB",
        # memory: 80 GB HBM2e, bytes (NVIDIA A100 datasheet)
        memory_bytes=80_000_000_000,
        # compute capability 8.0 (CUDA GPUs list)
        compute_capability=(8, 0),
        # bf16 tensor core, FLOP/s dense: 312 TFLOP/s (NVIDIA A100 datasheet)
        bf16_flops=312e12,
        # fp8: none, Ampere has no fp8 tensor cores (NVIDIA A100 datasheet)
        fp8_flops=None,
        # fp32 non-tensor, FLOP/s: 19.5 TFLOP/s (NVIDIA A100 datasheet)
        fp32_flops=19.5e12,
        # tf32 tensor core, FLOP/s dense: 156 TFLOP/s (NVIDIA A100 datasheet)
        tf32_flops=156e12,
        # memory bandwidth, bytes/s: 1,935 GB/s (NVIDIA A100 datasheet, 80GB PCIe)
        hbm_bytes_per_s=1935e9,
        intra_node_link="pcie",
        # PCIe Gen4 x16, bytes/s one direction: 64 GB/s bidirectional / 2 (NVIDIA A100 datasheet);
        # an optional 2-GPU NVLink bridge (600 GB/s) is found by Topology.detect()
        intra_node_bytes_per_s=32e9,
        source="NVIDIA A100 datasheet",
    ),
    "H100-SXM": DeviceSpec(
        name="H100-SXM",
        # memory: 80 GB HBM3, bytes (NVIDIA H100 datasheet, SXM)
        memory_bytes=80_000_000_000,
        # compute capability 9.0 (CUDA GPUs list)
        compute_capability=(9, 0),
        # bf16 tensor core, FLOP/s dense: 1,979 TFLOP/s sparse / 2 (NVIDIA H100 datasheet, SXM)
        bf16_flops=989e12,
        # fp8 tensor core, FLOP/s dense: 3,958 TFLOP/s sparse / 2 (NVIDIA H100 datasheet, SXM)
        fp8_flops=1979e12,
        # fp32 non-tensor, FLOP/s: 67 TFLOP/s (NVIDIA H100 datasheet, SXM)
        fp32_flops=67e12,
        # tf32 tensor core, FLOP/s dense: 989 TFLOP/s sparse / 2 (NVIDIA H100 datasheet, SXM)
        tf32_flops=494e12,
        # memory bandwidth, bytes/s: 3.35 TB/s (NVIDIA H100 datasheet, SXM)
        hbm_bytes_per_s=3.35e12,
        intra_node_link="nvlink",
        # NVLink 4, bytes/s one direction: 900 GB/s bidirectional / 2 (NVIDIA H100 datasheet, SXM)
        intra_node_bytes_per_s=450e9,
        source="NVIDIA H100 datasheet",
    ),
    "H100-PCIe": DeviceSpec(
        name="H100-PCIe",
        # memory: 80 GB HBM2e, bytes (NVIDIA H100 datasheet, PCIe)
        memory_bytes=80_000_000_000,
        # compute capability 9.0 (CUDA GPUs list)
        compute_capability=(9, 0),
        # bf16 tensor core, FLOP/s dense: 1,513 TFLOP/s sparse / 2 (NVIDIA H100 datasheet, PCIe)
        bf16_flops=756e12,
        # fp8 tensor core, FLOP/s dense: 3,026 TFLOP/s sparse / 2 (NVIDIA H100 datasheet, PCIe)
        fp8_flops=1513e12,
        # fp32 non-tensor, FLOP/s: 51 TFLOP/s (NVIDIA H100 datasheet, PCIe)
        fp32_flops=51e12,
        # tf32 tensor core, FLOP/s dense: 756 TFLOP/s sparse / 2 (NVIDIA H100 datasheet, PCIe)
        tf32_flops=378e12,
        # memory bandwidth, bytes/s: 2 TB/s (NVIDIA H100 datasheet, PCIe)
        hbm_bytes_per_s=2.0e12,
        intra_node_link="pcie",
        # PCIe Gen5 x16, bytes/s one direction: 128 GB/s bidirectional / 2 (NVIDIA H100 datasheet);
        # an optional NVLink bridge (600 GB/s) is found by Topology.detect()
        intra_node_bytes_per_s=64e9,
        source="NVIDIA H100 datasheet",
    ),
    "H100-NVL": DeviceSpec(
        name="H100-NVL",
        # memory: 94 GB HBM3, bytes (NVIDIA H100 datasheet, NVL)
        memory_bytes=94_000_000_000,
        # compute capability 9.0 (CUDA GPUs list)
        compute_capability=(9, 0),
        # bf16 tensor core, FLOP/s dense: 1,671 TFLOP/s sparse / 2 (NVIDIA H100 datasheet, NVL)
        bf16_flops=835e12,
        # fp8 tensor core, FLOP/s dense: 3,341 TFLOP/s sparse / 2 (NVIDIA H100 datasheet, NVL)
        fp8_flops=1670e12,
        # fp32 non-tensor, FLOP/s: 60 TFLOP/s (NVIDIA H100 datasheet, NVL)
        fp32_flops=60e12,
        # tf32 tensor core, FLOP/s dense: 835 TFLOP/s sparse / 2 (NVIDIA H100 datasheet, NVL)
        tf32_flops=417e12,
        # memory bandwidth, bytes/s: 3.9 TB/s (NVIDIA H100 datasheet, NVL)
        hbm_bytes_per_s=3.9e12,
        intra_node_link="pcie",
        # PCIe Gen5 x16, bytes/s one direction: 128 GB/s bidirectional / 2 (NVIDIA H100 datasheet, NVL);
        # the NVLink bridge between a pair (600 GB/s) is found by Topology.detect()
        intra_node_bytes_per_s=64e9,
        source="NVIDIA H100 datasheet",
    ),
    "H200": DeviceSpec(
        name="H200",
        # memory: 141 GB HBM3e, bytes (NVIDIA H200 datasheet, SXM; nvidia-smi reports 143,771 MiB)
        memory_bytes=141_000_000_000,
        # compute capability 9.0 (CUDA GPUs list)
        compute_capability=(9, 0),
        # bf16 tensor core, FLOP/s dense: 1,979 TFLOP/s sparse / 2 (NVIDIA H200 datasheet, SXM)
        bf16_flops=989e12,
        # fp8 tensor core, FLOP/s dense: 3,958 TFLOP/s sparse / 2 (NVIDIA H200 datasheet, SXM)
        fp8_flops=1979e12,
        # fp32 non-tensor, FLOP/s: 67 TFLOP/s (NVIDIA H200 datasheet, SXM)
        fp32_flops=67e12,
        # tf32 tensor core, FLOP/s dense: 989 TFLOP/s sparse / 2 (NVIDIA H200 datasheet, SXM)
        tf32_flops=494e12,
        # memory bandwidth, bytes/s: 4.8 TB/s (NVIDIA H200 datasheet, SXM)
        hbm_bytes_per_s=4.8e12,
        intra_node_link="nvlink",
        # NVLink 4, bytes/s one direction: 900 GB/s bidirectional / 2 (NVIDIA H200 datasheet, SXM)
        intra_node_bytes_per_s=450e9,
        source="NVIDIA H200 datasheet",
    ),
    "H200-NVL": DeviceSpec(
        name="H200-NVL",
        # memory: 141 GB HBM3e, bytes (NVIDIA H200 datasheet, NVL)
        memory_bytes=141_000_000_000,
        # compute capability 9.0 (CUDA GPUs list)
        compute_capability=(9, 0),
        # bf16 tensor core, FLOP/s dense: 1,671 TFLOP/s sparse / 2 (NVIDIA H200 datasheet, NVL)
        bf16_flops=835e12,
        # fp8 tensor core, FLOP/s dense: 3,341 TFLOP/s sparse / 2 (NVIDIA H200 datasheet, NVL)
        fp8_flops=1670e12,
        # fp32 non-tensor, FLOP/s: 60 TFLOP/s (NVIDIA H200 datasheet, NVL)
        fp32_flops=60e12,
        # tf32 tensor core, FLOP/s dense: 835 TFLOP/s sparse / 2 (NVIDIA H200 datasheet, NVL)
        tf32_flops=417e12,
        # memory bandwidth, bytes/s: 4.8 TB/s (NVIDIA H200 datasheet, NVL)
        hbm_bytes_per_s=4.8e12,
        intra_node_link="pcie",
        # PCIe Gen5 x16, bytes/s one direction: 128 GB/s bidirectional / 2 (NVIDIA H200 datasheet, NVL);
        # 2- or 4-way NVLink bridges (900 GB/s) are found by Topology.detect()
        intra_node_bytes_per_s=64e9,
        source="NVIDIA H200 datasheet",
    ),
    "B200": DeviceSpec(
        name="B200",
        # memory: 180 GB HBM3e per GPU, bytes (NVIDIA HGX B200 / DGX B200 specifications, 1,440 GB / 8)
        memory_bytes=180_000_000_000,
        # compute capability 10.0 (CUDA GPUs list)
        compute_capability=(10, 0),
        # bf16 tensor core, FLOP/s dense: 4.5 PFLOP/s sparse / 2 (NVIDIA HGX B200 specifications, per GPU)
        bf16_flops=2.25e15,
        # fp8 tensor core, FLOP/s dense: 9 PFLOP/s sparse / 2 (NVIDIA HGX B200 specifications, per GPU)
        fp8_flops=4.5e15,
        # fp32 non-tensor, FLOP/s: 75 TFLOP/s (NVIDIA HGX B200 specifications, per GPU)
        fp32_flops=75e12,
        # tf32 tensor core, FLOP/s dense: 2.2 PFLOP/s sparse / 2 (NVIDIA HGX B200 specifications, per GPU)
        tf32_flops=1.1e15,
        # memory bandwidth, bytes/s: 7.7 TB/s (NVIDIA HGX B200 specifications, per GPU; "8 TB/s" is the chip's max)
        hbm_bytes_per_s=7.7e12,
        intra_node_link="nvlink",
        # NVLink 5, bytes/s one direction: 1.8 TB/s bidirectional / 2 (NVIDIA HGX B200 specifications)
        intra_node_bytes_per_s=900e9,
        source="NVIDIA HGX B200 specifications",
    ),
    "L4": DeviceSpec(
        name="L4",
        # memory: 24 GB GDDR6, bytes (NVIDIA L4 datasheet)
        memory_bytes=24_000_000_000,
        # compute capability 8.9 (CUDA GPUs list)
        compute_capability=(8, 9),
        # bf16 tensor core, FLOP/s dense: 242 TFLOP/s sparse / 2 (NVIDIA L4 datasheet)
        bf16_flops=121e12,
        # fp8 tensor core, FLOP/s dense: 485 TFLOP/s sparse / 2 (NVIDIA L4 datasheet)
        fp8_flops=242e12,
        # fp32 non-tensor, FLOP/s: 30.3 TFLOP/s (NVIDIA L4 datasheet)
        fp32_flops=30.3e12,
        # tf32 tensor core, FLOP/s dense: 120 TFLOP/s sparse / 2 (NVIDIA L4 datasheet)
        tf32_flops=60e12,
        # memory bandwidth, bytes/s: 300 GB/s (NVIDIA L4 datasheet)
        hbm_bytes_per_s=300e9,
        intra_node_link="pcie",
        # PCIe Gen4 x16, bytes/s one direction: 64 GB/s bidirectional / 2 (NVIDIA L4 datasheet)
        intra_node_bytes_per_s=32e9,
        source="NVIDIA L4 datasheet",
    ),
    "L40S": DeviceSpec(
        name="L40S",
        # memory: 48 GB GDDR6, bytes (NVIDIA L40S datasheet)
        memory_bytes=48_000_000_000,
        # compute capability 8.9 (CUDA GPUs list)
        compute_capability=(8, 9),
        # bf16 tensor core, FLOP/s dense: 362.05 TFLOP/s (NVIDIA L40S datasheet)
        bf16_flops=362e12,
        # fp8 tensor core, FLOP/s dense: 733 TFLOP/s (NVIDIA L40S datasheet)
        fp8_flops=733e12,
        # fp32 non-tensor, FLOP/s: 91.6 TFLOP/s (NVIDIA L40S datasheet)
        fp32_flops=91.6e12,
        # tf32 tensor core, FLOP/s dense: 183 TFLOP/s (NVIDIA L40S datasheet)
        tf32_flops=183e12,
        # memory bandwidth, bytes/s: 864 GB/s (NVIDIA L40S datasheet)
        hbm_bytes_per_s=864e9,
        intra_node_link="pcie",
        # PCIe Gen4 x16, bytes/s one direction: 64 GB/s bidirectional / 2 (NVIDIA L40S datasheet)
        intra_node_bytes_per_s=32e9,
        source="NVIDIA L40S datasheet",
    ),
    "RTX-4090": DeviceSpec(
        name="RTX-4090",
        # memory: 24 GB GDDR6X, bytes (NVIDIA Ada Lovelace architecture whitepaper, GeForce RTX 4090)
        memory_bytes=24_000_000_000,
        # compute capability 8.9 (CUDA GPUs list)
        compute_capability=(8, 9),
        # bf16 tensor core with fp32 accumulate, FLOP/s dense: 165.2 TFLOP/s (Ada whitepaper, RTX 4090)
        bf16_flops=165e12,
        # fp8 tensor core with fp32 accumulate, FLOP/s dense: 330.3 TFLOP/s (Ada whitepaper, RTX 4090)
        fp8_flops=330e12,
        # fp32 non-tensor, FLOP/s: 82.6 TFLOP/s (Ada whitepaper, RTX 4090)
        fp32_flops=82.6e12,
        # tf32 tensor core, FLOP/s dense: 82.6 TFLOP/s (Ada whitepaper, RTX 4090)
        tf32_flops=82.6e12,
        # memory bandwidth, bytes/s: 1,008 GB/s (Ada whitepaper, RTX 4090)
        hbm_bytes_per_s=1008e9,
        intra_node_link="pcie",
        # PCIe Gen4 x16, bytes/s one direction: nominal 32 GB/s (PCIe 4.0 specification; no NVLink on this card)
        intra_node_bytes_per_s=32e9,
        source="NVIDIA Ada Lovelace architecture whitepaper",
    ),
}

# CPU pseudo-device: rough nominal figures per process, not measured; they only let the planner rank
# strategies on CPU (tests, gloo). Memory is filled in per topology (RAM / processes per node).
# fp32 and bf16 matmul, FLOP/s per process: 1e11, a few AVX-512 cores (nominal, rough)
_CPU_FLOPS = 1e11
# memory bandwidth, bytes/s per process: 2e10, a share of a server's DRAM bandwidth (nominal, rough)
_CPU_MEMORY_BYTES_PER_S = 2e10
# between processes of one node over shared memory, bytes/s one direction: 1e10 (nominal, rough)
_CPU_SHM_BYTES_PER_S = 1e10
# across nodes, bytes/s per node: 1.25e9, a 10 Gb/s Ethernet link shared by the node's processes (nominal)
_CPU_NETWORK_BYTES_PER_S = 1.25e9
# fallback when the OS does not report RAM, bytes: 16 GiB
_CPU_FALLBACK_RAM_BYTES = 16 * 2**30

# Names NVML and torch report (`nvidia-smi --query-gpu=name`, listed first) and aliases accepted in spec
# strings, besides the canonical name. Matching ignores case and everything but letters and digits, and
# drops a leading "NVIDIA" / "GeForce": "NVIDIA A100-SXM4-80GB" matches "a100 sxm4 80gb".
_NAMES: dict[str, tuple[str, ...]] = {
    "A100-SXM-40GB": ("NVIDIA A100-SXM4-40GB", "A100-40GB", "A100-SXM4-40GB"),
    "A100-SXM-80GB": ("NVIDIA A100-SXM4-80GB", "A100-80GB", "A100-SXM4-80GB", "A100", "A100-SXM", "A100-SXM4"),
    "A100-PCIe-80GB": ("NVIDIA A100 80GB PCIe", "A100-PCIe"),
    "H100-SXM": ("NVIDIA H100 80GB HBM3", "H100", "H100-SXM5", "H100-80GB"),
    "H100-PCIe": ("NVIDIA H100 PCIe",),
    "H100-NVL": ("NVIDIA H100 NVL",),
    "H200": ("NVIDIA H200", "H200-SXM", "H200-SXM5", "H200-141GB"),
    "H200-NVL": ("NVIDIA H200 NVL",),
    "B200": ("NVIDIA B200", "B200-SXM", "HGX-B200", "DGX-B200"),
    "L4": ("NVIDIA L4",),
    "L40S": ("NVIDIA L40S",),
    "RTX-4090": ("NVIDIA GeForce RTX 4090", "RTX4090", "4090"),
}


def _name_key(name: str) -> str:
    return re.sub(r"^(nvidia)?(geforce)?", "", re.sub(r"[^a-z0-9]", "", name.lower()))


def _build_aliases() -> dict[str, str]:
    out: dict[str, str] = {}
    for canonical, names in _NAMES.items():
        for name in (canonical, *names):
            key = _name_key(name)
            assert out.get(key, canonical) == canonical, f"alias {name!r} is ambiguous"
            out[key] = canonical
    assert set(_NAMES) == set(_TABLE)
    return out


_ALIASES = _build_aliases()


def _known_names() -> tuple[str, ...]:
    """Canonical names of the GPUs in the table, plus 'cpu'."""
    return (*_TABLE, "cpu")


def lookup_device(name: str) -> DeviceSpec | None:
    """The table's spec for a GPU named as NVML / torch report it ("NVIDIA H100 80GB HBM3"), by its
    canonical name ("H100-SXM", any case) or an alias ("h100", "a100-80gb"); None if it is not known.

    "cpu" gives the CPU pseudo-device for one process per node (all of this machine's RAM).
    """
    if not isinstance(name, str):
        return None
    key = _name_key(name)
    if key == "cpu":
        return _cpu_device(1)
    canonical = _ALIASES.get(key)
    return None if canonical is None else _TABLE[canonical]


def _physical_memory_bytes() -> int:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return _CPU_FALLBACK_RAM_BYTES
    return total if isinstance(total, int) and total > 0 else _CPU_FALLBACK_RAM_BYTES


def _cpu_device(processes_per_node: int) -> DeviceSpec:
    return DeviceSpec(
        name="cpu",
        memory_bytes=max(1, _physical_memory_bytes() // processes_per_node),
        compute_capability=None,
        bf16_flops=_CPU_FLOPS,
        fp8_flops=None,
        fp32_flops=_CPU_FLOPS,
        tf32_flops=None,
        hbm_bytes_per_s=_CPU_MEMORY_BYTES_PER_S,
        intra_node_link="shm",
        intra_node_bytes_per_s=_CPU_SHM_BYTES_PER_S,
        source="nominal CPU figures (rough, not measured)",
    )


def _spec_error(spec: Any, why: str) -> TopologyError:
    return TopologyError(
        f"cannot read topology spec {spec!r}: {why}. The format is {_SPEC_FORMAT}. "
        f"Known GPUs: {', '.join(_known_names())} (case does not matter; NVML names such as "
        f"'NVIDIA H100 80GB HBM3' work too). For another GPU, run Topology.detect() on it."
    )


# ---- the whole cluster ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Topology:
    """The hardware of a job: `num_nodes` nodes of `devices_per_node` identical devices.

    `inter_node_bytes_per_s` is the network bandwidth one GPU has to other nodes, one direction.
    `nvlink_pairs` lists the NVLink-connected pairs (i, j), i < j, of local GPU indices when they were
    detected, else None.
    """

    device_type: str
    num_nodes: int
    devices_per_node: int
    device: DeviceSpec
    inter_node_bytes_per_s: float
    nvlink_pairs: tuple[tuple[int, int], ...] | None = None
    source: str = "spec"

    def __post_init__(self) -> None:
        owner = "Topology"
        if self.device_type not in _DEVICE_TYPES:
            raise TopologyError(
                f"Topology.device_type must be one of {', '.join(map(repr, _DEVICE_TYPES))}, got {self.device_type!r}."
            )
        _check_positive_int(owner, "num_nodes", self.num_nodes)
        _check_positive_int(owner, "devices_per_node", self.devices_per_node)
        if not isinstance(self.device, DeviceSpec):
            raise TopologyError(
                f"Topology.device must be a DeviceSpec (see autopar.topology.lookup_device), "
                f"got {type(self.device).__name__}."
            )
        if (self.device_type == "cpu") != (self.device.compute_capability is None):
            raise TopologyError(
                f"Topology.device_type={self.device_type!r} does not match device {self.device.name!r}: "
                "a 'cpu' topology takes the cpu device (no compute capability), a 'cuda' one a GPU."
            )
        object.__setattr__(
            self, "inter_node_bytes_per_s",
            _positive_float(owner, "inter_node_bytes_per_s", self.inter_node_bytes_per_s),
        )
        object.__setattr__(self, "nvlink_pairs", self._normalised_pairs(self.nvlink_pairs))
        if self.source not in _TOPOLOGY_SOURCES:
            raise TopologyError(
                f"Topology.source must be one of {', '.join(map(repr, _TOPOLOGY_SOURCES))}, got {self.source!r}."
            )

    def _normalised_pairs(self, pairs: Any) -> tuple[tuple[int, int], ...] | None:
        if pairs is None:
            return None
        if isinstance(pairs, (str, bytes)) or not hasattr(pairs, "__iter__"):
            raise TopologyError(
                f"Topology.nvlink_pairs must be a list of (i, j) GPU index pairs or None, got {pairs!r}."
            )
        out = set()
        for pair in pairs:
            if (
                not isinstance(pair, (tuple, list)) or len(pair) != 2
                or any(isinstance(v, bool) or not isinstance(v, int) for v in pair)
            ):
                raise TopologyError(f"Topology.nvlink_pairs entries must be (i, j) integer pairs, got {pair!r}.")
            i, j = sorted(pair)
            if i < 0 or j >= self.devices_per_node or i == j:
                raise TopologyError(
                    f"Topology.nvlink_pairs entry {tuple(pair)!r} must name two different local GPUs, "
                    f"indices 0 to {self.devices_per_node - 1}."
                )
            out.add((i, j))
        return tuple(sorted(out))

    # ---- derived values -------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Processes (one per device): nodes x devices per node."""
        return self.num_nodes * self.devices_per_node

    @property
    def is_gpu(self) -> bool:
        return self.device_type == "cuda"

    def link_bytes_per_s(self, group_size: int, *, spans_nodes: bool) -> float:
        """Bandwidth (bytes/s, one direction, per GPU) that a collective over `group_size` ranks sees.

        A group that spans nodes is held back by the network (the slower of network and intra-node link);
        one inside a node uses the node's link (NVLink, PCIe or shared memory). A group of one moves
        nothing; it gets the intra-node figure so that divisions stay finite.
        """
        _check_positive_int("link_bytes_per_s", "group_size", group_size)
        if group_size > self.world_size:
            raise TopologyError(
                f"a group of {group_size} ranks does not fit in this topology's {self.world_size} "
                f"({self.num_nodes} node(s) x {self.devices_per_node}); use a group size up to {self.world_size}."
            )
        intra = self.device.intra_node_bytes_per_s
        if spans_nodes:
            if self.num_nodes == 1:
                raise TopologyError(
                    "spans_nodes=True, but this topology has one node: pass spans_nodes=False."
                )
            return min(self.inter_node_bytes_per_s, intra)
        if group_size > self.devices_per_node:
            raise TopologyError(
                f"a group of {group_size} ranks cannot sit inside one node of {self.devices_per_node} "
                "devices: pass spans_nodes=True."
            )
        return intra

    # ---- construction -----------------------------------------------------------------------------
    @classmethod
    def from_spec(cls, spec: str, *, inter_node_gbps: float | None = None) -> "Topology":
        """Hardware from a string: 'GPU', 'NxGPU' or 'MxNxGPU' (M nodes x N GPUs), e.g. '2x8xH100-SXM'.

        `inter_node_gbps` is the network per GPU in gigabits/s (default 400, InfiniBand NDR).
        """
        if not isinstance(spec, str):
            raise _spec_error(spec, f"a spec is a string, not {type(spec).__name__}")
        match = re.fullmatch(r"\s*(?:(\d+)\s*[xX*]\s*)?(?:(\d+)\s*[xX*]\s*)?(\S.*?)\s*", spec)
        if match is None:
            raise _spec_error(spec, "it is not of the form [nodes x][GPUs per node x]GPU")
        first, second, name = match.groups()
        if second is not None:
            nodes, per_node = int(first), int(second)
        elif first is not None:
            nodes, per_node = 1, int(first)
        else:
            nodes, per_node = 1, 1
        if nodes < 1 or per_node < 1:
            raise _spec_error(spec, "node and GPU counts must be at least 1")
        if _name_key(name) == "cpu":
            return cls.cpu(nodes * per_node, num_nodes=nodes)._with_network(inter_node_gbps)
        device = lookup_device(name)
        if device is None:
            raise _spec_error(spec, f"{name!r} is not a known GPU")
        return cls(
            device_type="cuda",
            num_nodes=nodes,
            devices_per_node=per_node,
            device=device,
            inter_node_bytes_per_s=_gbps_to_bytes_per_s(inter_node_gbps),
            nvlink_pairs=None,
            source="spec",
        )

    @classmethod
    def cpu(cls, num_processes: int = 1, *, num_nodes: int = 1) -> "Topology":
        """CPU processes (gloo): `num_processes` in all, spread evenly over `num_nodes` nodes.

        Figures are rough nominal values (docs/topology.md); memory is this machine's RAM divided by the
        processes per node.
        """
        _check_positive_int("Topology.cpu", "num_processes", num_processes)
        _check_positive_int("Topology.cpu", "num_nodes", num_nodes)
        if num_processes % num_nodes:
            raise TopologyError(
                f"{num_processes} CPU processes do not spread evenly over {num_nodes} nodes; "
                f"use a multiple of {num_nodes} processes."
            )
        per_node = num_processes // num_nodes
        return cls(
            device_type="cpu",
            num_nodes=num_nodes,
            devices_per_node=per_node,
            device=_cpu_device(per_node),
            inter_node_bytes_per_s=_CPU_NETWORK_BYTES_PER_S / per_node,
            nvlink_pairs=None,
            source="cpu",
        )

    @classmethod
    def detect(cls, *, inter_node_gbps: float | None = None) -> "Topology":
        """The hardware this process runs on.

        With CUDA: GPU name, memory and compute capability from NVML (torch when NVML is unavailable),
        NVLink connections between the node's GPUs from NVML, nodes and GPUs per node from torchrun's
        WORLD_SIZE and LOCAL_WORLD_SIZE (without them: one node with every visible GPU). A GPU that is not
        in the table is measured (a few seconds, with a warning). Without CUDA: `Topology.cpu` with the
        world size from the same variables (1 without them).

        The network across nodes is not measured: `inter_node_gbps` (gigabits/s per GPU) sets it,
        default 400 (InfiniBand NDR).
        """
        world, local = _world_from_env()
        if not torch.cuda.is_available():
            world = world if world is not None else 1
            local = local if local is not None else world
            return cls.cpu(world, num_nodes=world // local)._with_network(inter_node_gbps)
        visible = torch.cuda.device_count()
        if visible < 1:
            raise TopologyError(
                "torch.cuda.is_available() is True but no CUDA device is visible; check CUDA_VISIBLE_DEVICES."
            )
        if local is None:
            local = visible if world is None else min(world, visible)
        world = world if world is not None else local
        if world % local:
            raise TopologyError(
                f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}: autopar plans for nodes "
                "with the same number of processes each. Launch the same number of processes on every node."
            )
        facts = _gpu_facts(local)
        known = lookup_device(facts["name"])
        if known is not None:
            base = dataclasses.replace(known, memory_bytes=facts["memory_bytes"],
                                       source=f"{known.source}; memory from {facts['via']}")
            if facts["compute_capability"] != known.compute_capability:
                warnings.warn(
                    f"GPU {facts['name']!r} reports compute capability {facts['compute_capability']} but the "
                    f"table has {known.compute_capability} for {known.name}; using the reported one.",
                    stacklevel=2,
                )
                base = dataclasses.replace(base, compute_capability=facts["compute_capability"])
        else:
            warnings.warn(
                f"GPU {facts['name']!r} is not in autopar's table of known GPUs "
                f"({', '.join(_TABLE)}): its matmul rates and memory bandwidth are measured now "
                "(a few seconds; no fp8 rate), and the planner's estimates are only as good as that "
                "measurement. To skip it, plan with Topology.from_spec('<N>x<known GPU>').",
                stacklevel=2,
            )
            index = _local_device_index(visible)
            measured = _measure_device(index)
            base = DeviceSpec(
                name=facts["name"],
                memory_bytes=facts["memory_bytes"],
                compute_capability=facts["compute_capability"],
                bf16_flops=measured["bf16_flops"],
                fp8_flops=None,
                fp32_flops=measured["fp32_flops"],
                tf32_flops=measured.get("tf32_flops"),
                hbm_bytes_per_s=measured["hbm_bytes_per_s"],
                intra_node_link="pcie",
                intra_node_bytes_per_s=facts["pcie_bytes_per_s"] or _DEFAULT_PCIE_BYTES_PER_S,
                source=f"measured on cuda:{index}; memory from {facts['via']}",
            )
        # The link inside the node: what was detected wins over the table, when anything was.
        if local > 1 and facts["nvlink_pairs"] is not None:
            if facts["nvlink_complete"]:
                link, bandwidth = "nvlink", facts["nvlink_bytes_per_s"]
            else:
                link = "pcie"
                bandwidth = facts["pcie_bytes_per_s"] or (
                    base.intra_node_bytes_per_s if base.intra_node_link == "pcie" else _DEFAULT_PCIE_BYTES_PER_S
                )
            base = dataclasses.replace(base, intra_node_link=link, intra_node_bytes_per_s=bandwidth)
        return cls(
            device_type="cuda",
            num_nodes=world // local,
            devices_per_node=local,
            device=base,
            inter_node_bytes_per_s=_gbps_to_bytes_per_s(inter_node_gbps),
            nvlink_pairs=facts["nvlink_pairs"],
            source="detected",
        )

    def _with_network(self, inter_node_gbps: float | None) -> "Topology":
        """A copy with the network set to `inter_node_gbps` gigabits/s per device (unchanged when None)."""
        if inter_node_gbps is None:
            return self
        return dataclasses.replace(self, inter_node_bytes_per_s=_gbps_to_bytes_per_s(inter_node_gbps))

    # ---- identity, serialisation --------------------------------------------------------------------
    def fingerprint(self) -> str:
        """A short stable hash (16 hex digits) of what the planner uses: device type, counts, the device's
        figures and the network. Provenance (`source`, the device's `source`) and the NVLink pair list
        (summarised by the link kind and bandwidth) are left out; rates are rounded to 3 significant digits
        so that re-measuring an unknown GPU gives the same fingerprint when the figures barely move.
        """
        data = self.to_dict()
        del data["source"], data["nvlink_pairs"]
        del data["device"]["source"]
        blob = json.dumps(_rounded(data), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (YAML-safe): lists, not tuples."""
        return {
            "device_type": self.device_type,
            "num_nodes": self.num_nodes,
            "devices_per_node": self.devices_per_node,
            "device": self.device.to_dict(),
            "inter_node_bytes_per_s": self.inter_node_bytes_per_s,
            "nvlink_pairs": None if self.nvlink_pairs is None else [list(p) for p in self.nvlink_pairs],
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Topology":
        if not isinstance(data, Mapping):
            raise TopologyError(f"a topology must be a mapping of field names to values, got {type(data).__name__}.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(map(str, data)) - known)
        if unknown:
            raise TopologyError(
                f"unknown topology field(s) {', '.join(unknown)}; known fields are: {', '.join(sorted(known))}."
            )
        required = {"device_type", "num_nodes", "devices_per_node", "device", "inter_node_bytes_per_s"}
        missing = sorted(required - set(data))
        if missing:
            raise TopologyError(f"topology is missing field(s) {', '.join(missing)}; Topology.to_dict writes them all.")
        values = dict(data)
        device = values["device"]
        values["device"] = device if isinstance(device, DeviceSpec) else DeviceSpec.from_dict(device)
        return cls(**values)

    # ---- for people ---------------------------------------------------------------------------------
    def describe(self) -> str:
        """The topology in a block a person reads at a glance."""
        d = self.device
        unit, units = ("GPU", "GPUs") if self.is_gpu else ("process", "processes")
        nodes = "1 node" if self.num_nodes == 1 else f"{self.num_nodes} nodes"
        cc = "" if d.compute_capability is None else ", compute capability %d.%d" % d.compute_capability
        rates = ", ".join(
            f"{p} {_si(d.peak_flops(p))}FLOP/s" for p in ("bf16", "fp8", "tf32", "fp32") if d.supports(p)
        )
        lines = [
            f"autopar topology {self.fingerprint()}",
            f"  layout        {nodes} x {self.devices_per_node} {unit if self.devices_per_node == 1 else units} "
            f"= {self.world_size} {unit if self.world_size == 1 else units} ({self.device_type})",
            f"  device        {d.name}, {d.memory_bytes / 1e9:.1f} GB ({d.memory_bytes / 2**30:.1f} GiB){cc}",
            f"  peak rates    {rates} (dense)",
            f"  memory bw     {_si(d.hbm_bytes_per_s)}B/s",
            f"  in a node     {d.intra_node_link}, {_si(d.intra_node_bytes_per_s)}B/s per {unit}, one direction",
        ]
        if self.nvlink_pairs is not None:
            pairs = ", ".join(f"{i}-{j}" for i, j in self.nvlink_pairs) or "none"
            lines.append(f"  NVLink pairs  {pairs}")
        lines.append(
            f"  across nodes  {_si(self.inter_node_bytes_per_s)}B/s per {unit}, one direction "
            f"({self.inter_node_bytes_per_s * 8 / 1e9:g} Gb/s)"
        )
        lines.append(f"  source        {self.source} ({d.source})")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


# ---- helpers ---------------------------------------------------------------------------------------
def _gbps_to_bytes_per_s(gbps: float | None) -> float:
    if gbps is None:
        gbps = _DEFAULT_INTER_NODE_GBPS
    value = _positive_float("Topology", "inter_node_gbps", gbps)
    assert value is not None
    return value * 1e9 / 8


def _si(value: float) -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            return f"{value / factor:.3g} {prefix}"
    return f"{value:.3g} "


def _rounded(value: Any) -> Any:
    """Floats to 3 significant digits, recursively (ints, strings, None unchanged)."""
    if isinstance(value, float):
        return float(f"{value:.3g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise TopologyError(f"environment variable {name}={raw!r} must be a positive integer (torchrun sets it).")
    return value


def _world_from_env() -> tuple[int | None, int | None]:
    """(WORLD_SIZE, LOCAL_WORLD_SIZE) from the environment torchrun sets; None where unset."""
    world, local = _env_int("WORLD_SIZE"), _env_int("LOCAL_WORLD_SIZE")
    if world is not None and local is not None and world % local:
        raise TopologyError(
            f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}: autopar plans for nodes with "
            "the same number of processes each. Launch the same number of processes on every node."
        )
    if world is None and local is not None:
        world = local
    return world, local


def _local_device_index(visible: int) -> int:
    local_rank = _env_int_or_zero("LOCAL_RANK")
    return local_rank if local_rank < visible else 0


def _env_int_or_zero(name: str) -> int:
    try:
        return max(0, int(os.environ.get(name, "0")))
    except ValueError:
        return 0


# PCIe bytes/s per lane, one direction, by generation (nominal: 2.5/5 GT/s with 8b/10b, 8/16/32/64 GT/s
# with 128b/130b or FLIT, rounded): x16 Gen4 is 32e9, x16 Gen5 64e9.
_PCIE_LANE_BYTES_PER_S = {1: 0.25e9, 2: 0.5e9, 3: 1e9, 4: 2e9, 5: 4e9, 6: 8e9}
# When nothing about the PCIe link is known: Gen4 x16, bytes/s one direction (nominal).
_DEFAULT_PCIE_BYTES_PER_S = 32e9
# NVLink bytes/s per link, one direction, by NVML's nvmlDeviceGetNvLinkVersion value: NVLink 1 20 GB/s
# (P100); NVLink 2, 3 and 4 25 GB/s (V100, A100: 12 links = 300 GB/s; H100: 18 links = 450 GB/s);
# NVLink 5 50 GB/s (B200: 18 links = 900 GB/s). NVML numbers versions 1.0, 2.0, 2.2, 3.0, 3.1, 4.0, 5.0
# as 1..7 (older drivers returned the generation itself; both read the same here except 5 -> 25 GB/s,
# which can only under-estimate). Unknown versions count 25 GB/s.
_NVLINK_DEFAULT_LINK_BYTES_PER_S = 25e9


def _nvlink_link_bytes_per_s(version: int | None) -> float:
    if version == 1:
        return 20e9
    if version is not None and version >= 7:
        return 50e9
    return _NVLINK_DEFAULT_LINK_BYTES_PER_S


def _pci_key(info: Any) -> tuple[int, int, int] | None:
    """(domain, bus, device) of an NVML PCI info struct, from its numeric fields or its bus id string."""
    try:
        return (int(info.domain), int(info.bus), int(info.device))
    except (AttributeError, TypeError, ValueError):
        pass
    for attr in ("busId", "busIdLegacy"):
        raw = getattr(info, attr, None)
        if isinstance(raw, bytes):
            raw = raw.decode(errors="replace")
        if isinstance(raw, str):
            m = re.fullmatch(r"\s*([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)(?:\.[0-9a-fA-F]+)?\s*", raw)
            if m:
                return (int(m.group(1), 16), int(m.group(2), 16), int(m.group(3), 16))
    return None


def _gpu_facts(local: int) -> dict[str, Any]:
    """Name, memory, compute capability and links of this node's GPUs: NVML first, torch as fallback.

    Returns name, memory_bytes, compute_capability, via ("NVML" or "torch"), pcie_bytes_per_s (or None),
    nvlink_pairs (None when NVML could not be asked), nvlink_complete, nvlink_bytes_per_s.
    """
    try:
        return _nvml_facts(local)
    except _NvmlUnavailable:
        pass
    props = torch.cuda.get_device_properties(0)
    names = {torch.cuda.get_device_name(i) for i in range(min(local, torch.cuda.device_count()))}
    if len(names) > 1:
        _warn_mixed(sorted(names))
    return {
        "name": str(props.name),
        "memory_bytes": int(props.total_memory),
        "compute_capability": (int(props.major), int(props.minor)),
        "via": "torch",
        "pcie_bytes_per_s": None,
        "nvlink_pairs": None,
        "nvlink_complete": False,
        "nvlink_bytes_per_s": None,
    }


class _NvmlUnavailable(Exception):
    """NVML cannot be imported or initialised, or cannot describe the GPUs: use torch instead."""


def _warn_mixed(names: list[str]) -> None:
    warnings.warn(
        f"this node has different GPUs ({', '.join(names)}); autopar plans for identical GPUs and uses the "
        "one with the least memory. Restrict CUDA_VISIBLE_DEVICES to one kind for better plans.",
        stacklevel=4,
    )


def _nvml_facts(local: int) -> dict[str, Any]:
    try:
        import pynvml  # nvidia-ml-py
    except Exception as exc:  # ImportError, or a broken install
        raise _NvmlUnavailable(str(exc)) from None
    nvml_error: type[BaseException] = getattr(pynvml, "NVMLError", Exception)
    try:
        pynvml.nvmlInit()
    except nvml_error as exc:
        raise _NvmlUnavailable(str(exc)) from None
    except Exception as exc:  # e.g. the library is missing on this machine
        raise _NvmlUnavailable(str(exc)) from None
    try:
        return _nvml_facts_inited(pynvml, nvml_error, local)
    except nvml_error as exc:
        raise _NvmlUnavailable(str(exc)) from None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _nvml_facts_inited(pynvml: Any, nvml_error: type[BaseException], local: int) -> dict[str, Any]:
    count = int(pynvml.nvmlDeviceGetCount())
    if count < 1:
        raise _NvmlUnavailable("NVML sees no GPU")
    all_handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    all_keys: list[tuple[int, int, int] | None] = []
    for h in all_handles:
        try:
            all_keys.append(_pci_key(pynvml.nvmlDeviceGetPciInfo(h)))
        except nvml_error:
            all_keys.append(None)

    # The node's GPUs in torch's numbering (matched by PCI address), or NVML's order where this process sees
    # fewer GPUs than the node runs processes (one GPU per process) or torch does not give PCI addresses.
    handles: list[Any] = []
    visible = torch.cuda.device_count()
    if visible >= local:
        for i in range(local):
            props = torch.cuda.get_device_properties(i)
            try:
                key = (int(props.pci_domain_id), int(props.pci_bus_id), int(props.pci_device_id))
            except (AttributeError, TypeError, ValueError):
                handles = []
                break
            if key not in all_keys:
                handles = []
                break
            handles.append(all_handles[all_keys.index(key)])
    if not handles:
        handles = all_handles[:local]

    names = [_text(pynvml.nvmlDeviceGetName(h)) for h in handles]
    memories = [int(pynvml.nvmlDeviceGetMemoryInfo(h).total) for h in handles]
    if len(set(names)) > 1:
        _warn_mixed(sorted(set(names)))
    chosen = min(range(len(handles)), key=lambda k: memories[k])
    try:
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handles[chosen])
        cc = (int(major), int(minor))
    except nvml_error:
        props = torch.cuda.get_device_properties(0)
        cc = (int(props.major), int(props.minor))

    pcie = None
    try:
        gen = int(pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handles[chosen]))
        width = int(pynvml.nvmlDeviceGetMaxPcieLinkWidth(handles[chosen]))
        if gen in _PCIE_LANE_BYTES_PER_S and width > 0:
            pcie = _PCIE_LANE_BYTES_PER_S[gen] * width
    except (nvml_error, AttributeError):
        pass

    pairs, complete, nvlink_bw = _nvlink_links(pynvml, nvml_error, handles, all_keys)
    return {
        "name": names[chosen],
        "memory_bytes": memories[chosen],
        "compute_capability": cc,
        "via": "NVML",
        "pcie_bytes_per_s": pcie,
        "nvlink_pairs": pairs,
        "nvlink_complete": complete,
        "nvlink_bytes_per_s": nvlink_bw,
    }


def _nvlink_links(
    pynvml: Any, nvml_error: type[BaseException], handles: list[Any], all_keys: list[Any]
) -> tuple[tuple[tuple[int, int], ...], bool, float | None]:
    """NVLink pairs among `handles` (indices into it), whether every pair is connected, and the NVLink
    bandwidth per GPU (one direction: active links x per-link rate, the smallest over the GPUs)."""
    max_links = int(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18))
    enabled = getattr(pynvml, "NVML_FEATURE_ENABLED", 1)
    switch_type = getattr(pynvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
    local_keys: list[Any] = []
    for h in handles:
        try:
            local_keys.append(_pci_key(pynvml.nvmlDeviceGetPciInfo(h)))
        except nvml_error:
            local_keys.append(None)
    pairs: set[tuple[int, int]] = set()
    on_switch: set[int] = set()
    bandwidth: list[float] = []
    for i, h in enumerate(handles):
        total = 0.0
        for link in range(max_links):
            try:
                if pynvml.nvmlDeviceGetNvLinkState(h, link) != enabled:
                    continue
                remote = _pci_key(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link))
            except nvml_error:
                continue
            if remote is not None and remote in local_keys:
                j = local_keys.index(remote)
                if j == i:
                    continue
                pairs.add((min(i, j), max(i, j)))
            elif remote is not None and remote in all_keys:
                continue  # a GPU of this machine that the job does not use
            else:
                try:
                    kind = pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(h, link)
                except (nvml_error, AttributeError):
                    kind = switch_type  # an active link to a peer that is no GPU: on NVIDIA systems, an NVSwitch
                if kind != switch_type:
                    continue  # a GPU we cannot place, or an IBM NPU: not a path between our GPUs
                on_switch.add(i)
            try:
                version: int | None = int(pynvml.nvmlDeviceGetNvLinkVersion(h, link))
            except (nvml_error, AttributeError):
                version = None
            total += _nvlink_link_bytes_per_s(version)
        bandwidth.append(total)
    switched = sorted(on_switch)
    for a in range(len(switched)):
        for b in range(a + 1, len(switched)):
            pairs.add((switched[a], switched[b]))
    n = len(handles)
    complete = n > 1 and len(pairs) == n * (n - 1) // 2
    nvlink_bw = min(bandwidth) if complete and min(bandwidth) > 0 else None
    return tuple(sorted(pairs)), complete and nvlink_bw is not None, nvlink_bw


# ---- measuring a GPU that is not in the table --------------------------------------------------------
def _time_per_call(fn: Any, *, warmup: int, reps: int, rounds: int = 3) -> float:
    """Seconds per call of `fn`, the best of `rounds` rounds of `reps` calls (after `warmup` calls)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def _measure_device(device_index: int) -> dict[str, float | None]:
    """Peak rates of GPU `device_index`, measured: bf16 and fp32 (and tf32 from compute capability 8.0)
    square GEMMs, and HBM bandwidth from a large device-to-device copy (read + write bytes counted).

    Returns bf16_flops, fp32_flops, tf32_flops (None below 8.0) and hbm_bytes_per_s. Takes a few seconds.
    """
    device = torch.device("cuda", device_index)
    props = torch.cuda.get_device_properties(device_index)
    n = 8192 if props.total_memory >= 16 * 2**30 else 4096
    flop = 2.0 * n**3
    out: dict[str, float | None] = {}
    previous_precision = torch.get_float32_matmul_precision()
    with torch.cuda.device(device_index):
        try:
            a = torch.randn(n, n, device=device, dtype=torch.float32)
            b = torch.randn(n, n, device=device, dtype=torch.float32)
            torch.set_float32_matmul_precision("highest")
            out["fp32_flops"] = flop / _time_per_call(lambda: torch.mm(a, b), warmup=1, reps=3)
            if (props.major, props.minor) >= (8, 0):
                torch.set_float32_matmul_precision("high")
                out["tf32_flops"] = flop / _time_per_call(lambda: torch.mm(a, b), warmup=2, reps=5)
            else:
                out["tf32_flops"] = None
        finally:
            torch.set_float32_matmul_precision(previous_precision)
        try:
            a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
            out["bf16_flops"] = flop / _time_per_call(lambda: torch.mm(a16, b16), warmup=3, reps=10)
            del a16, b16
        except RuntimeError:  # no bf16 GEMM on this GPU: the fp32 rate stands in (bf16 is unsupported anyway)
            out["bf16_flops"] = out["fp32_flops"]
        del a, b
        size = min(2**30, props.total_memory // 8)  # bytes per buffer
        src = torch.empty(size, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        out["hbm_bytes_per_s"] = 2.0 * size / _time_per_call(lambda: dst.copy_(src), warmup=2, reps=10)
        del src, dst
        torch.cuda.empty_cache()
    return out


# ---- the table as Markdown (docs/topology.md holds this; a test checks that they agree) -------------
def _markdown_table() -> str:
    def t(x: float | None) -> str:
        return "-" if x is None else f"{x / 1e12:g}"

    rows = [
        "| name | memory (GB) | compute capability | bf16 TFLOP/s | fp8 TFLOP/s | tf32 TFLOP/s | fp32 TFLOP/s "
        "| memory bandwidth (GB/s) | link in a node | link GB/s (one direction) | source |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for d in _TABLE.values():
        assert d.compute_capability is not None
        rows.append(
            f"| {d.name} | {d.memory_bytes / 1e9:g} | {d.compute_capability[0]}.{d.compute_capability[1]} "
            f"| {t(d.bf16_flops)} | {t(d.fp8_flops)} | {t(d.tf32_flops)} | {t(d.fp32_flops)} "
            f"| {d.hbm_bytes_per_s / 1e9:g} | {d.intra_node_link} | {d.intra_node_bytes_per_s / 1e9:g} | {d.source} |"
        )
    rows.append(
        f"| cpu | RAM / processes per node | - | {t(_CPU_FLOPS)} | - | - | {t(_CPU_FLOPS)} "
        f"| {_CPU_MEMORY_BYTES_PER_S / 1e9:g} | shm | {_CPU_SHM_BYTES_PER_S / 1e9:g} | nominal, rough |"
    )
    return "\n".join(rows)


def _markdown_names() -> str:
    rows = ["| name | also matches |", "|---|---|"]
    rows += [f"| {name} | {', '.join('`' + n + '`' for n in names)} |" for name, names in _NAMES.items()]
    return "\n".join(rows)
