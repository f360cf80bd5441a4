"""The table of known GPUs and its names as Markdown tables. docs/topology.md holds them, and only
tests/test_topology.py uses these (it checks that the docs agree with the code)."""

from __future__ import annotations

from .cpu import _CPU_FLOPS, _CPU_MEMORY_BYTES_PER_S, _CPU_SHM_BYTES_PER_S
from .gpus import _NAMES, _TABLE


def _tflops(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e12:g}"


def _markdown_table() -> str:
    rows = [
        "| name | memory (GB) | compute capability | bf16 TFLOP/s | fp8 TFLOP/s | tf32 TFLOP/s | fp32 TFLOP/s "
        "| memory bandwidth (GB/s) | link in a node | link GB/s (one direction) | source |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for d in _TABLE.values():
        assert d.compute_capability is not None
        rows.append(
            f"| {d.name} | {d.memory_bytes / 1e9:g} | {d.compute_capability[0]}.{d.compute_capability[1]} "
            f"| {_tflops(d.bf16_flops)} | {_tflops(d.fp8_flops)} | {_tflops(d.tf32_flops)} | {_tflops(d.fp32_flops)} "
            f"| {d.hbm_bytes_per_s / 1e9:g} | {d.intra_node_link} | {d.intra_node_bytes_per_s / 1e9:g} | {d.source} |"
        )
    rows.append(
        f"| cpu | RAM / processes per node | - | {_tflops(_CPU_FLOPS)} | - | - | {_tflops(_CPU_FLOPS)} "
        f"| {_CPU_MEMORY_BYTES_PER_S / 1e9:g} | shm | {_CPU_SHM_BYTES_PER_S / 1e9:g} | nominal, rough |"
    )
    return "\n".join(rows)


def _markdown_names() -> str:
    rows = ["| name | also matches |", "|---|---|"]
    rows += [f"| {name} | {', '.join('`' + n + '`' for n in names)} |" for name, names in _NAMES.items()]
    return "\n".join(rows)
