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


#: cgroup memory limits (v2, then v1): a container's share of the machine's RAM
_CGROUP_LIMIT_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def detected_host_memory_bytes() -> int | None:
    """This machine's RAM, bytes: page size x physical pages (sysconf), or less where a cgroup limit (a
    container's) says so; None when the OS reports neither."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        total = None
    if not isinstance(total, int) or total <= 0:
        total = None
    limits = [n for n in map(_read_limit, _CGROUP_LIMIT_FILES) if n is not None]
    known = [n for n in (total, *limits) if n is not None]
    return min(known) if known else None


def _read_limit(path: str) -> int | None:
    """A cgroup memory limit in bytes; None where there is none ("max", a v1 limit of about 2**63, no file)."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except (OSError, ValueError):
        return None
    return int(text) if text.isdigit() and 0 < int(text) < 2**60 else None


def _cpu_device(processes_per_node: int, *, host_memory_bytes: int | None = None) -> DeviceSpec:
    """CPU processes' device: this machine's RAM (`host_memory_bytes`, else detected) shared by the processes."""
    ram = host_memory_bytes or detected_host_memory_bytes() or _CPU_FALLBACK_RAM_BYTES
    return DeviceSpec(
        name="cpu",
        memory_bytes=max(1, ram // processes_per_node),
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

