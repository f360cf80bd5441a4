"""Tests of DeviceSpec: precisions and peak rates, and its checks."""

from __future__ import annotations

import dataclasses

import pytest

from autopar.errors import TopologyError
from autopar.topology import DeviceSpec, lookup_device


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
    volta = dataclasses.replace(base, name="V100-like", compute_capability=(7, 0))
    assert not volta.supports("bf16") and not volta.supports("fp8") and not volta.supports("tf32")
    ampere_with_fp8_figure = dataclasses.replace(base, compute_capability=(8, 6))
    assert not ampere_with_fp8_figure.supports("fp8")  # fp8 needs 8.9 even when a rate is listed
    no_fp8_rate = dataclasses.replace(base, fp8_flops=None)
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
