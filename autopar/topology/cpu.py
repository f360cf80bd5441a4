"""The CPU pseudo-device (gloo processes): rough nominal figures, and this machine's RAM shared by the
processes of a node."""

from __future__ import annotations

import os

from .device import DeviceSpec

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

