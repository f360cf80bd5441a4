"""Tests of Topology: its checks, links, the CPU topology, describe, fingerprints and serialisation."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from autopar.errors import TopologyError
from autopar.topology import Topology, lookup_device, resolve_topology

REPO = Path(__file__).resolve().parents[2]


# ---- Topology -------------------------------------------------------------------------------------
def test_topology_validates():
    h100 = lookup_device("H100-SXM")
    ok = dict(device_type="cuda", num_nodes=1, devices_per_node=8, device=h100, inter_node_bytes_per_s=50e9)
    Topology(**ok)
    for changes, match in [
        ({"device_type": "rocm"}, "device_type"),
        ({"num_nodes": 0}, "num_nodes"),
        ({"devices_per_node": 2.0}, "devices_per_node"),
        ({"inter_node_bytes_per_s": 0}, "inter_node_bytes_per_s"),
        ({"device": "H100"}, "DeviceSpec"),
        ({"device_type": "cpu"}, "does not match"),
        ({"nvlink_pairs": [(0, 8)]}, "indices 0 to 7"),
        ({"nvlink_pairs": [(3, 3)]}, "two different"),
        ({"nvlink_pairs": [(0, 1, 2)]}, "pairs"),
        ({"source": "guessed"}, "source"),
    ]:
        with pytest.raises(TopologyError, match=match):
            Topology(**{**ok, **changes})
    t = Topology(**ok, nvlink_pairs=[[1, 0], (2, 3), (0, 1)])
    assert t.nvlink_pairs == ((0, 1), (2, 3))


def test_link_bytes_per_s():
    t = Topology.from_spec("2x8xH100-SXM", inter_node_gbps=400)
    assert t.link_bytes_per_s(8, spans_nodes=False) == 450e9
    assert t.link_bytes_per_s(2, spans_nodes=False) == 450e9
    assert t.link_bytes_per_s(16, spans_nodes=True) == 50e9
    assert t.link_bytes_per_s(2, spans_nodes=True) == 50e9  # e.g. a DP pair on two nodes
    # a group with 8 (4) ranks on each node: 8 (4) rings, each through one GPU's own 400 Gb/s card
    assert t.link_bytes_per_s(16, spans_nodes=True, ranks_per_node=8) == 400e9
    assert t.link_bytes_per_s(8, spans_nodes=True, ranks_per_node=4) == 200e9
    with pytest.raises(TopologyError, match="ranks_per_node"):
        t.link_bytes_per_s(2, spans_nodes=True, ranks_per_node=2)  # a pair on two nodes has one rank on each
    assert t.link_bytes_per_s(1, spans_nodes=False) == 450e9
    with pytest.raises(TopologyError, match="spans_nodes=True"):
        t.link_bytes_per_s(16, spans_nodes=False)
    with pytest.raises(TopologyError, match="does not fit"):
        t.link_bytes_per_s(32, spans_nodes=True)
    with pytest.raises(TopologyError, match="positive integer"):
        t.link_bytes_per_s(0, spans_nodes=False)
    single = Topology.from_spec("8xL40S")
    assert single.link_bytes_per_s(8, spans_nodes=False) == 32e9
    with pytest.raises(TopologyError, match="one node"):
        single.link_bytes_per_s(8, spans_nodes=True)
    # a network faster than the node's link: the slower one limits a group that spans nodes
    pcie = Topology.from_spec("2x8xL40S", inter_node_gbps=800)
    assert pcie.link_bytes_per_s(16, spans_nodes=True) == 32e9
    assert pcie.link_bytes_per_s(16, spans_nodes=True, ranks_per_node=8) == 32e9


def test_cpu_topology():
    t = Topology.cpu()
    assert (t.device_type, t.num_nodes, t.devices_per_node, t.source) == ("cpu", 1, 1, "cpu")
    assert t.device.name == "cpu" and t.device.compute_capability is None
    assert t.device.intra_node_link == "shm"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert t.device.memory_bytes == ram
    four = Topology.cpu(4)
    assert four.devices_per_node == 4 and four.device.memory_bytes == ram // 4
    two_nodes = Topology.cpu(8, num_nodes=2)
    assert (two_nodes.num_nodes, two_nodes.devices_per_node, two_nodes.world_size) == (2, 4, 8)
    with pytest.raises(TopologyError, match="evenly"):
        Topology.cpu(3, num_nodes=2)
    with pytest.raises(TopologyError, match="num_processes"):
        Topology.cpu(0)


def test_describe():
    text = Topology.from_spec("2x8xH100-SXM").describe()
    assert "2 nodes x 8 GPUs = 16 GPUs" in text
    assert "H100-SXM" in text and "compute capability 9.0" in text
    assert "bf16 989 TFLOP/s" in text and "fp8 1.98 PFLOP/s" in text
    assert "nvlink, 450 GB/s" in text and "50 GB/s per GPU" in text and "400 Gb/s" in text
    assert Topology.from_spec("2x8xH100-SXM").fingerprint() in text
    assert str(Topology.cpu(2)).count("\n") >= 5
    assert "fp8" not in Topology.from_spec("A100").describe()
    pairs = Topology(**{**Topology.from_spec("4xH100").__dict__, "nvlink_pairs": [(0, 1)], "source": "detected"})
    assert "NVLink pairs  0-1" in pairs.describe()


# ---- identity and serialisation -------------------------------------------------------------------
def test_fingerprint_is_stable_and_sensitive():
    base = Topology.from_spec("2x8xH100-SXM")
    fp = base.fingerprint()
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert Topology.from_spec("2x8xh100").fingerprint() == fp
    # ignores provenance
    assert dataclasses.replace(base, source="detected").fingerprint() == fp
    relabelled = dataclasses.replace(base.device, source="measured")
    assert dataclasses.replace(base, device=relabelled).fingerprint() == fp
    # sensitive to what the planner uses
    others = [
        Topology.from_spec("2x8xH200"),
        Topology.from_spec("1x8xH100-SXM"),
        Topology.from_spec("2x4xH100-SXM"),
        Topology.from_spec("2x8xH100-SXM", inter_node_gbps=200),
        dataclasses.replace(base, device=dataclasses.replace(base.device, memory_bytes=85_520_809_984)),
        dataclasses.replace(base, device=dataclasses.replace(base.device, intra_node_link="pcie",
                                                                       intra_node_bytes_per_s=64e9)),
    ]
    prints = {o.fingerprint() for o in others}
    assert fp not in prints and len(prints) == len(others)


def test_fingerprint_same_in_another_process():
    code = "from autopar.topology import Topology; print(Topology.from_spec('2x8xH100-SXM').fingerprint())"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, cwd=REPO)
    assert out.stdout.strip() == Topology.from_spec("2x8xH100-SXM").fingerprint()


@pytest.mark.parametrize(
    "t",
    [
        Topology.from_spec("2x8xH100-SXM", inter_node_gbps=200),
        Topology.from_spec("A100-SXM-40GB"),
        Topology.cpu(4, num_nodes=2),
    ],
    ids=["h100", "a100", "cpu"],
)
def test_yaml_round_trip(t):
    d = t.to_dict()
    text = yaml.safe_dump(d)
    back = Topology.from_dict(yaml.safe_load(text))
    assert back == t
    assert back.fingerprint() == t.fingerprint()
    assert back.to_dict() == d


def test_yaml_round_trip_with_pairs_and_measured_device():
    spec = dataclasses.replace(lookup_device("L40S"), name="Quadro FOO", fp8_flops=None, tf32_flops=None,
                                    bf16_flops=123.456e12, source="measured on cuda:0")
    t = Topology(device_type="cuda", num_nodes=1, devices_per_node=4, device=spec, inter_node_bytes_per_s=12.5e9,
                 nvlink_pairs=((0, 1), (2, 3)), source="detected")
    back = Topology.from_dict(yaml.safe_load(yaml.safe_dump(t.to_dict())))
    assert back == t and back.nvlink_pairs == ((0, 1), (2, 3)) and back.device.compute_capability == (8, 9)


def test_from_dict_rejects_bad_input():
    good = Topology.from_spec("H200").to_dict()
    with pytest.raises(TopologyError, match="unknown topology field"):
        Topology.from_dict({**good, "gpus": 8})
    with pytest.raises(TopologyError, match="missing"):
        Topology.from_dict({k: v for k, v in good.items() if k != "device"})
    with pytest.raises(TopologyError, match="mapping"):
        Topology.from_dict([1, 2])  # type: ignore[arg-type]
    bad_device = {**good, "device": {**good["device"], "tflops": 1}}
    with pytest.raises(TopologyError, match="unknown tflops"):
        Topology.from_dict(bad_device)


# ---- host memory ------------------------------------------------------------------------------------
def test_host_memory_is_detected_from_the_os_and_a_containers_cgroup_limit_lowers_it(tmp_path, monkeypatch):
    from autopar.topology import cpu

    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    unlimited = tmp_path / "memory.max"
    unlimited.write_text("max\n")
    monkeypatch.setattr(cpu, "_CGROUP_LIMIT_FILES", (str(unlimited), str(tmp_path / "absent")))
    assert Topology.detect().host_memory_bytes == physical == Topology.cpu(2).host_memory_bytes
    limited = tmp_path / "memory.limit_in_bytes"
    limited.write_text(f"{physical // 4}\n")
    monkeypatch.setattr(cpu, "_CGROUP_LIMIT_FILES", (str(unlimited), str(limited)))
    assert Topology.detect().host_memory_bytes == physical // 4
    assert "host memory" in Topology.detect().describe()


def test_a_spec_plans_with_its_gpus_dgx_host_memory_and_takes_an_override(tmp_path):
    TiB = 2**40
    assert Topology.from_spec("8xH100-SXM").host_memory_bytes == 2 * TiB  # DGX H100: 2 TB
    assert Topology.from_spec("2x8xA100-SXM-40GB").host_memory_bytes == 1 * TiB  # DGX A100 320GB: 1 TB
    unknown = Topology.from_spec("8xL40S")  # sold in many servers: no default, and describe says so
    assert unknown.host_memory_bytes is None and "host memory   unknown" in unknown.describe()
    given = Topology.from_spec("8xH100-SXM", host_memory_bytes=TiB)
    assert given.host_memory_bytes == TiB and "1,024 GiB per node" in given.describe()
    assert given.fingerprint() == Topology.from_spec("8xH100-SXM").fingerprint()  # the caches' keys stay the GPUs'
    assert Topology.from_dict(yaml.safe_load(yaml.safe_dump(given.to_dict()))) == given
    # in a topology file (`autopar topology --yaml`, edited), read with autopar's YAML reader
    data = Topology.from_spec("8xH100-SXM").to_dict()
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({**data, "host_memory_bytes": 4 * TiB}))
    assert Topology.load(path).host_memory_bytes == 4 * TiB == resolve_topology(str(path)).host_memory_bytes
    for bad in (0, -1, 2.5, "2TiB", True):
        with pytest.raises(TopologyError, match="host_memory_bytes"):
            Topology.from_spec("8xH100-SXM", host_memory_bytes=bad)
        path.write_text(yaml.safe_dump({**data, "host_memory_bytes": bad}))
        with pytest.raises(TopologyError, match=f"{path}: .*host_memory_bytes"):
            Topology.load(path)
