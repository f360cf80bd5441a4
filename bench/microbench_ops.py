"""Micro-benchmarks of the op classes autopar's time model prices (autopar/cost/ops.py), and a fit of its factors.

Measures, on one GPU: bf16 GEMMs over a grid of (M, N, K) (and a few fp32 and misaligned ones), convolutions
(ResNet-50 and ConvNeXt-T shapes at batch 64, channels-last and contiguous, forward and backward), SDPA (head
dims 64 and 128, sequences 256-8192, causal or not, and with a float mask; and with Hugging Face's boolean mask,
eager and compiled), torch._grouped_mm where it exists, and elementwise ops' bandwidth; and, reported against the
model but not fitted, grouped (not depthwise) convolutions in 1-d and 2-d and bilinear resampling forward and
backward (sections conv_grouped and resample: the op classes of the zoo's worst CPU-planned steps, 2026-12-06).
Writes one JSON file of records (a header, then one record per measurement).
`--fit FILE` fits the calibration factors the time model uses to those records, through the model's own
formulas (autopar.cost.ops.op_seconds), and prints them with what each was fitted from.

    python -m bench.microbench_ops --out DIR                 # on the GPU: DIR/microbench_ops.json (< 4 min)
    python -m bench.microbench_ops --fit DIR/microbench_ops.json [MORE.json ...]
    python -m bench.microbench_ops --sections gemm_fp32,grouped_gemm_fp32 --out DIR   # some sections only
    python -m bench.microbench_ops --device cpu --quick --out /tmp/mb   # a smoke test of the script on CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

import autopar
from autopar.cost import Calibration
from autopar.cost.calibration import matmul_arch
from autopar.cost.ops import Rates, op_seconds
from autopar.profile.model_profile import OpRecord
from autopar.topology import DeviceSpec

# ---------------------------------------------------------------------------------------------------
# The shapes
# ---------------------------------------------------------------------------------------------------
GEMM_M = (256, 1024, 4096, 16384)
GEMM_N = (1024, 4096, 16384)
GEMM_K = (64, 256, 1024, 4096, 8192)
# square, GPT-2's misaligned vocabulary (and its padded width), and small outputs over deep reductions (the fill loss)
GEMM_EXTRA = ((8192, 8192, 8192), (16384, 50257, 1024), (16384, 50264, 1024), (2048, 2048, 2048),
              (256, 1024, 65536), (512, 512, 65536), (128, 2048, 65536), (1024, 1024, 32768), (256, 256, 131072))
FP32_GEMMS = ((4096, 4096, 1024), (8192, 4096, 4096), (1024, 1024, 1024))
# fp32 GEMMs by output size and depth (SIMT, no TF32): the fill and depth losses of small per-expert GEMMs
FP32_GRID_M = (128, 256, 512, 1024, 2048, 4096)
FP32_GRID_NK = ((2048, 1024), (1024, 2048), (2816, 2048), (2048, 1408), (4096, 4096), (28672, 4096), (4096, 14336))
# (experts, tokens an expert, N, K) of the zoo's MoEs at 4 x 2048 tokens, routed evenly: transformers' fp32
# fallback (integrations/moe.py: one torch.mm per expert, forward; input and weight gradients backward)
FP32_GROUPED = ((8, 2048, 28672, 4096), (8, 2048, 4096, 14336), (60, 546, 2816, 2048), (60, 546, 2048, 1408),
                (64, 1024, 2048, 2048), (64, 1024, 2048, 1024), (64, 768, 2816, 2048), (64, 768, 2048, 1408))
# (C_in, C_out, H, kernel, stride, groups) at batch 64: ResNet-50 and ConvNeXt-T layers
CONVS = ((3, 64, 224, 7, 2, 1), (64, 64, 56, 1, 1, 1), (64, 64, 56, 3, 1, 1), (64, 256, 56, 1, 1, 1),
         (128, 128, 28, 3, 1, 1), (512, 128, 28, 1, 1, 1), (256, 256, 14, 3, 1, 1), (1024, 256, 14, 1, 1, 1),
         (512, 512, 7, 3, 1, 1), (2048, 512, 7, 1, 1, 1), (3, 96, 224, 4, 4, 1), (96, 96, 56, 7, 1, 96),
         (384, 384, 14, 7, 1, 384), (96, 192, 56, 2, 2, 1))
ATTENTION_DIMS = (64, 128)
ATTENTION_SEQS = (256, 512, 1024, 2048, 4096, 8192)
ATTENTION_TOKENS = 32768  # batch x sequence of each attention call
HF_ATTENTION = ((32, 12, 512, 64), (8, 25, 1024, 64))  # (batch, heads, seq, head dim): BERT-base, GPT-2-1.5B
COMPILE_RESERVE_S = 45.0  # a compiled measurement starts only with this much of the budget left (inductor compiles)
GROUPED = ((8, 2048, 4096, 14336), (8, 2048, 14336, 4096), (64, 512, 2048, 1408), (64, 512, 1408, 2048))
ELEMENTWISE_NUMEL = (2**24, 2**26, 2**28)
# (batch x heads, sequence, head dim) of attention's score GEMMs where SDPA's math path (or a model's own matmuls)
# runs them as batched GEMMs: ViT-B/16 at 64 images (197 tokens), CLIP's text (77) and vision (50) towers, Swin's
# 7 x 7 windows (49), ViT-L/14-336 (577), and aligned controls (196, 256)
BMM_ATTENTION = ((768, 197, 64), (1536, 77, 64), (1536, 50, 64), (6144, 49, 32), (256, 577, 64), (768, 196, 64),
                 (768, 256, 64), (384, 197, 128))
MIN_SECONDS = 20e-6  # shorter kernels are left out of the fit

# (C_in, C_out, length or side, kernel, groups, dims) at batch 16: grouped convolutions that are not depthwise (more
# than 8 channels a group), 1-d over a sequence and 2-d over an image, with the zoo's wav2vec2 positional
# convolution (768 channels, 16 groups, kernel 128 over 499 frames: cuDNN ran it in per-group CUDA-core kernels,
# bench/NOTES.md 2026-12-06) among them. Measured against the model's dense-convolution price, not fitted.
GROUPED_CONVS = ((768, 768, 499, 128, 16, 1), (768, 768, 499, 31, 16, 1), (768, 768, 499, 3, 16, 1),
                 (512, 512, 2048, 3, 32, 1), (256, 256, 56, 3, 32, 2), (512, 512, 28, 3, 32, 2),
                 (128, 128, 56, 3, 4, 2), (1024, 1024, 14, 3, 64, 2))
# (channels, side in, side out) at batch 16: bilinear resampling of a feature map, forward and backward (the
# backward accumulates with atomics): SegFormer's decode head and the upsampling of its logits before the loss.
RESAMPLES = ((256, 128, 512), (150, 128, 512), (256, 16, 128), (256, 64, 128))
QUICK = dict(GEMM_M=(64, 256), GEMM_N=(128,), GEMM_K=(64, 256), GEMM_EXTRA=((256, 250, 128),),
             FP32_GEMMS=((128, 128, 128),), CONVS=((3, 16, 32, 3, 1, 1), (16, 16, 16, 3, 1, 16)),
             ATTENTION_DIMS=(64,), ATTENTION_SEQS=(128, 256), ATTENTION_TOKENS=512, HF_ATTENTION=((2, 2, 64, 16),),
             GROUPED=((4, 64, 128, 64),), ELEMENTWISE_NUMEL=(2**16,), FP32_GRID_M=(64,), FP32_GRID_NK=((128, 64),),
             FP32_GROUPED=((4, 32, 64, 48),), BMM_ATTENTION=((8, 33, 16), (8, 32, 16)),
             GROUPED_CONVS=((32, 32, 64, 9, 2, 1), (32, 32, 8, 3, 2, 2)), RESAMPLES=((4, 8, 16),))


# ---------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------
class Timer:
    """Median seconds of `fn` over enough repetitions for about `target_s` (CUDA events on a GPU), within a
    total budget: past it, measurements are skipped (returns None)."""

    def __init__(self, device: torch.device, budget_s: float, quick: bool) -> None:
        self.device, self.deadline, self.quick = device, time.perf_counter() + budget_s, quick

    def remaining(self) -> float:
        return self.deadline - time.perf_counter()

    def __call__(self, fn: Callable[[], Any], target_s: float = 0.02) -> float | None:
        if time.perf_counter() > self.deadline:
            return None
        fn()  # warm-up (and cuBLAS / cuDNN heuristics)
        one = self._once(fn)
        reps = 1 if self.quick else max(3, min(50, int(target_s / max(one, 1e-6))))
        return statistics.median(self._once(fn) for _ in range(3 if not self.quick else 1)) if reps <= 3 else \
            self._once(fn, reps)

    def _once(self, fn: Callable[[], Any], reps: int = 1) -> float:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / reps
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps


def _nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


# ---------------------------------------------------------------------------------------------------
# The measurements: each yields records {"kind", "shape", "dtype", "flops", "bytes", "seconds", ...}
# ---------------------------------------------------------------------------------------------------
def bench_gemms(timer: Timer, dev: torch.device, s: dict) -> list[dict]:
    out = []
    shapes = [(m, n, k) for m in s["GEMM_M"] for n in s["GEMM_N"] for k in s["GEMM_K"]] + list(s["GEMM_EXTRA"])
    for dtype, grid in ((torch.bfloat16, shapes), (torch.float32, s["FP32_GEMMS"])):
        for m, n, k in grid:
            a = torch.randn(m, k, device=dev, dtype=dtype)
            b = torch.randn(k, n, device=dev, dtype=dtype)
            sec = timer(lambda: a @ b)
            if sec is not None:
                out.append(dict(kind="gemm", shape=[1, m, n, k], dtype=str(dtype)[6:], flops=2.0 * m * n * k,
                                bytes=_nbytes(a, b) + m * n * a.element_size(), seconds=sec, batch_dim=1))
            del a, b
    return out


def bench_fp8_gemms(timer: Timer, dev: torch.device, s: dict) -> list[dict]:
    """float8 GEMMs as a float8 linear runs them (torch._scaled_mm, e4m3 operands with tensorwise scales, bf16
    output; the second operand column-major, as cuBLAS needs), over the bf16 grid's shapes: the rate the cost
    model's float8_matmul_efficiency_ratio stands for (Plan.float8). Each beside the same shape's bf16 GEMM, timed
    in the same section (their ratio is what the calibration reads); kind "gemm_fp8" for both, which the bf16
    fit leaves out."""
    out = []
    shapes = [(m, n, k) for m in s["GEMM_M"] for n in s["GEMM_N"] for k in s["GEMM_K"]] + list(s["GEMM_EXTRA"])
    one = torch.ones((), device=dev)
    for m, n, k in shapes:
        if m % 16 or n % 16 or k % 16:
            continue
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # b8: k x n, column-major
        for dtype, fn in (("bfloat16", lambda: a @ b.t()),
                          ("float8_e4m3fn", lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16))):
            sec = timer(fn)
            if sec is not None:
                elem = 2 if dtype == "bfloat16" else 1
                out.append(dict(kind="gemm_fp8", shape=[1, m, n, k], dtype=dtype, flops=2.0 * m * n * k,
                                bytes=(m * k + n * k) * elem + m * n * 2, seconds=sec, batch_dim=1))
        del a, b, a8, b8
    return out


def bench_fp32_gemms(timer: Timer, dev: torch.device, s: dict) -> list[dict]:
    """fp32 GEMMs (TF32 off, as torch's default) over output sizes and depths: M rows x (N, K), and K = M
    (a weight gradient's depth: the tokens)."""
    out = []
    for m in s["FP32_GRID_M"]:
        for n, k in s["FP32_GRID_NK"]:
            for mm, nn_, kk in ((m, n, k), (k, n, m)):
                a = torch.randn(mm, kk, device=dev)
                b = torch.randn(kk, nn_, device=dev)
                sec = timer(lambda: a @ b)
                if sec is not None:
                    out.append(dict(kind="gemm", shape=[1, mm, nn_, kk], dtype="float32", flops=2.0 * mm * nn_ * kk,
                                    bytes=_nbytes(a, b) + mm * nn_ * 4, seconds=sec, batch_dim=1))
                del a, b
    return out


def bench_bmm(timer: Timer, dev: torch.device, s: dict) -> list[dict]:
    """bf16 batched GEMMs of attention's scores as SDPA's math path runs them (torch.bmm over transposed views:
    S = Q K^T, (seq, seq, d); dV = P^T dO and dK = dS^T Q, (seq, d, seq)): a sequence that is not a multiple of
    8 runs cuBLAS's unaligned batched kernels (misaligned_bmm_factor)."""
    out = []
    for bh, seq, d in s["BMM_ATTENTION"]:
        q = torch.randn(bh, seq, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(bh, seq, d, device=dev, dtype=torch.bfloat16)
        p = torch.randn(bh, seq, seq, device=dev, dtype=torch.bfloat16)
        for (m, n, kk), fn in (((seq, seq, d), lambda: torch.bmm(q, k.transpose(1, 2))),
                               ((seq, d, seq), lambda: torch.bmm(p.transpose(1, 2), q))):
            sec = timer(fn)
            if sec is not None:
                out.append(dict(kind="gemm", shape=[bh, m, n, kk], dtype="bfloat16", flops=2.0 * bh * m * n * kk,
                                bytes=2 * bh * (m * kk + kk * n + m * n), seconds=sec, batch_dim=0))
        del q, k, p
    return out


def _fallback_loop(pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    for a, b, c in pairs:
        torch.mm(a, b, out=c)


def bench_fp32_grouped(timer: Timer, dev: torch.device, s: dict) -> list[dict]:
    """transformers' fp32 MoE fallback, one torch.mm per expert into slices of one output, as the trace records
    it (autopar/profile/watch.py): forward (E, T, N, K), input gradient (E, T, K, N), weight gradient (E, K, N, T);
    T tokens an expert."""
    out = []
    for e, t, n, k in s["FP32_GROUPED"]:
        x = torch.randn(e * t, k, device=dev)
        w = torch.randn(e, k, n, device=dev)
        y = torch.empty(e * t, n, device=dev)
        g = torch.randn(e * t, n, device=dev)
        dx, dw = torch.empty_like(x), torch.empty_like(w)
        rows = [slice(i * t, (i + 1) * t) for i in range(e)]
        loops = {(e, t, n, k): [(x[r], w[i], y[r]) for i, r in enumerate(rows)],
                 (e, t, k, n): [(g[r], w[i].T, dx[r]) for i, r in enumerate(rows)],
                 (e, k, n, t): [(x[r].T, g[r], dw[i]) for i, r in enumerate(rows)]}
        for (ge, gm, gn, gk), pairs in loops.items():
            sec = timer(lambda: _fallback_loop(pairs))
            if sec is not None:
                out.append(dict(kind="grouped_gemm", shape=[ge, gm, gn, gk], dtype="float32",
                                flops=2.0 * ge * gm * gn * gk, bytes=4 * ge * (gm * gk + gk * gn + gm * gn),
                                seconds=sec, batch_dim=1 if gk != t else 3))
        del x, w, y, g, dx, dw
    return out


def bench_convs(timer: Timer, dev: torch.device, s: dict, batch: int) -> list[dict]:
    """Forward, and backward (input and weight gradients together), channels-last and contiguous, in bf16."""
    out = []
    for c_in, c_out, h, k, stride, groups in s["CONVS"]:
        for channels_last in (1, 0):
            fmt = torch.channels_last if channels_last else torch.contiguous_format
            x = torch.randn(batch, c_in, h, h, device=dev, dtype=torch.bfloat16).to(memory_format=fmt)
            w = torch.randn(c_out, c_in // groups, k, k, device=dev, dtype=torch.bfloat16).to(memory_format=fmt)
            y = F.conv2d(x, w, stride=stride, groups=groups)
            g = torch.randn_like(y)
            forward = timer(lambda: F.conv2d(x, w, stride=stride, groups=groups))
            backward = timer(lambda: torch.ops.aten.convolution_backward(
                g, x, w, None, [stride] * 2, [0, 0], [1, 1], False, [0, 0], groups, [True, True, False]))
            base = dict(kind="conv", dtype="bfloat16", channels_last=channels_last,
                        layer=[c_in, c_out, h, k, stride, groups])
            out += _conv_records(base, x, w, y, groups, forward, backward)
            del x, w, y, g
    return out


def _conv_records(base: dict, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, groups: int,
                  forward: float | None, backward: float | None) -> list[dict]:
    """A convolution's forward and backward records (what was measured of them) as implicit GEMMs per group:
    forward (M, N, K, groups, channels_last); backward as its two parts, input and weight gradients
    (OpRecord's "conv" shapes), over the forward's FLOPs twice."""
    c_in, c_out, channels_last = x.shape[1], y.shape[1], base["channels_last"]
    m_out, m_in = y.numel() // c_out, x.numel() // c_in
    kd = w[0].numel()  # C_in / groups x the kernel's elements
    flops = 2.0 * m_out * (c_out // groups) * kd * groups
    out = []
    if forward is not None:
        out.append(dict(base, phase="forward", shape=[m_out, c_out // groups, kd, groups, channels_last],
                        flops=flops, bytes=_nbytes(x, w, y), seconds=forward))
    if backward is not None:
        out.append(dict(base, phase="backward", flops=2 * flops, seconds=backward, bytes=2 * _nbytes(x, w, y),
                        parts=[[m_in, c_in // groups, max(1, round(flops / (2.0 * m_in * (c_in // groups) * groups))),
                                groups, channels_last],
                               [c_out // groups, kd, m_out, groups, channels_last]]))
    return out


def bench_grouped_convs(timer: Timer, dev: torch.device, s: dict, batch: int) -> list[dict]:
    """Grouped (not depthwise) convolutions in bf16 on contiguous tensors, forward and backward, recorded as
    kind "conv_grouped" with the conv records' fields (the fit reports them against the conv price)."""
    out = []
    for c_in, c_out, size, k, groups, dims in s["GROUPED_CONVS"]:
        shape = (batch, c_in, size) if dims == 1 else (batch, c_in, size, size)
        x = torch.randn(*shape, device=dev, dtype=torch.bfloat16)
        w = torch.randn(c_out, c_in // groups, *([k] * dims), device=dev, dtype=torch.bfloat16)
        pad = [k // 2] * dims
        conv = F.conv1d if dims == 1 else F.conv2d
        y = conv(x, w, padding=k // 2, groups=groups)
        g = torch.randn_like(y)
        forward = timer(lambda: conv(x, w, padding=k // 2, groups=groups))
        backward = timer(lambda: torch.ops.aten.convolution_backward(
            g, x, w, None, [1] * dims, pad, [1] * dims, False, [0] * dims, groups, [True, True, False]))
        base = dict(kind="conv_grouped", dtype="bfloat16", channels_last=0, layer=[c_in, c_out, size, k, groups, dims])
        out += _conv_records(base, x, w, y, groups, forward, backward)
        del x, w, y, g
    return out


def bench_resample(timer: Timer, dev: torch.device, s: dict, batch: int) -> list[dict]:
    """Bilinear resampling (F.interpolate, align_corners=False) in bf16, forward and backward: bytes moved per
    second, kind "resample" (the model prices it as a memory-bound copy; the fit reports the bandwidth)."""
    out = []
    for c, side_in, side_out in s["RESAMPLES"]:
        x = torch.randn(batch, c, side_in, side_in, device=dev, dtype=torch.bfloat16, requires_grad=True)
        y = F.interpolate(x, size=(side_out, side_out), mode="bilinear", align_corners=False)
        g = torch.randn_like(y)
        moved = _nbytes(x, y)
        forward = timer(lambda: F.interpolate(x, size=(side_out, side_out), mode="bilinear", align_corners=False))
        backward = timer(lambda: torch.autograd.grad(y, x, g, retain_graph=True))
        for phase, sec in (("forward", forward), ("backward", backward)):
            if sec is not None:
                out.append(dict(kind="resample", phase=phase, shape=[], dtype="bfloat16", flops=0.0, bytes=moved,
                                seconds=sec, layer=[c, side_in, side_out]))
        del x, y, g
    return out


def bench_attention(timer: Timer, dev: torch.device, s: dict) -> list[dict]:
    """SDPA forward + backward, (batch, 16 heads, seq, d), bf16: causal, not, and not causal with a float mask."""
    out = []
    dtype = torch.bfloat16
    for d in s["ATTENTION_DIMS"]:
        for seq in s["ATTENTION_SEQS"]:
            b, h = max(1, s["ATTENTION_TOKENS"] // seq), 16
            q, k, v = (torch.randn(b, h, seq, d, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
            g = torch.randn(b, h, seq, d, device=dev, dtype=dtype)
            variants = [(1, None), (0, None)]
            if seq <= 4096:
                variants.append((0, torch.zeros(1, 1, seq, seq, device=dev, dtype=dtype)))
            for causal, mask in variants:
                def step(causal=causal, mask=mask):
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=bool(causal))
                    o.backward(g)
                sec = timer(step, target_s=0.05)
                if sec is None:
                    continue
                traced = 2.0 * b * h * seq * seq * (d + d) + 2.0 * b * h * seq * seq * (3 * d + 2 * d)
                out.append(dict(kind="attention", shape=[b, h, h, seq, seq, d, d, causal, 0, int(mask is not None)],
                                dtype="bfloat16", flops=traced, bytes=8 * _nbytes(q), seconds=sec))
            del q, k, v, g
    return out


def bench_attention_compiled(timer: Timer, dev: torch.device, s: dict) -> list[dict]:
    """SDPA forward + backward with a boolean (batch, 1, q, k) mask, as a Hugging Face model builds it when its mask
    is not skipped (padding, or under torch.compile with torch < 2.14), eager and compiled (inductor on a GPU):
    what `masked_attention_factor` and the compiled-mask rule price. Shapes: BERT-base and GPT-2-1.5B's."""
    out = []
    backend = "inductor" if dev.type == "cuda" else "aot_eager"
    for b, h, seq, d in s["HF_ATTENTION"]:
        q, k, v = (torch.randn(b, h, seq, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        g = torch.randn(b, h, seq, d, device=dev, dtype=torch.bfloat16)
        mask = torch.ones(seq, seq, device=dev, dtype=torch.bool).tril().expand(b, 1, seq, seq)

        def attend(q, k, v, mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        for compiled in (0, 1):
            if compiled and not timer.quick and timer.remaining() < COMPILE_RESERVE_S:
                continue
            fn = torch.compile(attend, backend=backend, dynamic=False) if compiled else attend

            def step(fn=fn):
                fn(q, k, v, mask).backward(g)
            sec = timer(step, target_s=0.05)
            if sec is not None:
                traced = 2.0 * b * h * seq * seq * 2 * d + 2.0 * b * h * seq * seq * 5 * d
                out.append(dict(kind="attention", shape=[b, h, h, seq, seq, d, d, 0, 0, 1], dtype="bfloat16",
                                flops=traced, bytes=8 * _nbytes(q), seconds=sec, compiled=compiled, hf_mask=1))
        del q, k, v, g, mask
    return out


def bench_grouped(timer: Timer, dev: torch.device, s: dict) -> list[dict]:
    """torch._grouped_mm (tokens sorted by expert x experts' weights), bf16, tokens split evenly."""
    grouped = getattr(torch, "_grouped_mm", None)
    if grouped is None:
        return []
    out = []
    for e, m, n, k in s["GROUPED"]:
        a = torch.randn(e * m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(e, n, k, device=dev, dtype=torch.bfloat16).transpose(-2, -1)  # (E, K, N), K-major
        offs = torch.arange(m, e * m + 1, m, device=dev, dtype=torch.int32)
        try:
            sec = timer(lambda: grouped(a, w, offs=offs))
        except Exception as exc:  # no kernel for this device or version
            return [dict(kind="grouped_gemm", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")]
        if sec is not None:
            out.append(dict(kind="grouped_gemm", shape=[e, m, n, k], dtype="bfloat16", flops=2.0 * e * m * n * k,
                            bytes=_nbytes(a, w) + e * m * n * 2, seconds=sec, batch_dim=1))
        del a, w
    return out


def bench_elementwise(timer: Timer, dev: torch.device, s: dict) -> list[dict]:
    """Bytes read and written per second of eager memory-bound ops on large tensors."""
    out = []
    for numel in s["ELEMENTWISE_NUMEL"]:
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(numel, device=dev, dtype=dtype)
            y = torch.randn(numel, device=dev, dtype=dtype)
            rows = x.view(-1, 4096)
            for name, fn, moved in (("add", lambda: x + y, 3), ("gelu", lambda: F.gelu(x), 2),
                                    ("copy", lambda: x.clone(), 2),
                                    ("layer_norm", lambda: F.layer_norm(rows, (4096,)), 2)):
                sec = timer(fn)
                if sec is not None:
                    out.append(dict(kind="elementwise", op=name, shape=[], dtype=str(dtype)[6:], flops=0.0,
                                    bytes=moved * _nbytes(x), seconds=sec))
            del x, y, rows
    return out


# ---------------------------------------------------------------------------------------------------
# The fit: the time model's factors, through autopar.cost.ops
# ---------------------------------------------------------------------------------------------------
def _record(r: dict, shape: list | None = None, flops: float | None = None) -> OpRecord:
    return OpRecord(kind=r["kind"], backward=False, shape=tuple(shape if shape is not None else r["shape"]),
                    dtype=r["dtype"], count=1, flops=r["flops"] if flops is None else flops, bytes=int(r["bytes"]),
                    batch_dim=r.get("batch_dim", -1))


def _predicted(r: dict, device: DeviceSpec, cal: Calibration) -> float:
    """The model's seconds for a measured record (its rates for a bf16, eager plan; fp32 GEMMs: an fp32 plan)."""
    plan = autopar.Plan(precision="fp32" if r["dtype"] == "float32" else "bf16")
    rates = Rates.of(device, plan, cal)
    if r["kind"] == "conv" and r.get("phase") == "backward":
        return sum(op_seconds(_record(r, shape=p, flops=r["flops"] / 2), rates) for p in r["parts"])
    return op_seconds(_record(r), rates)


def _log_error(records: list[dict], device: DeviceSpec, cal: Calibration) -> float:
    errs = [math.log(_predicted(r, device, cal) / r["seconds"]) ** 2 for r in records]
    return sum(errs) / max(len(errs), 1)


def _fit_factors(records: list[dict], device: DeviceSpec, cal: Calibration, names: tuple[str, ...],
                 bounds: dict[str, tuple[float, float]], sweeps: int = 4) -> Calibration:
    """Coordinate descent in log space (golden-section search per factor) on the mean squared log error of
    the model's predicted seconds against the measured ones."""
    if not records:
        return cal
    for _ in range(sweeps):
        for name in names:
            lo, hi = (math.log(b) for b in bounds[name])
            for _ in range(30):
                a, b = lo + (hi - lo) * 0.382, lo + (hi - lo) * 0.618
                ea = _log_error(records, device, cal.replace(**{name: math.exp(a)}))
                eb = _log_error(records, device, cal.replace(**{name: math.exp(b)}))
                lo, hi = (lo, b) if ea < eb else (a, hi)
            cal = cal.replace(**{name: math.exp((lo + hi) / 2)})
    return cal


def _fit_scale_and_two(records: list[dict], device: DeviceSpec, cal: Calibration, scale: str,
                       shape: dict[str, tuple[float, float]], rounds: int = 7, points: int = 9) -> Calibration:
    """A rate factor `scale` (predicted seconds go as 1 / scale while compute-bound: its best value in closed
    form) and two shape factors (a grid in log space, zoomed in `rounds` times), on the mean squared log error."""
    base = getattr(cal, scale)
    records = [r for r in records  # compute-bound ones (where the rate, not the bytes, gives the time)
               if _predicted(r, device, cal) > 1.8 * _predicted(r, device, cal.replace(**{scale: 2 * base}))]
    if not records:
        return cal
    (a, (a_lo, a_hi)), (b, (b_lo, b_hi)) = shape.items()
    ranges = [math.log(a_lo), math.log(a_hi), math.log(b_lo), math.log(b_hi)]
    best = (float("inf"), cal)
    for _ in range(rounds):
        la, ha, lb, hb = ranges
        for i in range(points):
            for j in range(points):
                va, vb = la + (ha - la) * i / (points - 1), lb + (hb - lb) * j / (points - 1)
                trial = cal.replace(**{scale: 1.0, a: math.exp(va), b: math.exp(vb)})
                logs = [math.log(_predicted(r, device, trial) / r["seconds"]) for r in records]
                mean = sum(logs) / len(logs)
                err = sum((x - mean) ** 2 for x in logs) / len(logs)
                if err < best[0]:
                    best = (err, trial.replace(**{scale: math.exp(mean)}))
        ca, cb = math.log(getattr(best[1], a)), math.log(getattr(best[1], b))
        wa, wb = 2 * (ha - la) / (points - 1), 2 * (hb - lb) / (points - 1)
        ranges = [ca - wa, ca + wa, cb - wb, cb + wb]
    return best[1]


def fit(paths: str | list[str], as_device: str | None = None, *,
        on_defaults: bool = False) -> tuple[Calibration, list[str]]:
    """The factors fitted to one or more microbench JSON files (the first file's header names the device), and
    one line per factor: its value, from what, its error. `on_defaults`: the one-factor ratios (misaligned
    GEMMs, convolutions, grouped GEMMs) are fitted on top of autopar's default GEMM factors (fitted from real
    steps' kernel profiles) rather than on this fit's own, so that they can be dropped into the defaults."""
    files = [paths] if isinstance(paths, str) else list(paths)
    per_file = [[json.loads(x) for x in open(path)] for path in files]
    lines = [per_file[0][0]] + [r for part in per_file for r in part[1:]]
    header, records = lines[0], [r for r in lines[1:] if "seconds" in r]
    tiny = [r for r in records if r["seconds"] < MIN_SECONDS and r["kind"] != "elementwise"]
    records = [r for r in records if r not in tiny]
    device = autopar.Topology.from_spec(f"1x{as_device}").device if as_device else DeviceSpec.from_dict(header["spec"])
    arch = matmul_arch(device)
    cal, notes = Calibration(), []

    def kinds(kind: str, **match: Any) -> list[dict]:
        return [r for r in records if r["kind"] == kind and all(r.get(k) == v for k, v in match.items())]

    aligned = [r for r in kinds("gemm", dtype="bfloat16") if all(d % 8 == 0 for d in r["shape"][1:])]
    misaligned = [r for r in kinds("gemm", dtype="bfloat16") if r not in aligned and r["shape"][0] == 1]
    misaligned_bmm = [r for r in kinds("gemm", dtype="bfloat16") if r not in aligned and r["shape"][0] > 1]
    # the GEMM factors are stated Hopper-equivalent (autopar.cost.calibration.MatmulArch)
    cal = _fit_scale_and_two(aligned, device, cal, "matmul_efficiency",
                             {"matmul_half_width": (1.0, 2048.0), "matmul_rows_half": (1.0, 4096.0)})
    cal = cal.replace(matmul_efficiency=min(cal.matmul_efficiency, 1.0 / arch.efficiency_ratio))  # at most peak
    notes.append(_note(cal, aligned, device, ("matmul_efficiency", "matmul_half_width", "matmul_rows_half"),
                       f"{len(aligned)} bf16 GEMMs"))
    for name, recs, bounds in (
            ("misaligned_gemm_factor", misaligned, (0.02, 1.0)),
            ("misaligned_bmm_factor", misaligned_bmm, (0.02, 1.0)),
            ("conv_efficiency", kinds("conv", channels_last=1), (0.05, 1.5)),
            ("conv_nchw_factor", kinds("conv", channels_last=0), (0.05, 1.5)),
            ("grouped_gemm_efficiency", kinds("grouped_gemm", dtype="bfloat16"), (0.05, 1.5))):
        base = Calibration() if on_defaults else cal
        one = _fit_factors(recs, device, base, (name,), {name: bounds}, sweeps=1)
        cal = cal.replace(**{name: getattr(one, name)})
        notes.append(_note(one, recs, device, (name,), f"{len(recs)} records" + (", on the default GEMM factors"
                                                                                  if on_defaults else "")))
    fp32 = kinds("gemm", dtype="float32") + kinds("grouped_gemm", dtype="float32")  # SIMT: dense and per-expert
    cal = _fit_scale_and_two(fp32, device, cal, "fp32_matmul_efficiency",
                             {"fp32_matmul_half_depth": (1.0, 4096.0), "fp32_matmul_half_output": (1e3, 1e7)})
    notes.append(_note(cal, fp32, device, ("fp32_matmul_efficiency", "fp32_matmul_half_depth",
                                           "fp32_matmul_half_output"), f"{len(fp32)} fp32 GEMMs and expert loops"))
    hf = [r for r in kinds("attention") if r.get("hf_mask")]
    records = [r for r in records if not r.get("hf_mask")]
    unmasked = [r for r in kinds("attention") if not r["shape"][9]]
    names = ("attention_efficiency", "attention_half_keys", "attention_half_head_dim")
    cal = _fit_scale_and_two(unmasked, device, cal, "attention_efficiency",
                             {"attention_half_keys": (1.0, 4096.0), "attention_half_head_dim": (0.5, 512.0)})
    notes.append(_note(cal, unmasked, device, names, f"{len(unmasked)} SDPA calls (fwd + bwd)"))
    masked = [r for r in kinds("attention") if r["shape"][9]]
    cal = _fit_factors(masked, device, cal, ("masked_attention_factor",), {"masked_attention_factor": (0.05, 1.5)},
                       sweeps=1)
    notes.append(_note(cal, masked, device, ("masked_attention_factor",), f"{len(masked)} masked SDPA calls"))
    for r in hf:  # the Hugging Face mask layout, eager and compiled, against the model's masked price
        b, h, _, sq, _, d = r["shape"][:6]
        notes.append(f"SDPA with a boolean (batch, 1, q, k) mask, {'compiled' if r['compiled'] else 'eager'}, "
                     f"{b} x {h} heads x {sq} x {d}: {r['seconds'] * 1e3:.2f} ms, model "
                     f"{_predicted(r, device, cal) * 1e3:.2f} ms")
    bandwidth = [r["bytes"] / r["seconds"] / device.hbm_bytes_per_s for r in kinds("elementwise")]
    if bandwidth:
        notes.append(f"elementwise ops on large tensors: {statistics.median(bandwidth):.3f} of the datasheet HBM "
                     f"bandwidth (median of {len(bandwidth)}; min {min(bandwidth):.3f}, max {max(bandwidth):.3f}). "
                     "For information: memory_efficiency is what a training step's memory-bound kernels reach, "
                     "small ones and launch gaps included; fit it from measured steps, not from this.")
    for r in kinds("conv_grouped"):  # reported against the dense-convolution price, not fitted
        r = dict(r, kind="conv")
        c_in, c_out, size, k, groups, dims = r["layer"]
        notes.append(f"grouped conv{dims}d {c_in}->{c_out}, {groups} groups, kernel {k}, side {size}, {r['phase']}: "
                     f"{r['seconds'] * 1e3:.3f} ms, {r['flops'] / r['seconds'] / 1e12:.1f} TFLOP/s, model "
                     f"{_predicted(r, device, Calibration()) * 1e3:.3f} ms at the default calibration")
    for r in kinds("resample"):
        c, side_in, side_out = r["layer"]
        notes.append(f"bilinear {side_in}->{side_out}, {c} channels, {r['phase']}: {r['seconds'] * 1e3:.3f} ms, "
                     f"{r['bytes'] / r['seconds'] / device.hbm_bytes_per_s:.3f} of the datasheet HBM bandwidth "
                     "on its input and output")
    if tiny:
        notes.append(f"left out of the fit: {len(tiny)} kernels shorter than {MIN_SECONDS * 1e6:.0f} us (a kernel's "
                     "fixed cost, which the model does not price per kernel, dominates them)")
    errors = [r for r in lines[1:] if "error" in r]
    notes += [f"not measured: {r['kind']}: {r['error']}" for r in errors]
    return cal, notes


def _note(cal: Calibration, records: list[dict], device: DeviceSpec, names: tuple[str, ...], what: str) -> str:
    if not records:
        return f"{', '.join(names)}: no records, default kept"
    errs = [_predicted(r, device, cal) / r["seconds"] - 1 for r in records]
    values = ", ".join(f"{n}={getattr(cal, n):.4g}" for n in names)
    return (f"{values}  (from {what}; predicted/measured - 1: median {statistics.median(errs):+.1%}, "
            f"range {min(errs):+.1%} to {max(errs):+.1%})")


# ---------------------------------------------------------------------------------------------------
def measure(args: argparse.Namespace) -> int:
    dev = torch.device(args.device)
    shapes = {k: v for k, v in globals().items() if k.isupper() and k in QUICK}
    if args.quick:
        shapes.update(QUICK)
    if dev.type == "cuda":
        topo = autopar.Topology.detect()
        spec, name = topo.device, torch.cuda.get_device_name()
        torch.backends.cuda.matmul.allow_tf32 = False
    else:
        spec, name = autopar.Topology.cpu().device, "cpu"
    timer = Timer(dev, args.budget_s, args.quick)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "microbench_ops.json")
    header = dict(date=datetime.date.today().isoformat(), device=name, torch=torch.__version__,
                  command="python -m bench.microbench_ops " + " ".join(sys.argv[1:]), spec=spec.to_dict())
    t0 = time.perf_counter()
    with open(path, "w") as f:
        f.write(json.dumps(header) + "\n")
        sections = (("gemm", lambda: bench_gemms(timer, dev, shapes)),
                    ("gemm_fp32", lambda: bench_fp32_gemms(timer, dev, shapes)),
                    ("gemm_fp8", lambda: bench_fp8_gemms(timer, dev, shapes)),
                    ("bmm_attention", lambda: bench_bmm(timer, dev, shapes)),
                    ("grouped_gemm_fp32", lambda: bench_fp32_grouped(timer, dev, shapes)),
                    ("conv", lambda: bench_convs(timer, dev, shapes, 2 if args.quick else 64)),
                    ("conv_grouped", lambda: bench_grouped_convs(timer, dev, shapes, 2 if args.quick else 16)),
                    ("resample", lambda: bench_resample(timer, dev, shapes, 2 if args.quick else 16)),
                    ("attention", lambda: bench_attention(timer, dev, shapes)),
                    ("grouped_gemm", lambda: bench_grouped(timer, dev, shapes)),
                    ("elementwise", lambda: bench_elementwise(timer, dev, shapes)),
                    ("attention_hf_mask", lambda: bench_attention_compiled(timer, dev, shapes)))
        chosen = set(args.sections.split(",")) if args.sections else {name for name, _ in sections}
        unknown = chosen - {name for name, _ in sections}
        if unknown:
            raise SystemExit(f"unknown --sections {', '.join(sorted(unknown))}; the sections are "
                             f"{', '.join(name for name, _ in sections)}")
        for section, fn in ((name, fn) for name, fn in sections if name in chosen):
            s0 = time.perf_counter()
            try:
                recs = fn()
            except Exception as exc:  # a section that cannot run here is recorded, the others still run
                recs = [dict(kind=section, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")]
            for r in recs:
                f.write(json.dumps(r) + "\n")
            print(f"{section}: {len(recs)} records in {time.perf_counter() - s0:.1f} s", flush=True)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    print(f"wrote {path} in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".", help="directory for microbench_ops.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="a few tiny shapes (a smoke test)")
    ap.add_argument("--budget-s", type=float, default=180.0, help="measurements past this many seconds are skipped")
    ap.add_argument("--sections", default="", help="comma-separated sections to measure (default: all)")
    ap.add_argument("--fit", default=None, nargs="+", metavar="JSON",
                    help="fit the factors to files this wrote (the first one's device), and print them")
    ap.add_argument("--as-device", default=None, help="with --fit: price with this device spec (e.g. H200)")
    ap.add_argument("--on-defaults", action="store_true",
                    help="with --fit: fit the one-factor ratios on autopar's default GEMM factors")
    args = ap.parse_args()
    if args.fit:
        cal, notes = fit(args.fit, args.as_device, on_defaults=args.on_defaults)
        default = Calibration()
        changed = {f.name: getattr(cal, f.name) for f in dataclasses.fields(cal)
                   if isinstance(getattr(cal, f.name), float) and getattr(cal, f.name) != getattr(default, f.name)}
        print("\n".join(notes))
        print("Calibration(" + ", ".join(f"{k}={v:.4g}" for k, v in changed.items()) + ")")
        return 0
    return measure(args)


if __name__ == "__main__":
    sys.exit(main())
