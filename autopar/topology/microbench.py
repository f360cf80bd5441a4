"""Measuring a GPU that is not in the table of known GPUs: bf16, fp32 and tf32 GEMM rates and the HBM
bandwidth of a device-to-device copy, a few seconds on the GPU."""

from __future__ import annotations

import math
import time
from typing import Any

import torch


def _time_per_call(fn: Any, *, warmup: int, reps: int, rounds: int = 3) -> float:
    """Seconds per call of `fn`, the best of `rounds` rounds of `reps` calls (after `warmup` calls)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def _measure_device(device_index: int) -> dict[str, float | None]:
    """Peak rates of GPU `device_index`, measured: bf16 and fp32 (and tf32 from compute capability 8.0)
    square GEMMs, and HBM bandwidth from a large device-to-device copy (read + write bytes counted).

    Returns bf16_flops, fp32_flops, tf32_flops (None below 8.0) and hbm_bytes_per_s. Takes a few seconds.
    """
    device = torch.device("cuda", device_index)
    props = torch.cuda.get_device_properties(device_index)
    with torch.cuda.device(device_index):
        out = _gemm_flops(device, props)  # its matrices are freed on return, before the copy's buffers exist
        out["hbm_bytes_per_s"] = _copy_bytes_per_s(device, props.total_memory)
        torch.cuda.empty_cache()
    return out


def _gemm_flops(device: torch.device, props: Any) -> dict[str, float | None]:
    """fp32, tf32 (None below compute capability 8.0) and bf16 FLOP/s of square GEMMs on `device`."""
    n = 8192 if props.total_memory >= 16 * 2**30 else 4096
    flop = 2.0 * n**3
    out: dict[str, float | None] = {}
    previous_precision = torch.get_float32_matmul_precision()
    try:
        a = torch.randn(n, n, device=device, dtype=torch.float32)
        b = torch.randn(n, n, device=device, dtype=torch.float32)
        torch.set_float32_matmul_precision("highest")
        out["fp32_flops"] = flop / _time_per_call(lambda: torch.mm(a, b), warmup=1, reps=3)
        if (props.major, props.minor) >= (8, 0):
            torch.set_float32_matmul_precision("high")
            out["tf32_flops"] = flop / _time_per_call(lambda: torch.mm(a, b), warmup=2, reps=5)
        else:
            out["tf32_flops"] = None
    finally:
        torch.set_float32_matmul_precision(previous_precision)
    try:
        a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
        out["bf16_flops"] = flop / _time_per_call(lambda: torch.mm(a16, b16), warmup=3, reps=10)
    except RuntimeError:  # no bf16 GEMM on this GPU: the fp32 rate stands in (bf16 is unsupported anyway)
        out["bf16_flops"] = out["fp32_flops"]
    return out


def _copy_bytes_per_s(device: torch.device, total_memory: int) -> float:
    """HBM bandwidth from a device-to-device copy of up to 1 GiB, read and write bytes counted."""
    size = min(2**30, total_memory // 8)  # bytes per buffer
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2.0 * size / _time_per_call(lambda: dst.copy_(src), warmup=2, reps=10)
