"""Reading hardware names and spec strings: a GPU named as NVML, torch or a person writes it gives the
table's DeviceSpec (`lookup_device`); "MxNxGPU" gives nodes, GPUs per node and the device (`parse_spec`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..errors import TopologyError
from .cpu import _cpu_device
from .device import DeviceSpec
from .gpus import _NAMES, _TABLE

_SPEC_FORMAT = (
    "'GPU' (1 node x 1 GPU), 'NxGPU' (1 node x N GPUs) or 'MxNxGPU' (M nodes x N GPUs each), "
    "e.g. 'H200', '8xH100-SXM', '2x8xA100-80GB', '2x4xcpu'"
)


def _name_key(name: str) -> str:
    return re.sub(r"^(nvidia)?(geforce)?", "", re.sub(r"[^a-z0-9]", "", name.lower()))


def _build_aliases() -> dict[str, str]:
    out: dict[str, str] = {}
    for canonical, names in _NAMES.items():
        for name in (canonical, *names):
            key = _name_key(name)
            assert out.get(key, canonical) == canonical, f"alias {name!r} is ambiguous"
            out[key] = canonical
    assert set(_NAMES) == set(_TABLE)
    return out


_ALIASES = _build_aliases()


def _known_names() -> tuple[str, ...]:
    """Canonical names of the GPUs in the table, plus 'cpu'."""
    return (*_TABLE, "cpu")


def lookup_device(name: str) -> DeviceSpec | None:
    """The table's spec for a GPU named as NVML / torch report it ("NVIDIA H100 80GB HBM3"), by its
    canonical name ("H100-SXM", any case) or an alias ("h100", "a100-80gb"); None if it is not known.

    "cpu" gives the CPU pseudo-device for one process per node (all of this machine's RAM).
    """
    if not isinstance(name, str):
        return None
    key = _name_key(name)
    if key == "cpu":
        return _cpu_device(1)
    canonical = _ALIASES.get(key)
    return None if canonical is None else _TABLE[canonical]


def _spec_error(spec: Any, why: str) -> TopologyError:
    return TopologyError(
        f"cannot read topology spec {spec!r}: {why}. The format is {_SPEC_FORMAT}. "
        f"Known GPUs: {', '.join(_known_names())} (case does not matter; NVML names such as "
        f"'NVIDIA H100 80GB HBM3' work too). For another GPU, run Topology.detect() on it."
    )


@dataclass(frozen=True)
class ParsedSpec:
    """A spec string read: `num_nodes` nodes of `devices_per_node` `device`s (None: CPU processes)."""

    num_nodes: int
    devices_per_node: int
    device: DeviceSpec | None


def parse_spec(spec: Any) -> ParsedSpec:
    """'GPU', 'NxGPU' or 'MxNxGPU' (M nodes x N GPUs), e.g. '2x8xH100-SXM' or '2x4xcpu'; TopologyError, with
    the format and the known GPUs, for anything else."""
    if not isinstance(spec, str):
        raise _spec_error(spec, f"a spec is a string, not {type(spec).__name__}")
    match = re.fullmatch(r"\s*(?:(\d+)\s*[xX*]\s*)?(?:(\d+)\s*[xX*]\s*)?(\S.*?)\s*", spec)
    if match is None:
        raise _spec_error(spec, "it is not of the form [nodes x][GPUs per node x]GPU")
    first, second, name = match.groups()
    if second is not None:
        nodes, per_node = int(first), int(second)
    elif first is not None:
        nodes, per_node = 1, int(first)
    else:
        nodes, per_node = 1, 1
    if nodes < 1 or per_node < 1:
        raise _spec_error(spec, "node and GPU counts must be at least 1")
    if _name_key(name) == "cpu":
        return ParsedSpec(num_nodes=nodes, devices_per_node=per_node, device=None)
    device = lookup_device(name)
    if device is None:
        raise _spec_error(spec, f"{name!r} is not a known GPU")
    return ParsedSpec(num_nodes=nodes, devices_per_node=per_node, device=device)
