"""What this node's GPUs are and how they connect, as `GpuFacts`: name, memory, compute capability, PCIe
and NVLink from NVML (pynvml, from the nvidia-ml-py package), with torch.cuda as the fallback when NVML
cannot be imported, initialised or asked."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

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


@dataclass(frozen=True)
class GpuFacts:
    """This node's GPUs as NVML or torch reports them. The name, memory and compute capability are those of
    the GPU with the least memory (the one a plan must fit); `names` lists every distinct name seen, more
    than one on a node of mixed GPUs."""

    name: str
    memory_bytes: int
    compute_capability: tuple[int, int]
    via: str  # "NVML" or "torch"
    names: tuple[str, ...]
    pcie_bytes_per_s: float | None = None  # from NVML's PCIe generation and width; None when unknown
    nvlink_pairs: tuple[tuple[int, int], ...] | None = None  # None: NVML could not be asked
    nvlink_complete: bool = False  # NVLink connects every pair of the node's GPUs
    nvlink_bytes_per_s: float | None = None  # per GPU, one direction, when complete


def _gpu_facts(local: int) -> GpuFacts:
    """Name, memory, compute capability and links of this node's `local` GPUs: NVML first, torch as fallback."""
    try:
        return _nvml_facts(local)
    except _NvmlUnavailable:
        pass
    props = torch.cuda.get_device_properties(0)
    names = {torch.cuda.get_device_name(i) for i in range(min(local, torch.cuda.device_count()))}
    return GpuFacts(
        name=str(props.name),
        memory_bytes=int(props.total_memory),
        compute_capability=(int(props.major), int(props.minor)),
        via="torch",
        names=tuple(sorted(names)),
    )


class _NvmlUnavailable(Exception):
    """NVML cannot be imported or initialised, or cannot describe the GPUs: use torch instead (never escapes
    this module)."""


def _nvml_facts(local: int) -> GpuFacts:
    try:
        import pynvml  # nvidia-ml-py: optional at runtime (torch describes the GPUs without it)
    except Exception as exc:  # ImportError, or a broken install
        raise _NvmlUnavailable(str(exc)) from None
    nvml_error: type[BaseException] = getattr(pynvml, "NVMLError", Exception)
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError, or e.g. the library is missing on this machine
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


def _nvml_facts_inited(pynvml: Any, nvml_error: type[BaseException], local: int) -> GpuFacts:
    count = int(pynvml.nvmlDeviceGetCount())
    if count < 1:
        raise _NvmlUnavailable("NVML sees no GPU")
    all_handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    all_keys = [_pci_key_of(pynvml, nvml_error, h) for h in all_handles]
    handles = _node_handles(all_handles, all_keys, local)
    names = [_text(pynvml.nvmlDeviceGetName(h)) for h in handles]
    memories = [int(pynvml.nvmlDeviceGetMemoryInfo(h).total) for h in handles]
    chosen = min(range(len(handles)), key=lambda k: memories[k])
    try:
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handles[chosen])
        cc = (int(major), int(minor))
    except nvml_error:
        props = torch.cuda.get_device_properties(0)
        cc = (int(props.major), int(props.minor))
    pairs, complete, nvlink_bw = _nvlink_links(pynvml, nvml_error, handles, all_keys)
    return GpuFacts(
        name=names[chosen],
        memory_bytes=memories[chosen],
        compute_capability=cc,
        via="NVML",
        names=tuple(sorted(set(names))),
        pcie_bytes_per_s=_pcie_bytes_per_s(pynvml, nvml_error, handles[chosen]),
        nvlink_pairs=pairs,
        nvlink_complete=complete,
        nvlink_bytes_per_s=nvlink_bw,
    )


def _pci_key_of(pynvml: Any, nvml_error: type[BaseException], handle: Any) -> tuple[int, int, int] | None:
    try:
        return _pci_key(pynvml.nvmlDeviceGetPciInfo(handle))
    except nvml_error:
        return None


def _node_handles(all_handles: list[Any], all_keys: list[Any], local: int) -> list[Any]:
    """The node's GPUs in torch's numbering (matched by PCI address), or NVML's order where this process sees
    fewer GPUs than the node runs processes (one GPU per process) or torch does not give PCI addresses."""
    if torch.cuda.device_count() < local:
        return all_handles[:local]
    handles: list[Any] = []
    for i in range(local):
        props = torch.cuda.get_device_properties(i)
        try:
            key = (int(props.pci_domain_id), int(props.pci_bus_id), int(props.pci_device_id))
        except (AttributeError, TypeError, ValueError):
            return all_handles[:local]
        if key not in all_keys:
            return all_handles[:local]
        handles.append(all_handles[all_keys.index(key)])
    return handles or all_handles[:local]


def _pcie_bytes_per_s(pynvml: Any, nvml_error: type[BaseException], handle: Any) -> float | None:
    """The GPU's PCIe link, bytes/s one direction, from its maximum generation and width; None if unknown."""
    try:
        gen = int(pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle))
        width = int(pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle))
    except (nvml_error, AttributeError):
        return None
    if gen in _PCIE_LANE_BYTES_PER_S and width > 0:
        return _PCIE_LANE_BYTES_PER_S[gen] * width
    return None


def _nvlink_links(
    pynvml: Any, nvml_error: type[BaseException], handles: list[Any], all_keys: list[Any]
) -> tuple[tuple[tuple[int, int], ...], bool, float | None]:
    """NVLink pairs among `handles` (indices into it), whether every pair is connected, and the NVLink
    bandwidth per GPU (one direction: active links x per-link rate, the smallest over the GPUs)."""
    max_links = int(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18))
    enabled = getattr(pynvml, "NVML_FEATURE_ENABLED", 1)
    switch_type = getattr(pynvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
    local_keys = [_pci_key_of(pynvml, nvml_error, h) for h in handles]
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

