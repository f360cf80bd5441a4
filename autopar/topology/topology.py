"""The Topology: what the planner knows about the hardware, as one frozen value.

A Topology says how many nodes and GPUs per node a job has, what each GPU is (a `DeviceSpec`, device.py)
and how fast the network between nodes is. Clusters are homogeneous: one `DeviceSpec` describes every GPU.

Three ways to make one:
  Topology.detect()                 the hardware this process runs on (detect.py: NVML, torch, torchrun's env)
  Topology.from_spec("2x8xH100")    hardware described by a string (spec.py), for planning away from the cluster
  Topology.cpu(4)                   CPU processes (gloo), with rough nominal figures (cpu.py)

Units are in the field names: bytes, FLOP/s, bytes/s. Bandwidths are one direction, per GPU.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import yaml

from .._util.yaml_text import MAX_YAML_CHARS, load_yaml
from ..errors import TopologyError
from .cpu import _CPU_NETWORK_BYTES_PER_S, _cpu_device, detected_host_memory_bytes
from .detect import _world_from_env, detect_gpus
from .device import DeviceSpec, _check_positive_int, _positive_float
from .gpus import _NODE_HOST_MEMORY_BYTES
from .spec import parse_spec

_DEVICE_TYPES = ("cuda", "cpu")
_TOPOLOGY_SOURCES = ("spec", "detected", "cpu")

#: Default network bandwidth per GPU across nodes: one 400 Gb/s InfiniBand NDR NIC per GPU (as in DGX H100),
#: nominal line rate. NCCL maintainers report 46-48 GB/s measured per NDR NIC (docs/topology.md).
_DEFAULT_INTER_NODE_GBPS = 400.0


# ---- the whole cluster ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Topology:
    """The hardware of a job: `num_nodes` nodes of `devices_per_node` identical devices.

    `inter_node_bytes_per_s` is the network bandwidth one GPU has to other nodes, one direction.
    `nvlink_pairs` lists the NVLink-connected pairs (i, j), i < j, of local GPU indices when they were
    detected, else None. `host_memory_bytes` is one node's host RAM (what CPU offload fills): detected, a
    spec's default for its GPU's DGX node, or given; None when unknown (offload plans are then not checked).
    """

    device_type: str
    num_nodes: int
    devices_per_node: int
    device: DeviceSpec
    inter_node_bytes_per_s: float
    nvlink_pairs: tuple[tuple[int, int], ...] | None = None
    source: str = "spec"
    host_memory_bytes: int | None = None

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
        if self.host_memory_bytes is not None:
            _check_positive_int(owner, "host_memory_bytes", self.host_memory_bytes)

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

    def link_bytes_per_s(self, group_size: int, *, spans_nodes: bool, ranks_per_node: int = 1) -> float:
        """Bus bandwidth (bytes/s, one direction, per GPU) that a collective over `group_size` ranks sees.

        A group that spans nodes with `ranks_per_node` of its ranks on each node runs as many rings, each
        through one of those GPUs' own network cards, so its bus bandwidth is that many cards' (NCCL on
        DGX A100, 8 x 200 Gb/s: 192 GB/s all-reduce bus bandwidth, NVIDIA/nccl issue 812), held back by the
        node's link where that is slower. One inside a node uses the node's link (NVLink, PCIe or shared
        memory). A group of one moves nothing; it gets the intra-node figure so that divisions stay finite.
        """
        _check_positive_int("link_bytes_per_s", "group_size", group_size)
        _check_positive_int("link_bytes_per_s", "ranks_per_node", ranks_per_node)
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
            most = max(1, min(group_size // 2, self.devices_per_node))  # it spans two nodes at least
            if ranks_per_node > most:
                raise TopologyError(
                    f"ranks_per_node={ranks_per_node} is more than a group of {group_size} ranks over two or more "
                    f"nodes of {self.devices_per_node} devices can put on one; pass at most {most}."
                )
            return min(ranks_per_node * self.inter_node_bytes_per_s, intra)
        if group_size > self.devices_per_node:
            raise TopologyError(
                f"a group of {group_size} ranks cannot sit inside one node of {self.devices_per_node} "
                "devices: pass spans_nodes=True."
            )
        return intra

    # ---- construction -----------------------------------------------------------------------------
    @classmethod
    def from_spec(cls, spec: str, *, inter_node_gbps: float | None = None,
                  host_memory_bytes: int | None = None) -> Topology:
        """Hardware from a string: 'GPU', 'NxGPU' or 'MxNxGPU' (M nodes x N GPUs), e.g. '2x8xH100-SXM'.

        `inter_node_gbps` is the network per GPU in gigabits/s (default 400, InfiniBand NDR).
        `host_memory_bytes` is one node's host RAM (default: the GPU's DGX node's, gpus.py; this machine's for
        'cpu'; None for GPUs without one).
        """
        parsed = parse_spec(spec)
        if parsed.device is None:  # CPU processes
            world = parsed.num_nodes * parsed.devices_per_node
            cpu = cls.cpu(world, num_nodes=parsed.num_nodes)._with_network(inter_node_gbps)
            return cpu if host_memory_bytes is None else dataclasses.replace(cpu, host_memory_bytes=host_memory_bytes)
        return cls(
            device_type="cuda",
            num_nodes=parsed.num_nodes,
            devices_per_node=parsed.devices_per_node,
            device=parsed.device,
            inter_node_bytes_per_s=_gbps_to_bytes_per_s(inter_node_gbps),
            nvlink_pairs=None,
            source="spec",
            host_memory_bytes=host_memory_bytes if host_memory_bytes is not None
            else _NODE_HOST_MEMORY_BYTES.get(parsed.device.name),
        )

    @classmethod
    def cpu(cls, num_processes: int = 1, *, num_nodes: int = 1) -> Topology:
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
        host = detected_host_memory_bytes()
        return cls(
            device_type="cpu",
            num_nodes=num_nodes,
            devices_per_node=per_node,
            device=_cpu_device(per_node, host_memory_bytes=host),
            inter_node_bytes_per_s=_CPU_NETWORK_BYTES_PER_S / per_node,
            nvlink_pairs=None,
            source="cpu",
            host_memory_bytes=host,
        )

    @classmethod
    def detect(cls, *, inter_node_gbps: float | None = None) -> Topology:
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
        gpus = detect_gpus(world, local)
        return cls(
            device_type="cuda",
            num_nodes=gpus.num_nodes,
            devices_per_node=gpus.devices_per_node,
            device=gpus.device,
            inter_node_bytes_per_s=_gbps_to_bytes_per_s(inter_node_gbps),
            nvlink_pairs=gpus.nvlink_pairs,
            source="detected",
            host_memory_bytes=detected_host_memory_bytes(),
        )

    def _with_network(self, inter_node_gbps: float | None) -> Topology:
        """A copy with the network set to `inter_node_gbps` gigabits/s per device (unchanged when None)."""
        if inter_node_gbps is None:
            return self
        return dataclasses.replace(self, inter_node_bytes_per_s=_gbps_to_bytes_per_s(inter_node_gbps))

    # ---- identity, serialisation --------------------------------------------------------------------
    def fingerprint(self) -> str:
        """A short stable hash (16 hex digits) of what the planner uses: device type, counts, the device's
        figures and the network. Provenance (`source`, the device's `source`) and the NVLink pair list
        (summarised by the link kind and bandwidth) are left out; rates are rounded to 3 significant digits
        so that re-measuring an unknown GPU gives the same fingerprint when the figures barely move. Host
        memory is left out too: it only decides whether CPU-offload plans fit, and the caches keyed by the
        fingerprint (tuned plans, calibrations) stay those of the GPUs.
        """
        data = self.to_dict()
        del data["source"], data["nvlink_pairs"], data["host_memory_bytes"]
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
            "host_memory_bytes": self.host_memory_bytes,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Topology:
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

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Topology:
        """A topology from a YAML file: `Topology.to_dict()`'s fields (what `autopar topology --yaml` prints),
        read with autopar's one YAML reader (plain values only); e.g. a spec's with `host_memory_bytes` changed."""
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read(MAX_YAML_CHARS + 1)  # bounded: load_yaml refuses what is longer
        except (OSError, UnicodeDecodeError) as exc:
            raise TopologyError(f"cannot read the topology file {path} ({exc}).") from None
        try:
            data = load_yaml(text)
        except yaml.YAMLError as exc:
            raise TopologyError(f"{path} is not plain YAML ({str(exc).splitlines()[0]}): write it as "
                                "`autopar topology --cluster SPEC --yaml` prints a topology.") from None
        try:
            return cls.from_dict(data)
        except TopologyError as exc:
            raise TopologyError(f"{path}: {exc}") from None

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
        host = (f"{self.host_memory_bytes / 2**30:,.0f} GiB per node" if self.host_memory_bytes is not None else
                "unknown: CPU-offload plans are not checked against it (give host_memory_bytes)")
        lines.append(f"  host memory   {host}")
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


def resolve_topology(topology: Topology | str | None) -> Topology:
    """The topology as given, read from a YAML file (a string ending in .yaml or .yml: `Topology.load`), parsed
    from a spec string, or (None) detected here."""
    if topology is None:
        return Topology.detect()
    if isinstance(topology, str) and topology.strip().lower().endswith((".yaml", ".yml")):
        return Topology.load(topology.strip())
    if isinstance(topology, str):
        return Topology.from_spec(topology)
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a Topology, a spec string like '2x8xH100-SXM', or None; "
                        f"got {type(topology).__name__}.")
    return topology
