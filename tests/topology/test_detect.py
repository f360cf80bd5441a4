"""Tests of Topology.detect: on this (CPU) machine for real, on GPUs through fakes of torch.cuda and pynvml,
and on a real GPU (the device machine)."""

from __future__ import annotations

import dataclasses
import sys
import types
from types import SimpleNamespace

import pytest
import torch
import yaml

from autopar import topology as topo
from autopar.errors import TopologyError
from autopar.topology import Topology, lookup_device
from autopar.topology import detect as topo_detect


# ---- detection on this (CPU) machine --------------------------------------------------------------
def test_detect_on_cpu_machine():
    t = Topology.detect()
    assert t.device_type == "cpu" and t.world_size == 1 and t.source == "cpu"
    assert t == Topology.cpu(1)


def test_detect_without_cuda_reads_torchrun_env(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    t = Topology.detect()
    assert (t.device_type, t.num_nodes, t.devices_per_node, t.world_size) == ("cpu", 2, 4, 8)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    t = Topology.detect()
    assert (t.num_nodes, t.devices_per_node) == (1, 8)
    assert Topology.detect(inter_node_gbps=100).inter_node_bytes_per_s == 12.5e9


@pytest.mark.parametrize(
    "world, local, match", [("8", "3", "multiple"), ("two", None, "WORLD_SIZE"), ("0", None, "WORLD_SIZE")]
)
def test_detect_rejects_bad_env(monkeypatch, world, local, match):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", world)
    if local is not None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    with pytest.raises(TopologyError, match=match):
        Topology.detect()


# ---- detection of GPUs, through fakes -------------------------------------------------------------
class FakeNVMLError(Exception):
    pass


H100_NVML = "NVIDIA H100 80GB HBM3"
H100_MIB = 81559 * 2**20  # what nvidia-smi reports for an H100 SXM


def _pci(bus: int):
    return SimpleNamespace(domain=0, bus=bus, device=0, busId=f"00000000:{bus:02X}:00.0".encode())


def fake_pynvml(gpus, links, *, version=None, remote_type=None, pcie=(5, 16), max_links=18):
    """A stand-in for the pynvml module.

    gpus: [(name, memory_bytes, pci_bus)] in NVML order; links: {(gpu, link): remote pci bus} for active links;
    version: what nvmlDeviceGetNvLinkVersion returns (None: it raises); remote_type: what
    nvmlDeviceGetNvLinkRemoteDeviceType returns (None: it raises).
    """
    m = types.ModuleType("pynvml")
    m.NVMLError = FakeNVMLError
    m.NVML_NVLINK_MAX_LINKS = max_links
    m.NVML_FEATURE_ENABLED = 1
    m.NVML_FEATURE_DISABLED = 0
    m.NVML_NVLINK_DEVICE_TYPE_GPU = 0
    m.NVML_NVLINK_DEVICE_TYPE_SWITCH = 2
    m.calls = {"init": 0, "shutdown": 0}

    def init():
        m.calls["init"] += 1

    def shutdown():
        m.calls["shutdown"] += 1

    def state(h, link):
        if link >= max_links:
            raise FakeNVMLError("invalid argument")
        return 1 if (h, link) in links else 0

    def remote_pci(h, link):
        if (h, link) not in links:
            raise FakeNVMLError("not supported")
        return _pci(links[(h, link)])

    def get_version(h, link):
        if version is None:
            raise FakeNVMLError("not supported")
        return version

    def get_remote_type(h, link):
        if remote_type is None:
            raise FakeNVMLError("function not found")
        return remote_type

    m.nvmlInit = init
    m.nvmlShutdown = shutdown
    m.nvmlDeviceGetCount = lambda: len(gpus)
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: gpus[h][0]
    m.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(total=gpus[h][1], used=0, free=gpus[h][1])
    m.nvmlDeviceGetCudaComputeCapability = lambda h: (9, 0)
    m.nvmlDeviceGetPciInfo = lambda h: _pci(gpus[h][2])
    m.nvmlDeviceGetNvLinkState = state
    m.nvmlDeviceGetNvLinkRemotePciInfo = remote_pci
    m.nvmlDeviceGetNvLinkVersion = get_version
    m.nvmlDeviceGetNvLinkRemoteDeviceType = get_remote_type
    m.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: pcie[0]
    m.nvmlDeviceGetMaxPcieLinkWidth = lambda h: pcie[1]
    return m


def fake_cuda(monkeypatch, gpus, *, order=None, cc=(9, 0), with_pci=True):
    """torch.cuda reporting `gpus` ([(name, memory_bytes, pci_bus)]); `order` maps torch index -> gpus index."""
    order = list(range(len(gpus))) if order is None else order

    def props(i):
        name, memory, bus = gpus[order[i]]
        p = SimpleNamespace(name=name, total_memory=memory, major=cc[0], minor=cc[1], multi_processor_count=132)
        if with_pci:
            p.pci_domain_id, p.pci_bus_id, p.pci_device_id = 0, bus, 0
        return p

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(order))
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: gpus[order[i]][0])


def no_measuring(monkeypatch):
    def fail(index):
        raise AssertionError("a GPU in the table must not be measured")

    monkeypatch.setattr(topo_detect, "_measure_device", fail)


def test_detect_two_h100_with_one_nvlink(monkeypatch):
    gpus = [(H100_NVML, H100_MIB, 0x18), (H100_NVML, H100_MIB, 0x2A)]
    nvml = fake_pynvml(gpus, {(0, 0): 0x2A, (1, 0): 0x18})  # link 0 of each GPU goes to the other
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    fake_cuda(monkeypatch, gpus)
    no_measuring(monkeypatch)
    t = Topology.detect()
    assert t.source == "detected" and t.device_type == "cuda"
    assert (t.num_nodes, t.devices_per_node) == (1, 2)
    assert t.nvlink_pairs == ((0, 1),)
    assert t.device.name == "H100-SXM"
    assert t.device.memory_bytes == H100_MIB  # NVML overrides the table's 80e9
    assert t.device.bf16_flops == 989e12  # rates from the table
    assert t.device.intra_node_link == "nvlink"
    assert t.device.intra_node_bytes_per_s == 25e9  # one active link, NVLink version unknown: 25 GB/s a link
    assert "memory from NVML" in t.device.source
    assert nvml.calls == {"init": 1, "shutdown": 1}


def test_detect_nvswitch_node_under_torchrun(monkeypatch):
    buses = [0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB]
    gpus = [(H100_NVML, H100_MIB, b) for b in buses]
    switch_buses = [0xC0, 0xC1, 0xC2, 0xC3]
    links = {(g, link): switch_buses[link % 4] for g in range(8) for link in range(18)}
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus, links, version=6, remote_type=2))
    fake_cuda(monkeypatch, gpus)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "3")
    no_measuring(monkeypatch)
    t = Topology.detect(inter_node_gbps=400)
    assert (t.num_nodes, t.devices_per_node, t.world_size) == (2, 8, 16)
    assert len(t.nvlink_pairs) == 28  # all pairs, through the switches
    assert (t.device.intra_node_link, t.device.intra_node_bytes_per_s) == ("nvlink", 450e9)  # 18 x 25 GB/s
    spec = Topology.from_spec("2x8xH100-SXM")
    assert t.link_bytes_per_s(16, spans_nodes=True) == spec.link_bytes_per_s(16, spans_nodes=True)
    # the same hardware as the spec apart from the memory NVML reports
    same = dataclasses.replace(spec, device=dataclasses.replace(spec.device, memory_bytes=H100_MIB))
    assert t.fingerprint() == same.fingerprint()


def test_detect_partial_nvlink_is_pcie_in_torch_numbering(monkeypatch):
    """NVLink bridges between pairs (NVML 0-1 and 2-3), torch numbering NVML's 0,2,1,3: a ring over the node
    crosses PCIe, so the node's link is PCIe; the pairs are reported in torch's numbering."""
    name, memory = "NVIDIA H100 NVL", 95830 * 2**20
    gpus = [(name, memory, 0x18), (name, memory, 0x2A), (name, memory, 0x3A), (name, memory, 0x5D)]
    links = {}
    for a, b in ((0, 1), (2, 3)):
        for link in range(12):
            links[(a, link)] = gpus[b][2]
            links[(b, link)] = gpus[a][2]
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus, links, version=6, pcie=(5, 16)))
    fake_cuda(monkeypatch, gpus, order=[0, 2, 1, 3])
    no_measuring(monkeypatch)
    t = Topology.detect()
    assert t.nvlink_pairs == ((0, 2), (1, 3))
    assert (t.device.intra_node_link, t.device.intra_node_bytes_per_s) == ("pcie", 64e9)
    assert t.device.name == "H100-NVL" and t.device.memory_bytes == memory


def test_detect_fully_bridged_pcie_cards_use_nvlink(monkeypatch):
    name, memory = "NVIDIA H100 NVL", 95830 * 2**20
    gpus = [(name, memory, 0x18), (name, memory, 0x2A)]
    links = {(0, link): 0x2A for link in range(12)} | {(1, link): 0x18 for link in range(12)}
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus, links, version=6))
    fake_cuda(monkeypatch, gpus)
    no_measuring(monkeypatch)
    t = Topology.detect()
    assert t.nvlink_pairs == ((0, 1),)
    assert (t.device.intra_node_link, t.device.intra_node_bytes_per_s) == ("nvlink", 300e9)  # 600 GB/s bridge


def test_detect_no_nvlink_on_sxm_gpus_falls_back_to_pcie(monkeypatch):
    gpus = [(H100_NVML, H100_MIB, 0x18), (H100_NVML, H100_MIB, 0x2A)]
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus, {}, pcie=(4, 16)))
    fake_cuda(monkeypatch, gpus)
    no_measuring(monkeypatch)
    t = Topology.detect()
    assert t.nvlink_pairs == ()
    assert (t.device.intra_node_link, t.device.intra_node_bytes_per_s) == ("pcie", 32e9)


def test_detect_one_gpu_per_process_uses_the_node_from_nvml(monkeypatch):
    """A launcher that shows each process only its own GPU: NVML still sees the node's GPUs."""
    gpus = [(H100_NVML, H100_MIB, 0x18 + 0x10 * i) for i in range(4)]
    links = {(g, link): 0xC0 for g in range(4) for link in range(18)}
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus, links, version=6, remote_type=2))
    fake_cuda(monkeypatch, gpus, order=[2])
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    no_measuring(monkeypatch)
    t = Topology.detect()
    assert (t.devices_per_node, len(t.nvlink_pairs), t.device.intra_node_link) == (4, 6, "nvlink")


def test_detect_known_gpu_without_nvml_uses_torch_and_table(monkeypatch):
    gpus = [("NVIDIA H200", 143771 * 2**20, 0x18)] * 8
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    fake_cuda(monkeypatch, gpus)
    no_measuring(monkeypatch)
    t = Topology.detect()
    assert t.devices_per_node == 8 and t.nvlink_pairs is None  # unknown
    assert t.device.name == "H200" and t.device.memory_bytes == 143771 * 2**20
    assert (t.device.intra_node_link, t.device.intra_node_bytes_per_s) == ("nvlink", 450e9)  # the table's
    assert "memory from torch" in t.device.source


def test_detect_nvml_init_failure_falls_back(monkeypatch):
    gpus = [(H100_NVML, H100_MIB, 0x18)]
    nvml = fake_pynvml(gpus, {})

    def broken_init():
        raise FakeNVMLError("Driver Not Loaded")

    nvml.nvmlInit = broken_init
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    fake_cuda(monkeypatch, gpus)
    no_measuring(monkeypatch)
    t = Topology.detect()
    assert t.device.name == "H100-SXM" and t.nvlink_pairs is None and "torch" in t.device.source


def test_detect_unknown_gpu_warns_and_measures(monkeypatch):
    gpus = [("NVIDIA RTX FOO 9000", 48 * 10**9, 0x18), ("NVIDIA RTX FOO 9000", 48 * 10**9, 0x2A)]
    monkeypatch.setitem(sys.modules, "pynvml", None)
    fake_cuda(monkeypatch, gpus, cc=(8, 6))
    monkeypatch.setenv("LOCAL_RANK", "1")
    measured = {"bf16_flops": 150e12, "fp32_flops": 35e12, "tf32_flops": 70e12, "hbm_bytes_per_s": 700e9}
    asked = []

    def measure(index):
        asked.append(index)
        return dict(measured)

    monkeypatch.setattr(topo_detect, "_measure_device", measure)
    with pytest.warns(UserWarning, match="not in autopar's table") as record:
        t = Topology.detect()
    assert "measured" in str(record[0].message)
    assert asked == [1]  # this process's GPU
    d = t.device
    assert d.name == "NVIDIA RTX FOO 9000" and d.memory_bytes == 48 * 10**9 and d.compute_capability == (8, 6)
    assert (d.bf16_flops, d.fp32_flops, d.tf32_flops, d.hbm_bytes_per_s) == (150e12, 35e12, 70e12, 700e9)
    assert d.fp8_flops is None and not d.supports("fp8")
    assert d.peak_flops("bf16") == 150e12
    assert (d.intra_node_link, d.intra_node_bytes_per_s) == ("pcie", 32e9)
    assert d.source.startswith("measured on cuda:1")
    assert t.nvlink_pairs is None and t.devices_per_node == 2
    # and it survives a plan file
    assert Topology.from_dict(yaml.safe_load(yaml.safe_dump(t.to_dict()))) == t


def test_detect_unknown_gpu_with_nvml_reads_pcie(monkeypatch):
    gpus = [("NVIDIA H800", 81559 * 2**20, 0x18), ("NVIDIA H800", 81559 * 2**20, 0x2A)]
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus, {}, pcie=(5, 16)))
    fake_cuda(monkeypatch, gpus)
    monkeypatch.setattr(topo_detect, "_measure_device", lambda index: {
        "bf16_flops": 700e12, "fp32_flops": 50e12, "tf32_flops": None, "hbm_bytes_per_s": 3e12})
    with pytest.warns(UserWarning, match="NVIDIA H800"):
        t = Topology.detect()
    assert (t.device.intra_node_link, t.device.intra_node_bytes_per_s) == ("pcie", 64e9)
    assert t.device.tf32_flops is None and not t.device.supports("tf32")
    assert t.device.memory_bytes == 81559 * 2**20


def test_detect_mixed_gpus_warns_and_plans_for_the_smallest(monkeypatch):
    gpus = [("NVIDIA H200", 143771 * 2**20, 0x18), (H100_NVML, H100_MIB, 0x2A)]
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus, {}))
    fake_cuda(monkeypatch, gpus)
    no_measuring(monkeypatch)
    with pytest.warns(UserWarning, match="different GPUs"):
        t = Topology.detect()
    assert t.device.name == "H100-SXM" and t.device.memory_bytes == H100_MIB



# ---- on a real GPU (the device machine) -----------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_detect_and_measure_on_real_gpu():
    t = Topology.detect()
    assert t.device_type == "cuda" and t.devices_per_node == torch.cuda.device_count()
    props = torch.cuda.get_device_properties(0)
    assert t.device.compute_capability == (props.major, props.minor)
    assert abs(t.device.memory_bytes - props.total_memory) < 2 * 2**30
    measured = topo._measure_device(0)
    assert measured["bf16_flops"] > measured["fp32_flops"] > 0 and measured["hbm_bytes_per_s"] > 0
    known = lookup_device(torch.cuda.get_device_name(0))
    if known is not None:  # a measurement reaches a good share of the datasheet, and never exceeds it much
        assert 0.4 * known.bf16_flops < measured["bf16_flops"] < 1.1 * known.bf16_flops
        assert 0.4 * known.hbm_bytes_per_s < measured["hbm_bytes_per_s"] < 1.1 * known.hbm_bytes_per_s
