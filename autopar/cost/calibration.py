"""The cost model's measured factors: defaults from the H200 anchors, micro-benchmarks, fits from runs.

`Calibration` holds every factor the memory and time models multiply by; each field says what it is,
its unit, and where its default comes from. `measure(topology)` replaces the hardware factors with
micro-benchmarks (a few GEMM shapes, the HBM bandwidth, an all-reduce and an all-gather per mesh axis)
on the GPUs here; `fit(calibration, runs)` refits the efficiency factors from measured steps (what the
tuner does after every trial). No file I/O here: autopar.calibration_cache keeps both per topology.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from ..errors import AutoparError

if TYPE_CHECKING:  # annotations only (time.py imports this module)
    from ..topology import DeviceSpec, Topology
    from .time import TimeTerms

GiB = 2**30


@dataclass(frozen=True)
class Calibration:
    """Factors of the cost model; `source` says where the values in hand come from.

    Defaults marked "anchor fit" are fitted to 19 plain-PyTorch runs of GPT-2 (124M, 355M, 1.5B) and a
    Llama-1B shape on one NVIDIA H200 with torch 2.11 (../shared/anchors; bench/calibrate_anchors.py,
    bench/results/calibration_anchors_2026-11-29.json); "H200 kernel profile" marks values read off
    torch.profiler's kernel times of autopar-wrapped steps on the H200 (bench/profile_kernels.py,
    bench/results/kernels_h200_2026-11-29.jsonl); the others come from the sources named."""

    # --- memory ---------------------------------------------------------------------------------------
    context_bytes: float = 0.75 * GiB  # CUDA context and the libraries' handles, outside the caching allocator (cuBLAS
    # workspaces are inside it, in the reserve); bytes; H200, torch 2.11 + CUDA 13, measured: device memory in use
    # less torch.cuda.memory_reserved() = 0.749 GiB in all 14 runs of bench/results/zoo_h200_2026-12-01.jsonl
    reserve_bytes: float = 0.5 * GiB  # allocator reserve over the allocated peak, at the least (where no large
    # tensor is made, e.g. a pipeline stage without the head); bytes; H200, measured: the smallest reserve of the
    # bf16 validation steps (0.52 GiB, Llama-1B at 2 x 2048 tokens); above it the reserve follows the largest
    # tensor (largest_reserve_factor). The H200 zoo runs without a large tensor (ViT, ResNet, ConvNeXt, CLIP eager
    # and compiled, GPT-2 and BERT compiled) reserved 0.11-0.53 GiB over their peaks (zoo_h200_2026-12-01.jsonl)
    fragmentation_fraction: float = 0.0  # reserve growing with the allocated peak; fraction; H200, measured (none
    # beyond largest_reserve_factor's)
    largest_reserve_factor: float = 1.0  # allocator reserve over the allocated peak / the bytes of the largest tensor
    # freed before the peak, whose block the allocator keeps cached (the logits in the compute dtype where the
    # largest tensor is the loss's upcast copy of them, else the largest tensor; autopar.cost.memory); ratio; H200,
    # measured: 0.52 (GPT-2), 0.93 (Llama-1B shape), 2.2 (BERT) eager, 0.14-0.67 compiled
    # (bench/results/zoo_h200_2026-12-01.jsonl)
    transient_factor: float = 1.33  # copies of the largest tensor (the logits) alive beyond those saved; count;
    # anchor fit (fp32 runs) and the exact check on CPU (tests/cost/test_exact.py)
    upcast_transient_factor: float = 2.0  # the same where the largest tensor is an upcast copy (the loss's
    # logits.float() under autocast); count; the exact check of the H200 configurations (6.13 GiB of temporaries,
    # twice the fp32 logits, for Hugging Face GPT-2-355M at 16 x 1024 tokens)
    compile_activation_factor: float = 0.58  # only for profiles without the compiled partition (BlockProfile.
    # compiled_saved_bytes, autopar.profile.remat, which replaces it): compiled/eager saved activations; ratio;
    # anchor fit (GPT-2 and Llama shapes)
    compile_transient_factor: float = 0.61  # only for those profiles too: compiled/eager short-lived bytes (the
    # fused loss); ratio; anchor fit
    autocast_activation_factor: float = 1.0  # saved bytes of a GPU autocast run / the bf16 trace's; ratio; 1: the
    # trace applies CUDA autocast's float32 casts (autopar.profile.cuda_autocast.CudaAutocastPolicy); H200 runs within -0.4 to
    # +4.2% of the trace's prediction
    gradient_peak_fraction: float = 0.0004  # gradients alive at a single step's peak (backward start); ratio; anchor fit
    # --- time -----------------------------------------------------------------------------------------
    # The matmul factors are stated for Hopper (where the anchors ran); `matmul_arch` scales them to the GPU's
    # architecture. One GEMM reaches peak x matmul_efficiency x depth/(depth + matmul_half_width) x
    # out/(out + matmul_rows_half x 2048) (autopar.cost.time._gemm_fraction).
    matmul_efficiency: float = 0.79  # model GEMMs' bf16 rate / datasheet peak; ratio; H200 kernel profile (the
    # Linear GEMMs of GPT-2-355M at 8 x 1024 tokens and of Llama-1B at 4 x 2048 tokens ran at 760-770 TFLOP/s;
    # an 8192^3 GEMM alone at 788-812)
    float8_matmul_efficiency_ratio: float = 0.8  # a float8 GEMM's fraction of the float8 peak / a bf16 GEMM's of the
    # bf16 peak (Plan.float8); ratio; an assumption, not measured here: the float8 peak is twice bf16's on Hopper
    # (NVIDIA datasheets) and large float8 GEMMs reach about 1.6x bf16's rate there (torchao's float8
    # microbenchmarks); replace it by the H200's own (bench ops, section gemm_fp8)
    float8_cast_bytes: float = 3.5  # bytes a float8 linear's casts move per element of a GEMM's two operands
    # (Plan.float8, tensorwise scaling); bytes; counted: forward, the input and the weight each read twice (the
    # absolute maximum, then the cast) in bf16 and written once in float8 (5 a element); backward, the output's
    # gradient cast likewise (5) and the three float8 operands the backward GEMMs read transposed copied (2 each):
    # 7 bytes an element of (M x K + N x K + M x N) over the three GEMMs, whose operands sum to twice that
    float8_rowwise_cast_bytes: float = 6.0  # the same under rowwise scaling (Plan.float8_recipe="rowwise"); bytes;
    # counted as above: each of the three GEMMs scales its two operands along its own reduction axis, so all six
    # operands are cast from bf16 apart (5 bytes an element each: none is shared between GEMMs as tensorwise's
    # forward casts are), and the three backward operands copied transposed (2 each): 12 bytes an element of
    # (M x K + N x K + M x N), over operands summing to twice that; the GEMM rate is tensorwise's (an assumption)
    matmul_half_width: float = 40.0  # GEMM reduction depth at which the efficiency halves; elements; H200 kernel
    # profile (depths 1024 and 2048 ran at the same rate: the loss is small there)
    matmul_rows_half: float = 64.0  # rows (tokens) of a 2048-wide GEMM at which the efficiency halves (the
    # output tiles rows x width fill the SMs); tokens; H200 kernel profile (4096-16384 rows at the same rate)
    # Attention (autopar.cost.ops): a fused kernel's executed FLOPs (the keys each query sees: half the score
    # matrix when causal) at peak x matmul_efficiency x attention_efficiency x d / (d + attention_half_head_dim)
    # x keys / (keys + attention_half_keys), keys the mean keys a query attends to.
    attention_efficiency: float = 0.72  # flash attention's executed-FLOPs rate at an unbounded head dim and key
    # loop / the best GEMM's (matmul_efficiency: a software stack that reaches less in GEMMs reaches less here
    # too); ratio; H200 kernel profile, fwd + bwd SDPA kernel time, both causal, head dim 64: Llama-1B (4 x 2048
    # tokens) 3.85 TFLOP executed in 11.84 ms = 0.329 of peak, GPT-2-355M (8 x 1024) 1.44 TFLOP in 5.03 ms = 0.291
    attention_half_keys: float = 159.0  # mean keys per query at which attention's rate halves; keys; the same two
    # profiles (keys 1024.5 and 512.5: 0.329 / 0.291 = 1.13)
    attention_half_head_dim: float = 32.0  # head dim at which attention's rate halves; elements; assumed:
    # FlashAttention-2 (Dao 2023, Fig. 4-7) and FlashAttention-3 (Shah et al. 2024, Fig. 5) run about 1.2x faster
    # at head dim 128 than 64 (64/96 -> 128/160); bench/microbench_ops.py --fit measures it
    masked_attention_factor: float = 0.64  # attention with an explicit mask or bias / without, at equal executed
    # FLOPs; ratio; H200 kernel profile: compiled Hugging Face Llama-1B (its mask materialised, not causal) ran
    # its SDPA kernels in 34.55 ms where the model gives 22.1 ms unmasked (bench/results/kernels_h200_2026-11-29)
    dropout_attention_factor: float = 0.56  # a fused attention kernel's forward that draws a dropout mask / one that
    # does not, at equal executed FLOPs (its backward as fast: it regenerates the mask from the same seed); ratio;
    # H200 kernel profile of compiled GPT-2 124M (attn_pdrop 0.1, bench/results/zoo_h200_wrap_2026-12-02f.jsonl):
    # cuDNN's forward 5.33 ms against 2.98 modelled without dropout, its backward 7.58 against 7.44. Checked on the
    # profiles it was not read from (attention kernels fwd + bwd, measured / modelled without -> with it): GPT-2
    # eager 5.50 ms / 3.78 -> 4.63, BERT eager 4.73 / 3.78 -> 4.63, T5 compiled 2.54 / 1.48 -> 1.81, wav2vec2
    # eager 0.76 / 0.39 -> 0.48 (bench/results/zoo_h200_profile_2026-12-01c.jsonl, zoo_h200_wrap_2026-12-02b/c)
    fp32_attention_efficiency: float = 0.40  # fp32 attention's executed-FLOPs rate / fp32 peak (the memory-efficient
    # kernel: SIMT); ratio; H200 kernel profile, GPT-2-355M fp32 at 4 x 1024: 0.722 TFLOP executed in 27.29 ms
    conv_efficiency: float = 0.633  # cuDNN's implicit-GEMM convolution rate / a dense GEMM's of the same M, N, K,
    # channels-last; ratio; H200 micro-benchmarks (bench/results/microbench_ops_h200_2026-12-01.json), fitted as
    # bench.microbench_ops --fit does (log error) to the 13 dense channels-last convolutions there longer than
    # 30 us (shorter ones sit on the host's ~20 us launch floor); the fit file's 0.5946 took in those and the
    # depthwise ones, which the model now prices on their own (depthwise_conv_efficiency)
    conv_nchw_factor: float = 0.478  # a dense convolution on contiguous (NCHW) bf16 tensors / channels-last; ratio;
    # the same fit over the 18 dense NCHW records longer than 30 us (the fit file's 0.4511 with all of them)
    depthwise_conv_efficiency: float = 0.172  # a depthwise convolution's forward FLOP/s (cuDNN's direct CUDA-core
    # kernel: no tensor-core tile fits one channel a group) / the fp32 datasheet peak, channels-last; ratio; H200
    # micro-benchmark (bench/results/microbench_ops_h200_2026-12-01.json): 96 channels, 7 x 7, 56 x 56, batch 64:
    # 1.505 GFLOP in 130.5 us (the one depthwise forward there above the 20 us launch floor)
    depthwise_conv_backward_efficiency: float = 0.107  # the same for each of its backward's two parts (input and
    # weight gradients); ratio; the same record's backward: 3.01 GFLOP in 421.1 us
    depthwise_nchw_factor: float = 0.236  # a depthwise convolution on contiguous (NCHW) tensors / channels-last;
    # ratio; the same micro-benchmarks: 130.5/535.5 us (forward), 421.1/1925.7 and 93.7/383.1 us (backward)
    misaligned_conv_factor: float = 0.093  # a dense convolution's forward whose input channels a group are not a
    # multiple of 8 (an image's 3 channels: ResNet's 7 x 7 stem, ConvNeXt's 4 x 4 patch embedding) / an aligned
    # one; ratio; the same fit over those two layers' 4 forwards there (438.5/625.6 us and 130.1/105.9 us,
    # channels-last/NCHW; model within -43% to +46% of each)
    grouped_gemm_efficiency: float = 0.8  # torch._grouped_mm's rate / a dense GEMM's of its mean group's shape;
    # ratio; assumed (CUTLASS grouped GEMMs on Hopper); bench/microbench_ops.py --fit measures it
    math_attention_fp32_efficiency: float = 0.53  # the fp32 batched GEMMs of SDPA's math path (torch.compile of a
    # Hugging Face encoder, _unfused_attention_s) / the fp32 datasheet peak, at full 128-row tiles; ratio; H200
    # kernel profile (bench/results/zoo_h200_profile_2026-12-01c.jsonl): compiled BERT's 24 SIMT bmm's, 309 GFLOP
    # in 8.70 ms (ViT's, 197 rows: 23.6 TFLOP/s, the model 27 with its tiles' fill)
    math_attention_bytes_forward: float = 18.0  # HBM bytes a score element of SDPA's math path moves forward: the
    # fp32 scores written and read (8), the mask read (1), fp32 probabilities written and read (8), the dropout
    # mask (1); bytes; counted, and within 5% of the kernel profiles' totals (BERT 45, ViT 48 bytes both ways)
    math_attention_bytes_backward: float = 28.0  # the same backward: fp32 dP written and read, P read, dS written
    # and read twice (once by each GEMM), P's bf16 copy; bytes; counted as above
    misaligned_gemm_factor: float = 0.16  # eager bf16 GEMM with a dimension not a multiple of 8 / aligned; ratio;
    # H200 kernel profile (GPT-2's head, vocabulary 50257: cuBLAS's sm75 align1 kernels, 124 vs 770 TFLOP/s)
    misaligned_bmm_factor: float = 0.049  # the same for a batched bf16 GEMM (attention's scores over 197 or 77
    # tokens, eager or in SDPA's math path: cuBLAS's sm75 64 x 64 align1 batched kernels); ratio; H200
    # micro-benchmarks (bench/results/microbench_ops_h200_2026-12-02b.json: 14 unaligned score bmm's, 49-577
    # tokens, head dims 32-128, 14-83 TFLOP/s), fitted on the default GEMM factors by `python -m
    # bench.microbench_ops --fit bench/results/microbench_ops_h200_2026-12-0*.json --on-defaults`: median +8%,
    # range -58% to +147% (the shape's depth loss is steeper in these kernels than in the aligned ones)
    microbatch_overhead_s: float = 5e-4  # fixed cost per micro-batch (graph launches, hooks, loss); seconds
    fp32_matmul_efficiency: float = 0.78  # fp32 (no tensor cores, TF32 off) GEMM rate / fp32 peak, less the
    # depth and fill losses below; ratio; H200 micro-benchmarks (bench/results/microbench_ops_h200_2026-12-02.json:
    # 84 fp32 GEMMs, M 128-14336, N 1024-28672, K 128-14336, and 22 per-expert loops of transformers' fp32 MoE
    # fallback, with the 2026-12-01 file's 3), fitted with the two below by `python -m bench.microbench_ops --fit
    # bench/results/microbench_ops_h200_2026-12-01.json bench/results/microbench_ops_h200_2026-12-02.json`
    # (0.7825, 71.7, 2.503e5; predicted / measured - 1: median +1.2%, -36% to +37%): |measured / predicted - 1|
    # median 4.2%, worst 57% (M 128); a flat 0.78 had median 8.4%, worst 101%
    fp32_matmul_half_depth: float = 72.0  # reduction depth K at which an fp32 GEMM's rate halves (K 128: 0.29-0.57
    # of peak, K 1024 and more: 0.65-0.77); elements; the same fit
    fp32_matmul_half_output: float = 2.5e5  # output elements (M x N) of one fp32 GEMM at which its rate halves
    # (the last wave's idle SMs); elements; the same fit
    memory_efficiency: float = 0.6  # achieved / datasheet HBM bandwidth of memory-bound eager kernels; ratio; H200
    # kernel profile (the traced bytes of GPT-2-355M and Llama-1B bf16 steps moved at 2.9 TB/s by their
    # elementwise, reduction and copy kernels)
    eager_traffic_factor: float = 1.0  # eager kernels move the traced bytes; ratio
    fused_memory_efficiency: float = 0.84  # achieved / datasheet HBM bandwidth of inductor's fused kernels over the
    # bytes autopar.profile.fusion.FusionModel leaves them; ratio; H200 kernel profile, compiled Llama-1B at
    # 4 x 2048 tokens: 79.4 GB in 19.6 ms of memory-bound kernels
    compile_traffic_factor: float = 0.4  # without op records only (profiles from before them): compiled / eager
    # memory-bound time; ratio; anchor fit (0.4: the 7 compiled anchors within 12%)
    # Eager host time (autopar.cost.time.HostCosts): the four below are fitted together (grid, then coordinate
    # descent) to the measured eager steps of all 20 traced families of bench/results/zoo_h200_2026-12-01.jsonl
    # and the 18 eager Hugging Face GPT-2-355M / Llama-1B runs of validate_ and tune_h200_2026-11-29.jsonl at once
    # (objective: mean squared log step error, 0.0143 at 35/35/6/6 us -> 0.0124; backward / forward ratio 0.5,
    # 0.6, 0.7, 0.8, 1.0 give 0.0130, 0.0125, 0.0124, 0.0126, 0.0136), the backward costs tied to the forward's
    # by one ratio (0.7); prior: bench/results/microbench_ops_h200_2026-12-01.json's smallest ops, one aten call
    # from a Python loop without autograd, take 19-21 us (the floor a forward op from the model's Python sits on)
    launch_s: float = 45e-6  # CPU time per kernel of an eager step's forward (the model's Python, dispatch, autocast,
    # recording the autograd node); seconds; H200 host, the joint fit above
    backward_launch_s: float = 31.5e-6  # CPU time per kernel of an eager step's backward, which autograd's C++
    # engine issues without the model's Python (0.7 x launch_s); seconds; H200 host, the joint fit above
    view_host_s: float = 2.5e-6  # CPU time per forward op that launches no kernel: views, reshapes, transposes,
    # expands (the trace's "view" records) and autocast's weight casts ("weight_cast"); seconds; the joint fit above
    backward_view_host_s: float = 1.75e-6  # the same per backward view (0.7 x view_host_s); seconds; the joint fit
    # Compiled host time: the two below are fitted together (grid: 20-28 us x 30-60 us; objective: mean squared
    # log error) to the compiled steps the host bounds on the H200, each the geometric mean of its runs, which
    # vary by up to 1.5x between runs and machine leases (bench/results/zoo_h200_2026-12-01.jsonl,
    # zoo_h200_profile_2026-12-01c.jsonl, zoo_h200_hand_compile_2026-12-01d.jsonl, zoo_h200_wrap_2026-12-01d.jsonl;
    # and zoo_h200_wrap_2026-12-01c/e: measured 2026-12-01, result files since superseded; git show
    # 3650d5f:bench/results/zoo_h200_wrap_2026-12-01c.jsonl, 969688f:bench/results/zoo_h200_wrap_2026-12-01e.jsonl):
    # Swin-T 24.1 ms (19.3, 29.9; GPU busy 14.0), CLIP ViT-B/32 37.5 ms (31.6, 44.6; busy 22.6), ResNet-50 24.3 ms
    # (Hugging Face's and torchvision's, six runs 20.3-27.7; busy 11.3) and ConvNeXt-T 21.8 ms (19.7-25.5): at
    # 24 / 40 us -8%, +7%, -3%, -10% (34.5 / 0 us before: +25%, +51%, +0%, +6%); the compiled steps the GPU
    # bounds (ViT-B, BERT, GPT-2 at batch 16) hardly move. A miss kept: GPT-2-355M at one sample a micro-batch
    # (35.0 ms a micro-batch for 1195 counted kernels, tune_h200_2026-11-29.jsonl) needs 29 us a kernel
    compiled_kernel_launch_s: float = 24e-6  # CPU time per kernel of a compiled step (compute ops, the fused
    # kernels autopar.profile.fusion.FusionModel counts, a kernel per weight cast: inductor's Python wrapper, the
    # launch, autograd, guards); seconds; H200 host, the fit above (the profiler's own count on CLIP: 16.6 ms in
    # its two graphs for 1769 kernels, 9.4 us each, plus the step's per-parameter work outside them)
    graph_kernel_launch_s: float = 1e-6  # per kernel of a compiled step replayed as a CUDA graph (Plan.cuda_graphs):
    # the host launches the graph once, the GPU its kernels; seconds; NVIDIA's "Getting Started with CUDA Graphs"
    # (2019): about 3.4 us a kernel in a graph for kernels of about 2.9 us (3.8 us a kernel from a stream);
    # not yet measured on the H200 (the tuner's trials measure these plans)
    conv_host_s: float = 40e-6  # CPU time per convolution call beyond its kernel launch: cuDNN's own (the frontend's
    # plan lookup and execute), eager or compiled; seconds; the fit above; prior: PyTorch PR #51390 timed one small
    # convolution through cuDNN's v8 API at 52 us of host time a call
    compile_launch_factor: float = 0.55  # without op records only: CPU time per traced op compiled / eager; ratio;
    # the same runs compiled (18-23 us per traced op)
    comm_efficiency: float = 0.75  # NCCL bus bandwidth / NVLink bandwidth in a node; ratio; nccl-tests (H100/H200:
    # ~370 of 450 GB/s a direction; A100: ~230 of 300)
    network_efficiency: float = 0.94  # NCCL bus bandwidth / network line rate across nodes; ratio; NCCL maintainers
    # in nccl/nccl-tests issues: 46-48 GB/s measured per 400 Gb/s (50 GB/s) InfiniBand NDR NIC
    comm_latency_s: float = 15e-6  # per collective; seconds; NCCL ring latency on NVLink
    fsdp_overlap: float = 0.85  # share of FSDP communication hidden behind compute; ratio; FSDP2 prefetching
    optimizer_memory_efficiency: float = 0.73  # achieved / datasheet HBM bandwidth of fused AdamW's multi-tensor
    # kernels over optimizer_bytes_per_param; ratio; H200 kernel profiles of 16 zoo families of 86M-6.9B
    # parameters (bench/results/zoo_h200_profile_2026-12-01c.jsonl, zoo_h200_wrap_2026-12-01d.jsonl,
    # zoo_h200_wrap_2026-12-02b/c/d.jsonl): 0.70-0.77, median 0.73; below 30M parameters
    # (ResNet-50, Swin-T: many small tensors) 0.48-0.56, under 0.4 ms a step
    optimizer_bytes_per_param: float = 28.0  # fused AdamW reads/writes per parameter (fp32 w, g, m, v); bytes
    pcie_bytes_per_s: float = 25e9  # host-device copies for CPU offload; bytes/s; PCIe gen5 x16 achieved
    cpu_adam_bytes_per_s: float = 10e9  # CPU Adam step bandwidth; bytes/s; torch CPU AdamW (foreach)
    zero_bubble_factor: float = 1 / 3  # bubble of a zero-bubble schedule / 1F1B's; ratio; Qi et al. 2023 (ZB-H1)
    # --- provenance -----------------------------------------------------------------------------------
    source: str = "defaults (fit to H200 anchors; datasheets)"
    topology_fingerprint: str | None = None
    fitted_runs: int = 0
    extra: Mapping[str, float] = field(default_factory=dict)  # measured micro-benchmarks (GEMM rates, links)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not value >= 0:
                raise ValueError(f"Calibration.{f.name} must be a non-negative number, got {value!r}.")
        object.__setattr__(self, "extra", dict(self.extra))

    def replace(self, **changes: Any) -> "Calibration":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["extra"] = dict(self.extra)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Calibration":
        if not isinstance(data, Mapping):
            raise AutoparError("a calibration must be a mapping of factor names to numbers.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise AutoparError(f"unknown calibration factor(s) {', '.join(unknown)}.")
        values = {}
        for k, v in data.items():
            if k in ("source", "topology_fingerprint"):
                if v is not None and not isinstance(v, str):
                    raise AutoparError(f"calibration {k} must be a string.")
                values[k] = v
            elif k == "fitted_runs":
                values[k] = int(v)
            elif k == "extra":
                if not isinstance(v, Mapping) or not all(isinstance(x, (int, float)) for x in v.values()):
                    raise AutoparError("calibration extra must map names to numbers.")
                values[k] = {str(a): float(b) for a, b in v.items()}
            else:
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise AutoparError(f"calibration {k} must be a number, got {v!r}.")
                values[k] = float(v)
        return cls(**values)


# ---------------------------------------------------------------------------------------------------
# GEMM rates by GPU architecture, relative to the anchors' (Hopper, sm90)
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MatmulArch:
    """How one GPU architecture's bf16 GEMMs differ from Hopper's (where the matmul factors are fitted)."""

    mamf_fraction: float  # best dense bf16 GEMM rate / datasheet peak (maximum achievable matmul FLOPS); ratio
    flops_per_clock_per_sm: int  # dense bf16 tensor-core FLOPs per clock per SM; FLOP
    source: str

    @property
    def efficiency_ratio(self) -> float:
        """Scales Calibration.matmul_efficiency (fitted on Hopper) to this architecture's best GEMMs."""
        return self.mamf_fraction / _HOPPER.mamf_fraction

    @property
    def half_width_ratio(self) -> float:
        """Scales Calibration.matmul_half_width: a GEMM tile's fixed costs (first operand loads, the epilogue)
        take about as many clocks on every generation while the main loop's work per clock grows with the
        SM's tensor rate, so the reduction depth that amortises them grows in proportion."""
        return self.flops_per_clock_per_sm / _HOPPER.flops_per_clock_per_sm


_HOPPER = MatmulArch(
    0.821, 4096,
    "H200: 812 of 989 TFLOP/s on an 8192^3 bf16 GEMM (measured here, shared/anchors); H100 SXM 794.5 (80.3%), "
    "GH200 828.6 (83.8%) in S. Bekman's MAMF table (ml-engineering, compute/accelerator); 4 tensor cores x "
    "512 FMA x 2 per clock per SM (989e12 = 132 SMs x 1.83 GHz x 4096)")
#: By CUDA compute capability (major, minor); architectures not listed use Hopper's figures.
MATMUL_ARCH: dict[tuple[int, int], MatmulArch] = {
    (8, 0): MatmulArch(
        0.869, 2048,
        "A100 SXM: 271.2 of 312 TFLOP/s (86.9%, S. Bekman's MAMF table, torch 2.6); 4 tensor cores x 256 FMA x 2 "
        "per clock per SM (312e12 = 108 SMs x 1.41 GHz x 2048; NVIDIA A100 whitepaper)"),
    (9, 0): _HOPPER,
    (10, 0): MatmulArch(
        0.776, 8192,
        "B200: about 1745 of 2250 TFLOP/s (77.6%, S. Bekman's ml-engineering); 2.25e15 / (148 SMs x ~1.86 GHz) "
        "~ 8192 per clock per SM, twice Hopper's"),
}


def matmul_arch(device: DeviceSpec | None) -> MatmulArch:
    """The GEMM factors of a DeviceSpec's architecture (Hopper's for CPUs and unlisted GPUs)."""
    return MATMUL_ARCH.get(getattr(device, "compute_capability", None) or (0, 0), _HOPPER)


# ---------------------------------------------------------------------------------------------------
# Micro-benchmarks on the GPUs here
# ---------------------------------------------------------------------------------------------------
def _time_cuda(fn: Callable[[], Any], reps: int) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def measure(topology: Topology, base: Calibration | None = None, *, shapes: Sequence[int] = (1024, 2048, 4096, 8192)
            ) -> Calibration:
    """Micro-benchmarks on this GPU: bf16 GEMMs of several sizes (fits matmul_efficiency and
    matmul_half_width), a device-to-device copy (memory_efficiency), and, in a process group of several
    ranks, an all-reduce (comm_efficiency inside a node, network_efficiency across nodes). Needs a CUDA GPU."""
    if not torch.cuda.is_available():
        raise AutoparError("calibration micro-benchmarks need a CUDA GPU; plan with the defaults instead.")
    base = base or Calibration()
    peak = topology.device.peak_flops("bf16")
    extra: dict[str, float] = {}
    effs = []
    for n in shapes:
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        dt = _time_cuda(lambda: a @ b, reps=max(3, int(2e12 / (2 * n**3)) or 3))
        rate = 2 * n**3 / dt
        extra[f"gemm_bf16_{n}_flops"] = rate
        out_half = base.matmul_rows_half * 2048  # the fill loss of an n x n output (autopar.cost.time)
        effs.append((n, rate / peak * (n * n + out_half) / (n * n)))
        del a, b
    # eff(n) = e * n / (n + h) once the fill loss is taken out: fit h from the smallest and largest shapes
    (n0, e0), (n1, e1) = effs[0], effs[-1]
    # e0 (n0 + h) / n0 = e1 (n1 + h) / n1  =>  h = (e1 - e0) / (e0 / n0 - e1 / n1)
    denominator = e0 / n0 - e1 / n1
    arch = matmul_arch(topology.device)
    half = (e1 - e0) / denominator if denominator > 0 and e1 > e0 else base.matmul_half_width * arch.half_width_ratio
    half = min(max(half, 1.0), 8192.0)
    e_max = e1 * (n1 + half) / n1
    # Stored as Hopper-equivalent factors: the time model scales them back by this GPU's architecture.
    e_max, half = e_max / arch.efficiency_ratio, half / arch.half_width_ratio
    numel = 256 * 2**20
    x = torch.empty(numel, device="cuda", dtype=torch.float32)
    y = torch.empty_like(x)
    dt = _time_cuda(lambda: y.copy_(x), reps=10)
    extra["copy_bytes_per_s"] = 2 * x.numel() * 4 / dt
    mem_eff = min(1.0, extra["copy_bytes_per_s"] / topology.device.hbm_bytes_per_s)
    changes: dict[str, Any] = dict(matmul_efficiency=min(e_max, 1.0), matmul_half_width=half, memory_efficiency=mem_eff)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.empty(64 * 2**20, device="cuda", dtype=torch.bfloat16)
        w = dist.get_world_size()
        dt = _time_cuda(lambda: dist.all_reduce(t), reps=5)
        bus = 2 * (w - 1) / w * t.numel() * 2 / dt
        extra["allreduce_bus_bytes_per_s"] = bus
        spans = w > topology.devices_per_node  # the world's ranks fill a node before the next
        per_node = max(1, w // topology.num_nodes) if spans else 1
        link = topology.link_bytes_per_s(w, spans_nodes=spans, ranks_per_node=per_node)
        network_binds = spans and link < topology.device.intra_node_bytes_per_s  # as time._group_bandwidth
        changes["network_efficiency" if network_binds else "comm_efficiency"] = min(1.0, bus / link)
    return base.replace(source=f"measured on {torch.cuda.get_device_name()}", extra=extra, **changes)


# ---------------------------------------------------------------------------------------------------
# Refitting the time model from measured steps
# ---------------------------------------------------------------------------------------------------
def fit(cal: Calibration, runs: Sequence[tuple[TimeTerms, float]], *, min_runs: int = 2) -> Calibration:
    """Refit the time model's efficiencies to measured steps: `runs` is [(TimeTerms, measured step_s)],
    the terms `autopar.cost.time.time_terms` returns for each run's plan. A non-negative least-squares
    fit of the step time to those terms (one coefficient each, starting from the current calibration)
    gives the new inverse efficiencies; fewer than `min_runs` runs change nothing."""
    if len(runs) < min_runs:
        return cal
    names = ("matmul", "memory", "launch")
    rows, target = [], []
    for terms, measured in runs:
        rows.append([getattr(terms, n) for n in names])
        target.append(measured - terms.fixed_s)
    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(target, dtype=torch.float64).unsqueeze(1)
    coef = _nnls(a, b)
    scale = {n: float(c) for n, c in zip(names, coef)}
    changes: dict[str, Any] = {}
    if scale["matmul"] > 0:
        changes["matmul_efficiency"] = min(1.0, cal.matmul_efficiency / scale["matmul"])
        changes["fp32_matmul_efficiency"] = min(1.0, cal.fp32_matmul_efficiency / scale["matmul"])
    if scale["memory"] > 0:
        changes["memory_efficiency"] = min(1.0, cal.memory_efficiency / scale["memory"])
    changes["launch_s"] = cal.launch_s * scale["launch"]
    changes["view_host_s"] = cal.view_host_s * scale["launch"]
    changes["backward_launch_s"] = cal.backward_launch_s * scale["launch"]
    changes["backward_view_host_s"] = cal.backward_view_host_s * scale["launch"]
    return cal.replace(source=f"fitted to {len(runs)} measured steps", fitted_runs=cal.fitted_runs + len(runs),
                       **changes)


def _nnls(a: torch.Tensor, b: torch.Tensor, iters: int = 200) -> list[float]:
    """Non-negative least squares by projected gradient (a handful of unknowns)."""
    x = torch.linalg.lstsq(a, b).solution.clamp(min=0)
    lip = float(torch.linalg.matrix_norm(a.T @ a, ord=2)) or 1.0
    for _ in range(iters):
        x = (x - (a.T @ (a @ x - b)) / lip).clamp(min=0)
    return [float(v) for v in x.squeeze(1)]


# ---------------------------------------------------------------------------------------------------
# What a refit may change, and the bounds a refit must keep to before it is stored
# ---------------------------------------------------------------------------------------------------
#: The factors a refit from measured steps changes (`fit`, and autopar.tune.refit's common scale). They are
#: fitted to one script's measured steps, so they describe that model and script on this hardware (its GEMM
#: shapes and kernels, its Python and host work, whatever else its timed steps do), not the hardware alone:
#: autopar.calibration_cache keeps them per model. Every other factor is hardware-wide (datasheets, the
#: anchors' defaults, `measure`'s micro-benchmarks) and is kept per topology.
MODEL_FACTORS = ("matmul_efficiency", "fp32_matmul_efficiency", "memory_efficiency", "launch_s", "backward_launch_s",
                 "view_host_s", "backward_view_host_s")
#: Of those, the achieved fractions of a datasheet peak (FLOP/s, HBM bytes/s): at most 1 on a GPU.
PEAK_FRACTIONS = ("matmul_efficiency", "fp32_matmul_efficiency", "memory_efficiency")
#: A refit moves no factor by more than this ratio, either way, from the calibration it starts from. The defaults
#: predict the H200 validation steps within 15% (median 4-17% over the zoo, worst -47%: docs/cost_model.md), runs
#: vary by up to 1.5x between machine leases, and a GPU clocked or power-capped below its datasheet figure rarely
#: reaches 2x; 4x covers those together and the CPU figures, which are nominal (a 2-process CPU study moved them
#: 3.2x: docs/tuning.md), while a script whose timed steps are not the modelled step (the issue-11 study: 100x)
#: lies far outside. Many agreeing trials do not widen it: a constant cost outside the step (data loading, a
#: host-bound loop) makes every trial agree on the same wrong scale.
MAX_REFIT_RATIO = 4.0
#: A refit is stored only if it predicts its own measured steps within this mean |predicted / measured - 1|:
#: the defaults' own error on validation runs is within 15% (docs/cost_model.md), so a fit that stays above 25%
#: does not explain the trials, and storing it would mislead every later plan of the model.
MAX_REFIT_RESIDUAL = 0.25
#: What a refit out of bounds most likely means, in the rejection's one line.
REFIT_CAUSE = ("the measured script is probably not the modelled step (data loading, a host-bound loop, logging "
               "or synchronisation in the timed steps): time only the training step, or keep the defaults")
#: ... where the factor says the steps ran faster than modelled (a helper saw the slower cause given for CPU steps
#: 2-13x faster than predicted: CPU peaks are nominal).
FASTER_CAUSE = ("the measured steps ran faster than the cost model can explain (a device its defaults do not "
                "describe, as a CPU's nominal peaks, or a step that does less work than the traced one): keep the "
                "defaults")


class RefitProblem(enum.Enum):
    OUT_OF_BOUNDS = "out of bounds"  # a factor outside its bound
    RESIDUAL = "residual"  # the refit does not explain the measured steps


@dataclass(frozen=True)
class RefitRejection:
    """Why a refit was not stored. `fitted`, `low` and `high` are in the factor's unit (its name says it: `*_s`
    seconds, `*_efficiency` a fraction of the datasheet peak; for the residual, a mean |predicted/measured - 1|)."""

    problem: RefitProblem
    factor: str  # the Calibration field out of bounds, or "residual"
    fitted: float
    low: float
    high: float
    runs: int  # measured steps the refit was fitted to

    def __post_init__(self) -> None:
        if not isinstance(self.problem, RefitProblem):
            raise ValueError(f"RefitRejection.problem must be a RefitProblem, got {self.problem!r}.")
        if self.factor not in MODEL_FACTORS + ("residual",):
            raise ValueError(f"RefitRejection.factor must be one of {', '.join(MODEL_FACTORS)} or 'residual', "
                             f"got {self.factor!r}.")
        if not (0 <= self.low <= self.high) or self.low <= self.fitted <= self.high:
            raise ValueError(f"RefitRejection: {self.fitted!r} is no rejection for the bound [{self.low!r}, "
                             f"{self.high!r}].")
        if isinstance(self.runs, bool) or not isinstance(self.runs, int) or self.runs < 1:
            raise ValueError(f"RefitRejection.runs must be a positive integer, got {self.runs!r}.")

    def message(self) -> str:
        """The one line a study warns with."""
        if self.problem is RefitProblem.RESIDUAL:
            what = (f"it predicts its {self.runs} measured steps within {self.fitted:.0%} on average, above the "
                    f"{self.high:.0%} a stored refit must reach")
        else:
            capped = " and at most the GPU's datasheet peak" if self.factor in PEAK_FRACTIONS and self.high == 1 else ""
            what = (f"{self.factor} fitted to {self.fitted:.3g} is outside [{self.low:.3g}, {self.high:.3g}] "
                    f"(within {MAX_REFIT_RATIO:g}x of its value before the refit{capped})")
        return f"calibration refit not stored: {what}; {FASTER_CAUSE if self.faster else REFIT_CAUSE}."

    @property
    def faster(self) -> bool:
        """Whether the factor says the steps ran faster than modelled: an efficiency above its bound, or a time
        (`*_s`) below it."""
        if self.problem is RefitProblem.RESIDUAL:
            return False
        return self.fitted > self.high if self.factor.endswith("_efficiency") else self.fitted < self.low


def refit_bounds(prior: Calibration, *, is_gpu: bool) -> dict[str, tuple[float, float]]:
    """Each MODEL_FACTORS factor's bound for a refit starting at `prior`: within MAX_REFIT_RATIO of its value
    there, and a peak fraction at most 1 on a GPU (a datasheet peak is an upper bound; CPU peaks are nominal)."""
    out = {}
    for name in MODEL_FACTORS:
        value = getattr(prior, name)
        low, high = value / MAX_REFIT_RATIO, value * MAX_REFIT_RATIO
        if is_gpu and name in PEAK_FRACTIONS:
            high = min(high, 1.0)
        out[name] = (low, max(low, high))
    return out


def check_refit(prior: Calibration, fitted: Calibration, *, runs: int, residual: float,
                is_gpu: bool) -> RefitRejection | None:
    """Why `fitted` (a refit from `prior` to `runs` measured steps, predicting them within `residual`, the mean
    |predicted / measured - 1|) must not be stored, or None: a factor out of `refit_bounds`, else the residual
    above MAX_REFIT_RESIDUAL."""
    for name, (low, high) in refit_bounds(prior, is_gpu=is_gpu).items():
        value = getattr(fitted, name)
        if not low <= value <= high:
            return RefitRejection(RefitProblem.OUT_OF_BOUNDS, name, float(value), low, high, runs)
    if not residual <= MAX_REFIT_RESIDUAL:
        return RefitRejection(RefitProblem.RESIDUAL, "residual", float(residual), 0.0, MAX_REFIT_RESIDUAL, runs)
    return None
