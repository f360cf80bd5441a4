"""One device's figures, checked when built: `DeviceSpec` (memory, peak matmul rate per dtype, memory and link
bandwidth) and the validators the topology's frozen values share."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import TopologyError

_LINK_KINDS = ("nvlink", "pcie", "shm")
_PRECISIONS = ("fp32", "tf32", "bf16", "fp8")


# ---- validation helpers ---------------------------------------------------------------------------
def _check_positive_int(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TopologyError(f"{owner}.{name} must be a positive integer, got {value!r}.")


def _positive_float(owner: str, name: str, value: Any, *, optional: bool = False) -> float | None:
    """`value` as a float, checked positive and finite (None allowed when `optional`)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        allowed = "a positive finite number" + (" or None" if optional else "")
        raise TopologyError(f"{owner}.{name} must be {allowed}, got {value!r}.")
    return float(value)


def _check_nonempty_str(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise TopologyError(f"{owner}.{name} must be a non-empty string, got {value!r}.")


# ---- one GPU --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or the CPU pseudo-device): memory, peak rates per dtype, memory and link bandwidth.

    Rates are dense peaks in FLOP/s: `bf16_flops` and `fp8_flops` on tensor cores, `tf32_flops` the
    tensor-core rate for fp32 matmuls when TF32 is allowed, `fp32_flops` the plain (non-tensor-core) rate.
    `intra_node_bytes_per_s` is one direction, per GPU, to the other GPUs of its node.
    """

    name: str
    memory_bytes: int
    compute_capability: tuple[int, int] | None
    bf16_flops: float
    fp8_flops: float | None
    fp32_flops: float
    tf32_flops: float | None
    hbm_bytes_per_s: float
    intra_node_link: str
    intra_node_bytes_per_s: float
    source: str

    def __post_init__(self) -> None:
        owner = "DeviceSpec"
        _check_nonempty_str(owner, "name", self.name)
        _check_positive_int(owner, "memory_bytes", self.memory_bytes)
        cc = self.compute_capability
        if cc is not None:
            if (
                not isinstance(cc, (tuple, list)) or len(cc) != 2
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in cc)
            ):
                raise TopologyError(
                    f"DeviceSpec.compute_capability must be (major, minor) as two non-negative integers, "
                    f"e.g. (9, 0), or None for a CPU; got {cc!r}."
                )
            object.__setattr__(self, "compute_capability", (cc[0], cc[1]))
        for name in ("bf16_flops", "fp32_flops", "hbm_bytes_per_s", "intra_node_bytes_per_s"):
            object.__setattr__(self, name, _positive_float(owner, name, getattr(self, name)))
        for name in ("fp8_flops", "tf32_flops"):
            object.__setattr__(self, name, _positive_float(owner, name, getattr(self, name), optional=True))
        if self.intra_node_link not in _LINK_KINDS:
            raise TopologyError(
                f"DeviceSpec.intra_node_link must be one of {', '.join(map(repr, _LINK_KINDS))}, "
                f"got {self.intra_node_link!r}."
            )
        _check_nonempty_str(owner, "source", self.source)

    def supports(self, precision: str) -> bool:
        """Whether matmuls in `precision` run natively here ('fp32', 'tf32', 'bf16' or 'fp8').

        fp32 always; bf16 from compute capability 8.0 (Ampere) and on CPUs; tf32 from 8.0 on GPUs that list
        a TF32 rate; fp8 from 8.9 (Ada, Hopper) on GPUs that list an fp8 rate.
        """
        _check_precision(precision)
        cc = self.compute_capability
        if precision == "fp32":
            return True
        if precision == "bf16":
            return cc is None or cc >= (8, 0)
        if precision == "tf32":
            return cc is not None and cc >= (8, 0) and self.tf32_flops is not None
        return cc is not None and cc >= (8, 9) and self.fp8_flops is not None  # fp8

    def peak_flops(self, precision: str) -> float:
        """Dense peak matmul FLOP/s in `precision`; TopologyError if this device does not support it."""
        if not self.supports(precision):
            cc = "CPU" if self.compute_capability is None else "compute capability %d.%d" % self.compute_capability
            usable = [p for p in _PRECISIONS if self.supports(p)]
            raise TopologyError(
                f"{self.name} ({cc}) has no {precision} tensor cores; use one of {', '.join(usable)}."
            )
        rate = {"fp32": self.fp32_flops, "tf32": self.tf32_flops, "bf16": self.bf16_flops,
                "fp8": self.fp8_flops}[precision]
        assert rate is not None  # supports() checked it
        return rate

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        cc = self.compute_capability
        out["compute_capability"] = None if cc is None else [cc[0], cc[1]]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceSpec:
        if not isinstance(data, Mapping):
            raise TopologyError(f"a device spec must be a mapping of field names to values, got {type(data).__name__}.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(map(str, data)) - known)
        missing = sorted(known - set(map(str, data)))
        if unknown or missing:
            raise TopologyError(
                "device spec fields do not match: "
                + "; ".join(filter(None, [
                    f"unknown {', '.join(unknown)}" if unknown else "",
                    f"missing {', '.join(missing)}" if missing else "",
                ]))
                + f". A device spec has exactly: {', '.join(sorted(known))}."
            )
        return cls(**dict(data))


def _check_precision(precision: str) -> None:
    if precision not in _PRECISIONS:
        raise TopologyError(f"unknown precision {precision!r}; choose one of {', '.join(_PRECISIONS)}.")

