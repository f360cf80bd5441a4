"""Seconds of the traced ops (autopar.profile's OpRecords) on one GPU, per op class: GEMMs by their M, N, K,
convolutions as their implicit GEMMs, attention by its query and key lengths and head dims, grouped GEMMs by
their mean group, memory-bound ops by their bytes; scaled to a plan's micro-batch and split by its tensor
parallelism. Every rate is the device's datasheet peak (or HBM bandwidth) times a calibration factor; each
factor says its source in autopar/cost/calibration.py. An op's time is the larger of its FLOPs over its rate
and its bytes over the achieved bandwidth (a roofline: depthwise convolutions and thin GEMMs are memory-bound).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from ..plans import Plan
from ..profile.model_profile import OpGroup, OpRecord
from ..topology import DeviceSpec
from .calibration import Calibration, matmul_arch

COMPUTE_KINDS = ("gemm", "conv", "attention", "grouped_gemm")
FUSED_KINDS = ("fused", "fused_weight")


@dataclass(frozen=True)
class Rates:
    """What one plan's ops run at on one GPU: peaks, GEMM shape factors, bandwidths."""

    bf16: bool  # tensor-core bf16 GEMMs (else fp32 SIMT GEMMs)
    fp32_weights: bool  # a bf16-weights trace timed for bf16 autocast over fp32 weights (no FSDP mixed precision):
    # ops autocast leaves alone that read the weights (grouped GEMMs) run in fp32, not as traced
    compiled: bool
    whole_graph: bool  # compiled as one graph with the model's own forward (one process, no pipeline): where a
    # Hugging Face model builds the masks it skips eagerly (autopar.profile.hf_masks); per-block compile (FSDP,
    # pipelines) builds them eagerly, outside the graphs, and skips them as the trace did
    peak: float  # datasheet dense FLOP/s of the plan's GEMMs (bf16 or fp32)
    conv_peak: float  # the same for convolutions (fp32: TF32, cuDNN's default)
    fp32_peak: float  # datasheet dense fp32 (SIMT) FLOP/s: GEMMs that run in fp32 under autocast
    gemm_eff: float  # best-GEMM fraction of peak, this architecture's
    gemm_half: float  # reduction depth at which a GEMM's rate halves; elements
    out_half: float  # output elements at which a GEMM's rate halves (the last wave's idle SMs)
    misaligned: float  # rate of an eager GEMM loading one element at a time (a leading dimension odd) / aligned:
    # `_misaligned` scales it by the elements it loads at once
    misaligned_bmm: float  # the same for a batched GEMM (cuBLAS's unaligned batched kernels; 1 compiled: padded)
    extern_misaligned_bmm: float  # the same for the batched GEMMs inductor does not pad (SDPA's math path)
    math_fp32_eff: float  # the math path's fp32 batched GEMMs / fp32 peak (Calibration.math_attention_fp32_efficiency)
    math_bytes: tuple[float, float]  # bytes a score element of the math path moves, (forward, backward)
    fp32_eff: float  # fp32 SIMT GEMMs' best fraction of the fp32 peak (fp32_matmul_efficiency)
    fp32_gemm_half: float  # reduction depth at which their rate halves; elements
    fp32_out_half: float  # output elements of one GEMM at which their rate halves; elements
    conv_eff: float  # cuDNN's implicit GEMM rate / a dense GEMM's of the same shape (channels-last)
    conv_nchw: float  # contiguous (NCHW) / channels-last convolution rate (1 compiled)
    depthwise_forward: float  # a depthwise convolution's FLOP/s forward (CUDA cores, channels-last)
    depthwise_backward: float  # ... of each of its backward's two parts
    depthwise_nchw: float  # contiguous (NCHW) / channels-last depthwise rate (1 compiled)
    misaligned_conv: float  # rate of a convolution whose input channels a group are not a multiple of 8 / aligned
    attention_eff: float
    attention_half_dim: float
    attention_half_keys: float
    masked_attention: float
    dropout_attention: float  # a fused attention forward with dropout / without (Calibration.dropout_attention_factor)
    fp32_attention_eff: float
    grouped_eff: float
    hbm: float  # achieved bytes/s of eager memory-bound kernels
    fused_hbm: float  # achieved bytes/s of inductor's fused kernels
    float8_peak: float = 0.0  # datasheet dense float8 FLOP/s (Plan.float8; 0: the plan has no float8 linears)
    float8_eff: float = 0.0  # a float8 GEMM's best fraction of that peak
    float8_cast_bytes: float = 0.0  # bytes a float8 linear's casts move per element of a GEMM's operands
    float8_shapes: frozenset = frozenset()  # the (out, in) weight shapes, each way round, of the layers a float8
    # plan converts (autopar.layout.float8_weight_shapes): only for the blocks' records (`in_blocks`)

    @classmethod
    def of(cls, device: DeviceSpec, plan: Plan, cal: Calibration, *, trace_precision: str = "bf16") -> "Rates":
        """`trace_precision`: the profile_precision of the trace whose records are timed ("bf16-pure": bf16
        weights, so a plan that autocasts over fp32 weights runs some of its ops in fp32)."""
        arch = matmul_arch(device)
        bf16 = plan.precision == "bf16"
        peak = device.peak_flops("bf16" if bf16 else "fp32")
        conv_peak = peak if bf16 or not device.supports("tf32") else device.peak_flops("tf32")
        return cls(bf16=bf16, fp32_weights=bf16 and not plan.uses_fsdp and trace_precision == "bf16-pure", compiled=plan.compile,
                   whole_graph=plan.compiles_whole_model, peak=peak, conv_peak=conv_peak,
                   fp32_peak=device.peak_flops("fp32"),
                   gemm_eff=cal.matmul_efficiency * arch.efficiency_ratio,
                   gemm_half=cal.matmul_half_width * arch.half_width_ratio,
                   out_half=cal.matmul_rows_half * 2048,  # the factor is stated as rows of a 2048-wide output
                   misaligned=1.0 if plan.compile else cal.misaligned_gemm_factor,
                   misaligned_bmm=1.0 if plan.compile else cal.misaligned_bmm_factor,
                   extern_misaligned_bmm=cal.misaligned_bmm_factor, math_fp32_eff=cal.math_attention_fp32_efficiency,
                   math_bytes=(cal.math_attention_bytes_forward, cal.math_attention_bytes_backward),
                   fp32_eff=cal.fp32_matmul_efficiency, fp32_gemm_half=cal.fp32_matmul_half_depth,
                   fp32_out_half=cal.fp32_matmul_half_output, conv_eff=cal.conv_efficiency,
                   # compiled, inductor makes convolutions channels-last (torch._inductor.config.layout_optimization)
                   conv_nchw=1.0 if plan.compile else cal.conv_nchw_factor,
                   depthwise_forward=device.peak_flops("fp32") * cal.depthwise_conv_efficiency,
                   depthwise_backward=device.peak_flops("fp32") * cal.depthwise_conv_backward_efficiency,
                   depthwise_nchw=1.0 if plan.compile else cal.depthwise_nchw_factor,
                   misaligned_conv=cal.misaligned_conv_factor,
                   attention_eff=cal.attention_efficiency * cal.matmul_efficiency * arch.efficiency_ratio,
                   attention_half_dim=cal.attention_half_head_dim, attention_half_keys=cal.attention_half_keys,
                   masked_attention=cal.masked_attention_factor, dropout_attention=cal.dropout_attention_factor,
                   fp32_attention_eff=cal.fp32_attention_efficiency,
                   grouped_eff=cal.grouped_gemm_efficiency,
                   hbm=device.hbm_bytes_per_s * cal.memory_efficiency,
                   fused_hbm=device.hbm_bytes_per_s * cal.fused_memory_efficiency,
                   float8_peak=device.peak_flops("fp8") if plan.float8 and device.supports("fp8") else 0.0,
                   float8_eff=cal.matmul_efficiency * arch.efficiency_ratio * cal.float8_matmul_efficiency_ratio,
                   float8_cast_bytes=(cal.float8_cast_bytes if plan.float8_recipe == "tensorwise"
                                      else cal.float8_rowwise_cast_bytes))

    def with_float8(self, shapes: frozenset) -> "Rates":
        """These rates for the blocks' records of a float8 plan: the GEMMs of weights of these shapes in float8."""
        return replace(self, float8_shapes=shapes) if self.float8_peak else self


@dataclass(frozen=True)
class TPSplit:
    """What tensor parallelism splits of a group's ops: the GEMMs of the layers it splits column-wise (their
    out features) and row-wise (their in features), by (in, out) features as autopar.layout pairs them;
    attention's heads and the batch of other activation GEMMs (attention's scores) in blocks that it splits;
    the vocabulary of the head (vocab-parallel) outside the blocks."""

    tp: int = 1
    colwise: frozenset[tuple[int, int]] = frozenset()
    rowwise: frozenset[tuple[int, int]] = frozenset()
    heads: bool = False
    vocab: int | None = None


@dataclass(frozen=True)
class OpsTime:
    """Seconds of one micro-batch's ops of a group, and its kernel launches."""

    compute_forward_s: float = 0.0  # GEMMs, convolutions, attention, grouped GEMMs
    compute_backward_s: float = 0.0
    memory_forward_s: float = 0.0  # memory-bound ops (eager), or what fusion leaves of them (compiled)
    memory_backward_s: float = 0.0
    launches: float = 0.0  # kernels: every traced op eager; compute ops and fused kernels compiled
    backward_launches: float = 0.0  # the backward's share of `launches`
    views: float = 0.0  # eager ops the host issues without the model's Python per op (the trace's "view" records:
    # views, reshapes, transposes; and "weight_cast": autocast's weight copies), at Calibration.view_host_s each;
    # none compiled
    backward_views: float = 0.0  # the backward's share of `views`
    convs: float = 0.0  # convolution calls (cuDNN's), of `launches`: at Calibration.conv_host_s more each
    backward_convs: float = 0.0  # the backward's share of `convs`

    def __add__(self, other: "OpsTime") -> "OpsTime":
        return OpsTime(*(a + b for a, b in zip(self._values(), other._values())))

    def times(self, k: float) -> "OpsTime":
        return OpsTime(*(a * k for a in self._values()))

    def memory_times(self, k: float) -> "OpsTime":
        """The same with the memory-bound time times `k` (a traffic factor)."""
        return replace(self, memory_forward_s=self.memory_forward_s * k, memory_backward_s=self.memory_backward_s * k)

    def _values(self) -> tuple[float, ...]:
        return (self.compute_forward_s, self.compute_backward_s, self.memory_forward_s, self.memory_backward_s,
                self.launches, self.backward_launches, self.views, self.backward_views, self.convs,
                self.backward_convs)

    @property
    def compute_s(self) -> float:
        return self.compute_forward_s + self.compute_backward_s

    @property
    def memory_s(self) -> float:
        return self.memory_forward_s + self.memory_backward_s


def gemm_fraction(depth: float, out: float, eff: float, half: float, out_half: float) -> float:
    """Fraction of the datasheet peak one bf16 GEMM reaches: eff x depth / (depth + half) x out / (out + out_half).
    depth: the reduction dimension; every output tile pays fixed costs (loading the first operands, the
    epilogue) that the reduction amortises. out: output elements; too few output tiles leave SMs idle in the
    last wave (NVIDIA Deep Learning Performance Guide, "Matrix multiplication background": tile and wave
    quantization)."""
    return eff * depth / (depth + half) * out / (out + out_half)


@functools.lru_cache(maxsize=4096)
def group_time(group: OpGroup, batch_scale: float, split: TPSplit, rates: Rates, traffic_scale: float) -> OpsTime:
    """One micro-batch of `group`'s ops: the records' batch-growing dims times `batch_scale` (the micro-batch
    over the traced sample), split by `split`; memory-bound bytes times `traffic_scale` (0.5: an fp32 trace
    for a bf16 plan). Cached: the search asks for the same groups under many plans."""
    total = OpsTime()
    for r in group.ops:
        total = total + _record_time(r, batch_scale, split, rates, traffic_scale)
    return total


def _record_time(r: OpRecord, scale: float, split: TPSplit, rates: Rates, traffic_scale: float) -> OpsTime:
    if r.kind == "gemm" and rates.float8_shapes and _weight_shape(r) in rates.float8_shapes:
        return _float8_gemm_time(r, scale, split, rates)
    if r.kind in COMPUTE_KINDS:
        shape, flops, nbytes = _scaled(r, scale, split)
        fp32 = r.kind == "grouped_gemm" and (r.dtype == "float32" or rates.fp32_weights)
        seconds = r.count * _compute_s(r.kind, shape, flops / r.count, nbytes / r.count, r.batch_dim, rates,
                                       r.backward, fp32)
        launches = float(r.count) * _kernels_per_call(r.kind, shape, rates, r.backward, fp32)
        convs = float(r.count) if r.kind == "conv" else 0.0
        return OpsTime(compute_backward_s=seconds, launches=launches, backward_launches=launches, convs=convs,
                       backward_convs=convs) if r.backward else \
            OpsTime(compute_forward_s=seconds, launches=launches, convs=convs)
    if r.kind == "weight_cast" and rates.compiled:
        # compiled, autocast's cast of a weight is a kernel of inductor's (its output feeds an extern GEMM, so it
        # fuses into nothing): its bytes at the fused bandwidth, a launch each (H200 kernel profiles,
        # bench/results/zoo_h200_profile_2026-12-01c.jsonl: the compiled ViTs' cast kernels)
        seconds = r.bytes * traffic_scale / rates.fused_hbm
        return OpsTime(memory_backward_s=seconds, launches=r.count, backward_launches=r.count) if r.backward else \
            OpsTime(memory_forward_s=seconds, launches=r.count)
    if r.kind in ("view", "weight_cast"):
        if rates.compiled:  # a view: inductor's graph runs none (a weight cast compiled: above)
            return OpsTime()
        # eager, a view: host time only; autocast's cast of a weight (issued by the dispatcher, no Python: host
        # time as a view's) and its bytes, once per micro-batch
        seconds = r.bytes * traffic_scale / rates.hbm
        return OpsTime(memory_backward_s=seconds, views=r.count, backward_views=r.count) if r.backward else \
            OpsTime(memory_forward_s=seconds, views=r.count)
    fused = r.kind in FUSED_KINDS
    if fused != rates.compiled:
        return OpsTime()
    grows = r.kind not in ("weight", "fused_weight")  # weight-shaped traffic is paid once per micro-batch
    seconds = r.bytes * (scale if grows else 1.0) * traffic_scale / (rates.fused_hbm if fused else rates.hbm)
    return OpsTime(memory_backward_s=seconds, launches=r.count, backward_launches=r.count) if r.backward else \
        OpsTime(memory_forward_s=seconds, launches=r.count)


def _weight_shape(r: OpRecord) -> tuple[int, ...]:
    """The (out, in) or (in, out) shape of the weight a GEMM record reads or makes (its weight_dims), else ()."""
    return tuple(int(r.shape[i]) for i in r.weight_dims) if len(r.weight_dims) == 2 else ()


def _float8_gemm_time(r: OpRecord, scale: float, split: TPSplit, rates: Rates) -> OpsTime:
    """A float8 linear's GEMM (Plan.float8): its FLOPs at the float8 rate (the bf16 GEMM's shape factors), and the
    casts of its two operands (float8_cast_bytes an element: the absolute maximum, the cast, the transposed copies)
    at the memory-bound bandwidth, fused when compiled; two more kernels a GEMM (the scale, the cast)."""
    shape, flops, _ = _scaled(r, scale, split)
    b, m, n, k = shape
    frac = gemm_fraction(k, b * m * n, rates.float8_eff, rates.gemm_half, rates.out_half)
    gemm_s = flops / (rates.float8_peak * frac) if flops else 0.0
    operands = r.count * (b * m * k + b * k * n)  # elements the GEMM reads: both operands, each call
    cast_s = rates.float8_cast_bytes * operands / (rates.fused_hbm if rates.compiled else rates.hbm)
    launches = 3.0 * r.count
    if r.backward:
        return OpsTime(compute_backward_s=gemm_s, memory_backward_s=cast_s, launches=launches,
                       backward_launches=launches)
    return OpsTime(compute_forward_s=gemm_s, memory_forward_s=cast_s, launches=launches)


def _kernels_per_call(kind: str, shape: list[float], rates: Rates, backward: bool, fp32: bool) -> float:
    """Kernels one traced call launches: the math path's GEMMs and softmax for attention compile leaves
    unfused; a GEMM a group for an fp32 grouped GEMM (the mm-per-group fallback); else one."""
    if _math_attention(kind, shape, rates):
        return _MATH_KERNELS[backward]
    if kind == "grouped_gemm" and (fp32 or not rates.bf16):
        return shape[0]
    return 1.0


def _scaled(r: OpRecord, scale: float, split: TPSplit) -> tuple[list[float], float, float]:
    """The record's shape, FLOPs and bytes for the plan's micro-batch on one TP rank."""
    shape = [float(s) for s in r.shape]
    flops, nbytes = r.flops, float(r.bytes)
    if r.batch_dim >= 0:
        fixed = min(nbytes, _fixed_bytes(r) * r.count)
        shape[r.batch_dim] *= scale
        flops, nbytes = flops * scale, fixed + (nbytes - fixed) * scale
    dim = _tp_dim(r, split)
    if dim is not None:
        shape[dim] /= split.tp
        flops, nbytes = flops / split.tp, nbytes / split.tp
    return shape, flops, nbytes


_ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


def _fixed_bytes(r: OpRecord) -> float:
    """The bytes of a compute op that do not grow with the batch: the operand (or, for a weight gradient, the
    output) without the batch's dimension: a GEMM's weight, a convolution's filter."""
    elem = _ELEMENT_BYTES.get(r.dtype, 2)
    s, grow = r.shape, r.batch_dim
    if r.kind in ("gemm", "grouped_gemm"):
        groups = s[0] if r.kind == "grouped_gemm" else 1
        other = {1: s[2] * s[3], 2: s[1] * s[3], 3: s[1] * s[2]}.get(grow, 0)  # (M, N, K): the other two
        return float(elem * groups * other)
    if r.kind == "conv":  # (M, N, K, groups): the filter is N x K (forward) or M x N (weight gradient) a group
        return float(elem * s[3] * (s[1] * s[2] if grow == 0 else s[0] * s[1]))
    return 0.0


def _tp_dim(r: OpRecord, split: TPSplit) -> int | None:
    """The index in `r.shape` that tensor parallelism divides, or None."""
    if split.tp <= 1:
        return None
    if r.kind == "attention":
        return 1 if split.heads and r.shape[1] % split.tp == 0 else None
    if r.kind != "gemm":
        return None
    if r.weight_dims:
        sizes = tuple(r.shape[i] for i in r.weight_dims)
        for features, side in ((split.colwise, 1), (split.rowwise, 0)):
            for f in features:
                if sorted(f) == sorted(sizes):
                    return next(i for i in r.weight_dims if r.shape[i] == f[side])
        if split.vocab is not None and split.vocab in sizes:
            return next(i for i in r.weight_dims if r.shape[i] == split.vocab)
        return None
    if split.heads:  # activation x activation in a split block: attention's scores and values, over the heads
        return 0 if r.shape[0] % split.tp == 0 and r.shape[0] > 1 else r.batch_dim if r.batch_dim >= 0 else None
    return None


def _compute_s(kind: str, shape: list[float], flops: float, nbytes: float, grow: int, rates: Rates,
               backward: bool = False, fp32: bool = False) -> float:
    """Seconds of one compute op: its FLOPs at its class's rate, or its bytes at the bandwidth if longer."""
    if kind == "gemm":
        rate = _gemm_rate(shape, grow, rates)
    elif kind == "conv":
        rate = _conv_rate(shape, backward, rates)
    elif kind == "grouped_gemm":
        rate = _grouped_rate(shape, rates, fp32)
        nbytes *= 2.0 if rates.fp32_weights else 1.0  # fp32 operands (traced in bf16: the bf16-weights trace)
    elif _math_attention(kind, shape, rates):
        return _unfused_attention_s(shape, backward, rates)
    else:
        flops, rate = _attention(shape, flops, rates, backward)
    return max(flops / rate if flops else 0.0, nbytes / rates.hbm)


_MATH_KERNELS = {False: 3, True: 6}  # kernels of one SDPA math-path call: forward 2 GEMMs and the softmax;
# backward 4 GEMMs, the softmax's backward and a cast (H200 kernel profiles of compiled BERT and ViT)


def _math_attention(kind: str, shape: list[float], rates: Rates) -> bool:
    """Compiled bf16, an attention call that is neither causal nor masked eagerly but gets a mask that only
    torch.compile builds (masked 2: a Hugging Face encoder's, autopar.profile.hf_masks) runs SDPA's math path
    (_unfused_attention_s)."""
    return kind == "attention" and rates.whole_graph and rates.bf16 and not shape[7] and shape[9] == 2


def _unfused_attention_s(shape: list[float], backward: bool, rates: Rates) -> float:
    """Compiled, an attention call that is neither causal nor masked eagerly (BERT's, ViT's, BART's encoder's)
    but whose mask Hugging Face builds under torch.compile (autopar.profile.hf_masks) runs SDPA's math path on
    the H200 (torch 2.11): inductor runs the call as
    batched GEMMs with the (q x k) scores in HBM between them, the scores and probabilities in fp32 (compiled
    BERT and ViT held 5.6 and 1.3 GiB more than their fused saved sets: autopar.profile.remat; their kernel
    profiles, bench/results/zoo_h200_profile_2026-12-01c.jsonl: 2 of a layer's 6 bmm's fp32 SIMT kernels, 4
    bf16, unpadded). Forward: S = Q K^T (bf16), O = P V (fp32); backward: dP = dO V^T, dV = P^T dO, dK = dS^T Q
    (bf16), dQ = dS K (fp32). bf16 GEMMs at their shapes' rates (misaligned_bmm_factor where a dimension is not
    a multiple of 8: inductor does not pad these); fp32 ones at math_attention_fp32_efficiency of the fp32 peak
    times their 128-row tiles' fill; the scores' traffic (math_attention_bytes_*: fp32 as they move between
    the kernels; what the step saves of them for backward is bf16, autopar.profile.remat) at inductor's fused
    bandwidth."""
    b, h, _, sq, sk, d, dv = shape[:7]
    bh = b * h
    if backward:
        bf16, fp32 = [(sq, sk, dv), (sk, dv, sq), (sk, d, sq)], [(sq, d, sk)]
    else:
        bf16, fp32 = [(sq, sk, d)], [(sq, dv, sk)]
    seconds = 0.0
    for m, n, k in bf16:
        rate = _gemm_rate([bh, m, n, k], 0, rates) * _misaligned(min(map(_alignment, (m, n, k))),
                                                                   rates.extern_misaligned_bmm)
        seconds += 2.0 * bh * m * n * k / rate
    for m, n, k in fp32:
        fill = m / (128.0 * math.ceil(m / 128.0))
        seconds += 2.0 * bh * m * n * k / (rates.fp32_peak * rates.math_fp32_eff * fill)
    return seconds + rates.math_bytes[backward] * bh * sq * sk / rates.fused_hbm


def _gemm_rate(shape: list[float], grow: int, rates: Rates) -> float:
    """(batch, M, N, K): depth K, output batch x M x N. Eager, a leading dimension (M, N or K other than the one
    the batch grows) that is not a multiple of 8 elements (16 bytes of bf16; GPT-2's vocabulary of 50257) runs
    cuBLAS's unaligned kernels (`misaligned_gemm_factor`; batched, `misaligned_bmm_factor`: attention's scores
    over 197 or 77 tokens); compiled, inductor pads it (torch._inductor.config.shape_padding). fp32: SIMT GEMMs
    (_fp32_gemm_rate)."""
    b, m, n, k = shape
    out = b * m * n
    if not rates.bf16:
        return _fp32_gemm_rate(out, k, rates)
    frac = gemm_fraction(k, out, rates.gemm_eff, rates.gemm_half, rates.out_half)
    align = min(_alignment(d) for i, d in ((1, m), (2, n), (3, k)) if i != grow)
    return rates.peak * frac * _misaligned(align, rates.misaligned_bmm if b > 1 else rates.misaligned)


def _fp32_gemm_rate(out: float, depth: float, rates: Rates) -> float:
    """An fp32 GEMM on CUDA cores (TF32 off, torch's default), FLOP/s: the fp32 peak times fp32_matmul_efficiency,
    less its depth loss (a K-deep reduction amortises each tile's loads over K) and its fill loss (an output of
    `out` elements leaves the last wave's SMs idle): K / (K + fp32_matmul_half_depth) x out / (out +
    fp32_matmul_half_output). H200 micro-benchmarks: 0.29 of peak at 128 x 2048 x 1024, 0.77 at 2048 x 4096 x
    14336 (bench/results/microbench_ops_h200_2026-12-02.json)."""
    return rates.fp32_peak * rates.fp32_eff * depth / (depth + rates.fp32_gemm_half) * out / (
        out + rates.fp32_out_half)


def _alignment(dim: float) -> int:
    """The elements a GEMM's kernel can load at once along `dim`: the largest power of 2 dividing it, up to 8."""
    d, align = round(dim), 1
    while align < 8 and d % (align * 2) == 0:
        align *= 2
    return align


def _misaligned(align: int, factor: float) -> float:
    """The rate of a GEMM whose leading dimensions load `align` elements at a time / an aligned one's (8):
    cuBLAS's unaligned kernels scale with their loads' width, `factor` (misaligned_gemm_factor: the 1-element
    case) times `align`. H200 kernel profiles: GPT-2's odd vocabulary (50257) at 0.16, BERT's even one (30522,
    2 elements) at 0.36 eagerly (bench/results/zoo_h200_profile_2026-12-01c.jsonl: its GEMMs' 21.7 ms)."""
    return 1.0 if align >= 8 else min(1.0, factor * align)


def _conv_rate(shape: list[float], backward: bool, rates: Rates) -> float:
    """(M, N, K, groups, channels_last[, input channels a group]): cuDNN's implicit GEMM at a dense GEMM's rate for its depth and output
    (all groups' outputs fill the SMs together) times conv_efficiency, and conv_nchw_factor for contiguous
    (NCHW) tensors, which cuDNN transposes around its NHWC tensor-core kernels. A depthwise convolution (fewer
    than 8 channels a group on the GEMM's M or N side: no tensor-core tile) runs cuDNN's direct CUDA-core kernel
    at depthwise_conv_(backward_)efficiency of the fp32 peak (depthwise_nchw_factor on NCHW tensors); a dense
    one whose input channels a group are not a multiple of 8 (an image's 3: the stem, a patch embedding) at
    misaligned_conv_factor forward (no vectorised loads; records without the channels count as aligned)."""
    m, n, k, groups, channels_last = shape[:5]
    if groups > 1 and min(m, n) < 8:
        rate = rates.depthwise_backward if backward else rates.depthwise_forward
        return rate * (1.0 if channels_last else rates.depthwise_nchw)
    eff = rates.gemm_eff if rates.bf16 else rates.fp32_eff
    frac = gemm_fraction(k, m * n * groups, eff, rates.gemm_half, rates.out_half) * rates.conv_eff
    if len(shape) > 5 and round(shape[5]) % 8 and not backward:
        frac *= rates.misaligned_conv
    return rates.conv_peak * frac * (1.0 if channels_last else rates.conv_nchw)


def _grouped_rate(shape: list[float], rates: Rates, fp32: bool) -> float:
    """(groups, M, N, K): the mean group's depth, every group's output together, times grouped_gemm_efficiency.
    Under bf16 autocast over fp32 weights a grouped GEMM runs in fp32: torch._grouped_mm is on none of CUDA
    autocast's lists (torch.amp docs), so it gets the fp32 expert weights (and transformers casts the tokens to
    them), and runs one fp32 GEMM a group (torch's mm-per-group fallback, aten GroupedBlas.cpp, or
    transformers' integrations/moe.py loop): each at the SIMT rate of its own shape (_fp32_gemm_rate; a group's
    M x N output fills the SMs alone). H200 micro-benchmarks of that loop at the zoo's MoE shapes: 0.45-0.79 of
    the fp32 peak (bench/results/microbench_ops_h200_2026-12-02.json)."""
    e, m, n, k = shape
    if not rates.bf16 or fp32:
        return _fp32_gemm_rate(m * n, k, rates)
    return rates.peak * gemm_fraction(k, e * m * n, rates.gemm_eff, rates.gemm_half, rates.out_half) * \
        rates.grouped_eff


def _attention(shape: list[float], flops: float, rates: Rates, backward: bool = False) -> tuple[float, float]:
    """(FLOPs executed, rate) of a fused attention kernel, (batch, heads, kv_heads, q_len, k_len, qk_dim, v_dim,
    causal, window, masked[, dropout]). Executed: the traced FLOPs (the full score matrix) times the keys each
    query sees (causal: the lower triangle, torch's top-left alignment; a window: at most window + 1). Rate: peak x
    attention_efficiency x d / (d + attention_half_head_dim) x keys / (keys + attention_half_keys) (a flash
    kernel's tile loop: its fixed costs per tile are amortised over the head dim and the keys), times
    masked_attention_factor with an explicit mask or bias (the memory-efficient or cuDNN kernel reading it), and
    a forward that draws a dropout mask times dropout_attention_factor. Compiled as one graph, a causal call whose
    mask only torch.compile builds (causal 2: a Hugging Face model's, autopar.profile.hf_masks) is masked and not
    causal. fp32: fp32 peak x fp32_attention_efficiency."""
    _, _, _, sq, sk, d, _, causal, window, masked = shape[:10]
    dropout = len(shape) > 10 and shape[10] and not backward
    masked = masked == 1  # 2: a mask only torch.compile builds (_math_attention's, when compiled whole)
    if causal == 2 and rates.whole_graph:
        causal, masked = 0, True
    keys = _keys_per_query(sq, sk, bool(causal), window)
    executed = flops * keys / sk
    if not rates.bf16:
        return executed, rates.peak * rates.fp32_attention_eff
    eff = rates.attention_eff * d / (d + rates.attention_half_dim) * keys / (keys + rates.attention_half_keys)
    return executed, rates.peak * eff * (rates.masked_attention if masked else 1.0) * \
        (rates.dropout_attention if dropout else 1.0)


def _keys_per_query(sq: float, sk: float, causal: bool, window: float) -> float:
    """The mean number of keys a query attends to."""
    if causal:
        keys = (sq + 1) / 2 if sq <= sk else (sk * (sk + 1) / 2 + (sq - sk) * sk) / sq
    else:
        keys = sk
    if window > 0:
        keys = min(keys, window + 1 if causal else 2 * window + 1)
    return max(keys, 1.0)


def op_seconds(record: OpRecord, rates: Rates) -> float:
    """Seconds of one record's ops as traced (its batch, no tensor parallelism): what bench/microbench_ops.py
    compares measured kernels with when it fits the factors."""
    t = _record_time(record, 1.0, TPSplit(), rates, 1.0)
    return t.compute_s + t.memory_s
