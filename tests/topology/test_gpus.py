"""Tests of the table of known GPUs (autopar/topology/gpus.py): its figures, and a source beside each."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopar import topology as topo
from autopar.topology import gpus as topo_gpus
from autopar.topology import lookup_device


def test_table_figures():
    h100 = lookup_device("H100-SXM")
    assert (h100.bf16_flops, h100.fp8_flops, h100.fp32_flops, h100.tf32_flops) == (989e12, 1979e12, 67e12, 494e12)
    assert h100.memory_bytes == 80 * 10**9 and h100.hbm_bytes_per_s == 3.35e12
    assert (h100.intra_node_link, h100.intra_node_bytes_per_s) == ("nvlink", 450e9)
    h200 = lookup_device("H200")
    assert h200.memory_bytes == 141 * 10**9 and h200.hbm_bytes_per_s == 4.8e12
    assert h200.bf16_flops == h100.bf16_flops and h200.compute_capability == (9, 0)
    a100 = lookup_device("A100-80GB")
    assert (a100.bf16_flops, a100.fp8_flops, a100.tf32_flops) == (312e12, None, 156e12)
    assert a100.intra_node_bytes_per_s == 300e9
    b200 = lookup_device("B200")
    assert (b200.bf16_flops, b200.fp8_flops, b200.intra_node_bytes_per_s) == (2.25e15, 4.5e15, 900e9)
    for name in ("L4", "L40S", "RTX-4090"):
        spec = lookup_device(name)
        assert spec.intra_node_link == "pcie" and spec.compute_capability == (8, 9)
    # every GPU: dense rates ordered as the hardware orders them
    for name in topo._TABLE:
        d = lookup_device(name)
        assert d.fp32_flops < d.bf16_flops
        assert d.tf32_flops is None or d.tf32_flops <= d.bf16_flops
        assert d.fp8_flops is None or d.fp8_flops == pytest.approx(2 * d.bf16_flops, rel=0.02)  # L40S: 733 vs 2 x 362


def test_table_numbers_each_have_a_comment():
    """Every number in the table has a comment line right above it that names a source."""
    lines = Path(topo_gpus.__file__).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("_TABLE:"))
    end = next(i for i in range(start, len(lines)) if lines[i] == "}")
    numeric = ("memory_bytes=", "compute_capability=", "bf16_flops=", "fp8_flops=", "fp32_flops=", "tf32_flops=",
               "hbm_bytes_per_s=", "intra_node_bytes_per_s=")
    checked = 0
    for i in range(start, end):
        stripped = lines[i].strip()
        if stripped.startswith(numeric):
            k = i - 1
            comment = []
            while lines[k].strip().startswith("#"):
                comment.append(lines[k].strip())
                k -= 1
            assert comment, f"no comment above line {i + 1}: {stripped}"
            assert any("(" in c and ")" in c for c in comment), f"comment above line {i + 1} names no source"
            checked += 1
    assert checked == len(topo._TABLE) * 8
