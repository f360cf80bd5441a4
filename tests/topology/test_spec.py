"""Tests of autopar.topology's spec strings ("2x8xH100-SXM") and GPU names (lookup_device)."""

from __future__ import annotations

import pytest

from autopar.errors import TopologyError
from autopar.topology import Topology, lookup_device


# ---- spec strings ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, nodes, per_node, name",
    [
        ("2x8xH100-SXM", 2, 8, "H100-SXM"),
        ("8xH200", 1, 8, "H200"),
        ("H200", 1, 1, "H200"),
        ("4x8xA100-80GB", 4, 8, "A100-SXM-80GB"),
        ("2x8xh100", 2, 8, "H100-SXM"),
        ("8Xh100-sxm5", 1, 8, "H100-SXM"),
        (" 16 x 8 x b200 ", 16, 8, "B200"),
        ("4xa100-sxm-40gb", 1, 4, "A100-SXM-40GB"),
        ("2xA100-PCIE-80GB", 1, 2, "A100-PCIe-80GB"),
        ("8xh100-nvl", 1, 8, "H100-NVL"),
        ("4xH200-NVL", 1, 4, "H200-NVL"),
        ("l4", 1, 1, "L4"),
        ("2xL40S", 1, 2, "L40S"),
        ("2x4090", 1, 2, "RTX-4090"),
        ("4xrtx-4090", 1, 4, "RTX-4090"),
    ],
)
def test_from_spec_forms(spec, nodes, per_node, name):
    t = Topology.from_spec(spec)
    assert (t.num_nodes, t.devices_per_node, t.device.name) == (nodes, per_node, name)
    assert t.world_size == nodes * per_node
    assert t.device_type == "cuda" and t.is_gpu
    assert t.source == "spec" and t.nvlink_pairs is None
    assert t.device is lookup_device(name)


def test_from_spec_network_default_and_override():
    assert Topology.from_spec("2x8xH100").inter_node_bytes_per_s == 50e9  # 400 Gb/s NDR
    assert Topology.from_spec("2x8xH100", inter_node_gbps=200).inter_node_bytes_per_s == 25e9
    assert Topology.from_spec("2x8xH100", inter_node_gbps=3200).inter_node_bytes_per_s == 400e9
    with pytest.raises(TopologyError, match="inter_node_gbps"):
        Topology.from_spec("2x8xH100", inter_node_gbps=0)


def test_from_spec_cpu():
    t = Topology.from_spec("2x4xcpu")
    assert t.device_type == "cpu" and not t.is_gpu
    assert (t.num_nodes, t.devices_per_node, t.world_size) == (2, 4, 8)
    assert t == Topology.cpu(8, num_nodes=2)


@pytest.mark.parametrize(
    "spec, why",
    [
        ("0x8xH100", "at least 1"),
        ("2x0xH100", "at least 1"),
        ("2x8xFOO", "'FOO' is not a known GPU"),
        ("abc", "'abc' is not a known GPU"),
        ("", "not of the form"),
        ("8x", "not a known GPU"),
        ("H100x8", "not a known GPU"),
    ],
)
def test_bad_specs_say_format_and_known_gpus(spec, why):
    with pytest.raises(TopologyError) as info:
        Topology.from_spec(spec)
    message = str(info.value)
    assert why in message
    assert "MxNxGPU" in message and "2x8xA100-80GB" in message  # the format
    for name in ("H100-SXM", "H200", "A100-SXM-80GB", "B200", "L4", "RTX-4090", "cpu"):  # the known GPUs
        assert name in message
    assert isinstance(info.value, ValueError)


def test_from_spec_rejects_non_strings():
    with pytest.raises(TopologyError, match="string"):
        Topology.from_spec(8)  # type: ignore[arg-type]


# ---- the table ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "reported, canonical",
    [
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),
        ("NVIDIA H100 PCIe", "H100-PCIe"),
        ("NVIDIA H100 NVL", "H100-NVL"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA H200 NVL", "H200-NVL"),
        ("NVIDIA A100-SXM4-80GB", "A100-SXM-80GB"),
        ("NVIDIA A100-SXM4-40GB", "A100-SXM-40GB"),
        ("NVIDIA A100 80GB PCIe", "A100-PCIe-80GB"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA GeForce RTX 4090", "RTX-4090"),
        ("NVIDIA B200", "B200"),
    ],
)
def test_lookup_nvml_names(reported, canonical):
    spec = lookup_device(reported)
    assert spec is not None and spec.name == canonical
    assert lookup_device(canonical) is spec
    assert lookup_device(canonical.lower()) is spec


@pytest.mark.parametrize(
    "name",
    ["NVIDIA GH200 480GB", "NVIDIA H800", "NVIDIA A100-PCIE-40GB", "NVIDIA L40", "Tesla V100-SXM2-16GB", "", "h"],
)
def test_lookup_does_not_guess(name):
    assert lookup_device(name) is None
