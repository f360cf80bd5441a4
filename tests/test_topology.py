"""Tests of autopar.topology: spec strings, the GPU table, DeviceSpec / Topology checks, fingerprints,
serialisation, and detection (CPU for real; GPUs through fakes of torch.cuda and pynvml)."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from autopar import topology as topo
from autopar.errors import TopologyError
from autopar.topology import DeviceSpec, Topology, lookup_device

REPO = Path(__file__).resolve().parents[1]
TORCHRUN_VARS = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "RANK")


@pytest.fixture(autouse=True)
def _no_torchrun_env(monkeypatch):
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)


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
    lines = Path(topo.__file__).read_text().splitlines()
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


# ---- DeviceSpec -----------------------------------------------------------------------------------
def test_supports_and_peak_flops():
    a100, h100, l4, cpu = (lookup_device(n) for n in ("A100-SXM-80GB", "H100-SXM", "L4", "cpu"))
    assert a100.supports("fp32") and a100.supports("bf16") and a100.supports("tf32")
    assert not a100.supports("fp8")
    with pytest.raises(TopologyError, match="no fp8") as info:
        a100.peak_flops("fp8")
    assert "fp32, tf32, bf16" in str(info.value)  # what to use instead
    assert h100.supports("fp8") and h100.peak_flops("fp8") == 1979e12
    assert h100.peak_flops("bf16") == 989e12 and h100.peak_flops("fp32") == 67e12
    assert h100.peak_flops("tf32") == 494e12
    assert l4.supports("fp8")  # Ada, compute capability 8.9
    assert cpu.supports("bf16") and cpu.supports("fp32")
    assert not cpu.supports("fp8") and not cpu.supports("tf32")
    assert cpu.peak_flops("bf16") == 1e11
    with pytest.raises(TopologyError, match="unknown precision"):
        h100.supports("fp16x")


def test_supports_follows_compute_capability():
    base = lookup_device("H100-SXM")
    volta = topo.dataclasses.replace(base, name="V100-like", compute_capability=(7, 0))
    assert not volta.supports("bf16") and not volta.supports("fp8") and not volta.supports("tf32")
    ampere_with_fp8_figure = topo.dataclasses.replace(base, compute_capability=(8, 6))
    assert not ampere_with_fp8_figure.supports("fp8")  # fp8 needs 8.9 even when a rate is listed
    no_fp8_rate = topo.dataclasses.replace(base, fp8_flops=None)
    assert not no_fp8_rate.supports("fp8")


def _spec_kwargs(**changes):
    kwargs = lookup_device("H100-SXM").to_dict()
    kwargs.update(changes)
    return kwargs


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"memory_bytes": 0}, "memory_bytes"),
        ({"memory_bytes": 1.5e9}, "memory_bytes"),
        ({"bf16_flops": -1.0}, "bf16_flops"),
        ({"fp32_flops": float("nan")}, "fp32_flops"),
        ({"hbm_bytes_per_s": float("inf")}, "hbm_bytes_per_s"),
        ({"fp8_flops": 0}, "fp8_flops"),
        ({"intra_node_link": "infiniband"}, "intra_node_link"),
        ({"compute_capability": (9,)}, "compute_capability"),
        ({"compute_capability": "9.0"}, "compute_capability"),
        ({"name": ""}, "name"),
        ({"source": None}, "source"),
        ({"intra_node_bytes_per_s": True}, "intra_node_bytes_per_s"),
    ],
)
def test_device_spec_validates(changes, match):
    with pytest.raises(TopologyError, match=match):
        DeviceSpec(**_spec_kwargs(**changes))


def test_device_spec_normalises():
    spec = DeviceSpec(**_spec_kwargs(compute_capability=[9, 0], bf16_flops=10**15))
    assert spec.compute_capability == (9, 0) and isinstance(spec.bf16_flops, float)


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
    assert topo.dataclasses.replace(base, source="detected").fingerprint() == fp
    relabelled = topo.dataclasses.replace(base.device, source="measured")
    assert topo.dataclasses.replace(base, device=relabelled).fingerprint() == fp
    # sensitive to what the planner uses
    others = [
        Topology.from_spec("2x8xH200"),
        Topology.from_spec("1x8xH100-SXM"),
        Topology.from_spec("2x4xH100-SXM"),
        Topology.from_spec("2x8xH100-SXM", inter_node_gbps=200),
        topo.dataclasses.replace(base, device=topo.dataclasses.replace(base.device, memory_bytes=85_520_809_984)),
        topo.dataclasses.replace(base, device=topo.dataclasses.replace(base.device, intra_node_link="pcie",
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
    spec = topo.dataclasses.replace(lookup_device("L40S"), name="Quadro FOO", fp8_flops=None, tf32_flops=None,
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

    monkeypatch.setattr(topo, "_measure_device", fail)


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
    same = topo.dataclasses.replace(spec, device=topo.dataclasses.replace(spec.device, memory_bytes=H100_MIB))
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

    monkeypatch.setattr(topo, "_measure_device", measure)
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
    monkeypatch.setattr(topo, "_measure_device", lambda index: {
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


# ---- the docs agree with the code -----------------------------------------------------------------
def test_docs_table_matches_code():
    text = (REPO / "docs" / "topology.md").read_text()
    assert topo._markdown_table() in text, "regenerate the table in docs/topology.md from topology._markdown_table()"
    assert topo._markdown_names() in text, "regenerate the names table in docs/topology.md from _markdown_names()"


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
