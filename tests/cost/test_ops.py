"""The per-op time model (autopar.cost.ops, read by autopar.cost.time): each op class priced by its real shape."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.cost import Calibration, predict_profile
from autopar.cost.ops import Rates, gemm_fraction, op_seconds
from autopar.models.gpt import GPT, GPTConfig, lm_loss
from autopar.profile.model_profile import OpRecord
from tests.cost._op_records import profiled

H200 = autopar.Topology.from_spec("1xH200")
CAL = Calibration()


def _rates(**plan) -> Rates:
    return Rates.of(H200.device, autopar.Plan(**{"precision": "bf16", **plan}), CAL)


def _gemm(m: int, n: int, k: int, grow: int = 1) -> OpRecord:
    return OpRecord(kind="gemm", backward=False, shape=(1, m, n, k), dtype="bfloat16", count=1,
                    flops=2.0 * m * n * k, bytes=2 * (m * k + k * n + m * n), batch_dim=grow)


def _attention(b=4, h=16, s=2048, d=64, causal=1, window=0, masked=0, sk=None, dropout=None, backward=False
               ) -> OpRecord:
    sk = sk or s
    shape = (b, h, h, s, sk, d, d, causal, window, masked) + (() if dropout is None else (dropout,))
    return OpRecord(kind="attention", backward=backward, shape=shape, dtype="bfloat16", count=1,
                    flops=2.0 * b * h * s * sk * 2 * d * (2.5 if backward else 1.0), bytes=8 * b * h * s * d)


def test_attention_that_draws_dropout_is_slower_forward_and_as_fast_backward():
    """Calibration.dropout_attention_factor: a forward drawing a dropout mask runs at that fraction of one that
    does not; its backward regenerates the mask at no measured cost; a record written without the field (10
    of them) has no dropout."""
    for backward, factor in ((False, CAL.dropout_attention_factor), (True, 1.0)):
        plain, drop = (op_seconds(_attention(dropout=x, backward=backward), _rates()) for x in (0, 1))
        assert drop == pytest.approx(plain / factor, rel=1e-9)
    assert op_seconds(_attention(), _rates()) == op_seconds(_attention(dropout=0), _rates())


def test_a_gemm_is_priced_by_its_depth_and_output_not_by_a_hidden_width():
    """Equal FLOPs: a deep, wide GEMM runs near the best rate; a shallow one (depth 64) and one with a small
    output (64 x 64 = 4096 elements: few tiles) run far below it."""
    square = op_seconds(_gemm(4096, 4096, 4096), _rates())
    shallow = op_seconds(_gemm(16384, 16384, 256), _rates())
    tiny_out = op_seconds(_gemm(64, 64, 4096 ** 3 // 64 // 64), _rates())
    best = 2 * 4096 ** 3 / (H200.device.peak_flops("bf16") * CAL.matmul_efficiency)
    assert square == pytest.approx(best, rel=0.02)
    assert shallow > 1.1 * square and tiny_out > 10 * square


def test_eager_misaligned_gemms_are_slow_compiled_ones_are_padded():
    aligned, odd = _gemm(8192, 50264, 1024), _gemm(8192, 50257, 1024)
    assert op_seconds(odd, _rates()) == pytest.approx(op_seconds(aligned, _rates()) / CAL.misaligned_gemm_factor,
                                                      rel=0.01)
    assert op_seconds(odd, _rates(compile=True)) == pytest.approx(op_seconds(aligned, _rates(compile=True)), rel=0.01)
    # M is the batch's dimension (tokens): an odd token count is no misalignment
    assert op_seconds(_gemm(8191, 4096, 4096), _rates()) == pytest.approx(
        op_seconds(_gemm(8192, 4096, 4096), _rates()), rel=0.01)


def test_attention_by_its_executed_keys_head_dim_and_mask():
    full, causal = op_seconds(_attention(causal=0), _rates()), op_seconds(_attention(), _rates())
    assert 0.45 * full < causal < 0.6 * full  # half the scores, at a shorter key loop's slightly lower rate
    # a sliding window of 256: a quarter of the keys, at the shorter key loop's lower rate
    window = 257 / 1024.5 * (1024.5 / (1024.5 + CAL.attention_half_keys)) / (257 / (257 + CAL.attention_half_keys))
    assert op_seconds(_attention(causal=1, window=256), _rates()) == pytest.approx(window * causal, rel=1e-6)
    # a deeper head runs faster per FLOP (equal FLOPs: half the heads at twice the dim)
    assert op_seconds(_attention(h=8, d=128), _rates()) < op_seconds(_attention(h=16, d=64), _rates())
    masked = op_seconds(_attention(causal=0, masked=1), _rates())
    assert masked == pytest.approx(full / CAL.masked_attention_factor, rel=1e-6)
    # cross-attention: 128 queries over 1500 keys
    cross = op_seconds(_attention(s=128, sk=1500, causal=0), _rates())
    rate = (2048 / (2048 + CAL.attention_half_keys)) / (1500 / (1500 + CAL.attention_half_keys))
    assert cross == pytest.approx(full * (128 * 1500) / 2048 ** 2 * rate, rel=1e-6)


def test_a_mask_only_torch_compile_adds_makes_compiled_attention_masked_and_not_causal():
    """causal 2: a Hugging Face call that eager runs as is_causal and torch.compile (torch < 2.14) with a mask."""
    hf = _attention(causal=2)
    assert op_seconds(hf, _rates()) == op_seconds(_attention(causal=1), _rates())
    assert op_seconds(hf, _rates(compile=True)) == pytest.approx(
        op_seconds(_attention(causal=0, masked=1), _rates()), rel=1e-9)
    assert op_seconds(_attention(causal=1), _rates(compile=True)) == op_seconds(_attention(causal=1), _rates())


def _conv(m=64 * 56 * 56, n=64, k=576, groups=1, channels_last=1) -> OpRecord:
    nbytes = 2 * (m * k // 9 * groups + m * n * groups)
    return OpRecord(kind="conv", backward=False, shape=(m, n, k, groups, channels_last), dtype="bfloat16", count=1,
                    flops=2.0 * m * n * k * groups, bytes=nbytes, batch_dim=0)


def test_a_convolution_is_its_implicit_gemm_at_cudnn_s_efficiency_and_a_depthwise_one_runs_on_cuda_cores():
    conv = op_seconds(_conv(), _rates())
    m, n, k = 64 * 56 * 56, 64, 576
    gemm = 2.0 * m * n * k / (H200.device.peak_flops("bf16") * gemm_fraction(
        k, m * n, CAL.matmul_efficiency, CAL.matmul_half_width, CAL.matmul_rows_half * 2048))
    assert conv == pytest.approx(gemm / CAL.conv_efficiency, rel=1e-6)
    nchw = op_seconds(_conv(channels_last=0), _rates())
    assert nchw == pytest.approx(conv / CAL.conv_nchw_factor, rel=1e-6)
    assert op_seconds(_conv(channels_last=0), _rates(compile=True)) == pytest.approx(conv, rel=1e-6)  # inductor: NHWC
    depthwise = _conv(n=1, k=49, groups=96)
    rate = H200.device.peak_flops("fp32") * CAL.depthwise_conv_efficiency
    assert op_seconds(depthwise, _rates()) == pytest.approx(
        max(depthwise.flops / rate, depthwise.bytes / _rates().hbm), rel=1e-9)


def test_memory_bound_ops_are_their_bytes_over_the_achieved_bandwidth():
    r = OpRecord(kind="elementwise", backward=True, shape=(), dtype="float32", count=7, flops=0.0, bytes=10**9)
    assert op_seconds(r, _rates()) == pytest.approx(1e9 / (H200.device.hbm_bytes_per_s * CAL.memory_efficiency))
    assert op_seconds(r, _rates(compile=True)) == 0.0  # compiled: the "fused" records price it instead


# ---------------------------------------------------------------------------------------------------
# Whole steps
# ---------------------------------------------------------------------------------------------------
CFG = GPTConfig(vocab_size=1024, seq_len=128, num_layers=2, hidden_dim=128, num_heads=4)


@functools.lru_cache(maxsize=None)
def _gpt(batch: int):
    torch.manual_seed(0)
    model = GPT(CFG)
    sample = torch.randint(0, CFG.vocab_size, (batch, CFG.seq_len))
    return (profiled(model, sample, loss_fn=lm_loss),
            {"bf16": profiled(model, sample, loss_fn=lm_loss, precision="bf16")})


def _predict(batch: int, **plan):
    profile, variants = _gpt(batch)
    return predict_profile(profile, autopar.Plan(**{"precision": "bf16", **plan}), H200, CAL, variants=variants).time


def test_a_trace_at_one_sample_predicts_a_larger_micro_batch_as_a_trace_at_that_batch_does():
    """Compute: exactly (the dim that grows with the batch scales; weights do not). Memory-bound bytes scale as a
    whole, so the few that do not grow with the batch (the loss's scalars, position tables) are off a little."""
    one, eight = _predict(1, micro_batch_size=8), _predict(8, micro_batch_size=8)
    assert one.compute_s == pytest.approx(eight.compute_s, rel=1e-3)
    assert one.memory_s == pytest.approx(eight.memory_s, rel=0.06)


def test_tensor_parallelism_splits_the_gemms_and_heads_it_splits():
    """A GPT of hidden 1024 at 16 x 512 tokens: TP 2 halves its paired layers' GEMMs and its attention heads
    (a little more than half the time: each GEMM's output is half as large)."""
    cfg = GPTConfig(vocab_size=1024, seq_len=512, num_layers=2, hidden_dim=1024, num_heads=16)
    with torch.device("meta"):
        model = GPT(cfg)
    sample = torch.zeros(1, 512, dtype=torch.long, device="meta")
    profile = profiled(model, sample, precision="bf16-pure")

    def compute(tp: int) -> float:
        return predict_profile(profile, autopar.Plan(precision="bf16", micro_batch_size=16, tp=tp), H200,
                               CAL).time.compute_s

    assert 0.5 * compute(1) < compute(2) < 0.56 * compute(1)


def test_compile_fuses_the_memory_bound_chains_of_a_transformer():
    """Compiled, the blocks' and head's memory-bound chains fuse; the loss (the vocabulary's cross-entropy, outside
    the model's compiled graph) stays eager."""
    eager, compiled = _predict(8, micro_batch_size=64), _predict(8, micro_batch_size=64, compile=True)
    assert compiled.memory_s < 0.75 * eager.memory_s


def test_compile_does_not_pay_where_nothing_fuses_and_the_step_is_launch_bound():
    """Linear layers without activations at a small batch in fp32 (no autocast casts for compile to fuse): the
    step is CPU-bound and compile fuses next to nothing away; at equal host costs a kernel (eager and compiled),
    compile is predicted to gain less than 10% (the views' host time, a kernel or two of the loss's), where a
    transformer's fused chains gain more (test_compile_fuses_the_memory_bound_chains_of_a_transformer)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    x = torch.randn(4, 256)
    profile = profiled(model, x)
    cal = dataclasses.replace(CAL, compiled_kernel_launch_s=CAL.launch_s, backward_launch_s=CAL.launch_s)
    eager = predict_profile(profile, autopar.Plan(precision="fp32", micro_batch_size=4), H200, cal)
    compiled = predict_profile(profile, autopar.Plan(precision="fp32", micro_batch_size=4, compile=True), H200, cal)
    assert eager.time.launch_s > 0 and compiled.time.launch_s > 0
    assert 0.9 * eager.step_s < compiled.step_s <= eager.step_s


def test_the_gemm_shapes_come_from_the_trace_not_from_the_shape_facts():
    profile, variants = _gpt(8)
    plan = autopar.Plan(precision="bf16", micro_batch_size=8)
    blank = {k: dataclasses.replace(v, hidden_dim=None, tokens_per_sample=None) for k, v in variants.items()}
    a = predict_profile(profile, plan, H200, CAL, variants=variants).time.compute_s
    b = predict_profile(dataclasses.replace(profile, hidden_dim=None, tokens_per_sample=None), plan, H200, CAL,
                        variants=blank).time.compute_s
    assert a == b


def test_a_profile_without_op_records_still_predicts():
    profile, variants = _gpt(8)
    bare = dataclasses.replace(profile, op_groups=())
    t = predict_profile(bare, autopar.Plan(precision="bf16", micro_batch_size=8), H200, CAL,
                        variants={k: dataclasses.replace(v, op_groups=()) for k, v in variants.items()}).time
    assert t.compute_s > 0 and t.memory_s > 0
