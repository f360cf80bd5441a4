"""The op records the trace keeps (autopar.profile.watch): every GEMM, convolution, attention and grouped GEMM with
its real shape, forward and backward, in the block that ran it; every memory-bound op's bytes; what fusion leaves."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from autopar.models.gpt import GPT, GPTConfig, lm_loss
from autopar.profile import ModelProfile, extrapolate_profile
from autopar.profile.flops import flash_like_attention
from tests.cost._op_records import profiled, records, watched

COMPUTE = ("gemm", "conv", "attention", "grouped_gemm")
CFG = GPTConfig(vocab_size=256, seq_len=32, num_layers=3, hidden_dim=32, num_heads=2)


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = GPT(CFG)
    sample = torch.randint(0, 256, (2, 32))
    return profiled(model, sample, loss_fn=lm_loss)


def test_records_add_up_to_the_traced_flops_ops_and_bytes(gpt):
    """Every allocating op is one record's; compute records carry the FLOP counter's FLOPs; the memory-bound ones
    (and attention's backward, which the traffic count takes for memory-bound) carry the traced bytes."""
    assert sum(r.flops for r in records(gpt)) == pytest.approx(gpt.flops, rel=1e-12)
    kernels = [r for r in records(gpt) if not r.kind.startswith("fused") and r.kind not in ("view", "weight_cast")]
    assert sum(r.count for r in kernels) == gpt.num_ops
    memory = sum(r.bytes for r in kernels if r.kind not in COMPUTE)
    attention_backward = sum(r.bytes for r in records(gpt, "attention", backward=True))
    assert memory + attention_backward == gpt.traffic_bytes


def test_identical_blocks_share_one_group_and_extrapolated_blocks_read_the_last(gpt):
    groups = [g for g in gpt.op_groups if g.where == "blocks"]
    assert sorted(i for g in groups for i in g.blocks) == [0, 1, 2]
    assert len(groups) <= 3 and {g.where for g in gpt.op_groups} == {"blocks", "before", "after", "loss"}
    torch.manual_seed(0)
    sample = torch.randint(0, 256, (2, 32))
    p2 = profiled(GPT(GPTConfig(**{**CFG.__dict__, "num_layers": 2})), sample, loss_fn=lm_loss)
    deep = extrapolate_profile(p2, gpt, 12)
    assert deep.ops_of("blocks", 11) is deep.ops_of("blocks", 2) is gpt.ops_of("blocks", 2)


def test_linear_gemms_forward_and_both_gradients_with_the_dim_that_grows_with_the_batch(gpt):
    """A Linear (in 32 -> out 128) on 2 x 32 tokens: forward (1, 64, 128, 32) growing in M, input gradient
    (1, 64, 32, 128) growing in M, weight gradient (1, 128, 32, 64) growing in K; each names its weight's dims."""
    block = gpt.ops_of("blocks", 1)
    shapes = {(r.backward, r.shape, r.batch_dim) for r in block.ops if r.kind == "gemm"}
    assert (False, (1, 64, 128, 32), 1) in shapes
    assert (True, (1, 64, 32, 128), 1) in shapes
    assert (True, (1, 128, 32, 64), 3) in shapes or (True, (1, 32, 128, 64), 3) in shapes
    for r in block.ops:
        if r.kind == "gemm":
            assert sorted(r.shape[i] for i in r.weight_dims) in ([32, 32], [32, 96], [32, 128])
    head = [r for r in gpt.ops_of("after").ops if r.kind == "gemm" and not r.backward]
    assert [r.shape for r in head] == [(1, 64, 256, 32)]  # the head, outside the blocks


def test_attention_records_its_lengths_head_dims_and_causality(gpt):
    (fwd,) = [r for r in gpt.ops_of("blocks", 0).ops if r.kind == "attention" and not r.backward]
    assert fwd.shape == (2, 2, 2, 32, 32, 16, 16, 1, 0, 0, 0)  # batch, heads, kv heads, q, k, dims, causal, window,
    # mask, dropout
    assert fwd.dtype == "float32"
    (bwd,) = [r for r in gpt.ops_of("blocks", 0).ops if r.kind == "attention" and r.backward]
    assert bwd.flops == pytest.approx(fwd.flops * 2.5)


def test_cross_attention_and_grouped_query_attention():
    q = torch.randn(2, 4, 8, 16)
    k = torch.randn(2, 4, 24, 16)
    v = torch.randn(2, 4, 24, 16)
    ops = watched(lambda q, k, v: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False)[0],
                 q, k, v)
    (att,) = [r for r in ops if r.kind == "attention"]
    assert att.shape == (2, 4, 4, 8, 24, 16, 16, 0, 0, 0, 0)
    assert att.flops == 2 * 2 * 4 * 8 * 24 * (16 + 16)


def test_attention_that_draws_a_dropout_mask_is_marked_both_ways():
    q, k, v = (torch.randn(2, 4, 8, 16, requires_grad=True) for _ in range(3))

    bias = torch.zeros(2, 4, 8, 8, requires_grad=True)  # a learned bias: the memory-efficient kernel

    def step(dropout, biased):  # SDPA as the trace runs it: the fused kernel a GPU takes (flash, or efficient)
        def f(q, k, v, b):
            return flash_like_attention(q, k, v, attn_mask=b if biased else None, dropout_p=dropout,
                                        is_causal=not biased).sum()
        return {(r.backward, r.shape[10]) for r in watched(f, q, k, v, bias) if r.kind == "attention"}


    assert step(0.1, False) == step(0.1, True) == {(False, 1), (True, 1)}
    assert step(0.0, False) == step(0.0, True) == {(False, 0), (True, 0)}


def test_convolution_as_implicit_gemms_forward_and_its_two_backward_gemms():
    """Conv 8 -> 16, 3x3, padding 1, on 2 x 8 x 10 x 10: forward M = 2 * 100, N = 16, K = 8 * 9; the input
    gradient (M = 200, N = 8, K = 144) and weight gradient (M = 16, N = 72, K = 200); a depthwise conv's groups."""
    x = torch.randn(2, 8, 10, 10, requires_grad=True)
    w = torch.randn(16, 8, 3, 3)
    dw = torch.randn(16, 1, 3, 3)
    ops = watched(lambda x, w, dw: F.conv2d(F.conv2d(x, w, padding=1), dw, padding=1, groups=16), x, params=(w, dw))
    convs = {(r.backward, r.shape, r.batch_dim) for r in ops if r.kind == "conv"}
    assert (False, (200, 16, 72, 1, 0, 8), 0) in convs  # the last: the input channels a group
    assert (True, (200, 8, 144, 1, 0, 8), 0) in convs
    assert (True, (16, 72, 200, 1, 0, 8), 2) in convs
    assert (False, (200, 1, 9, 16, 0, 1), 0) in convs  # depthwise: per group N = 1, K = 9
    fwd = [r for r in ops if r.kind == "conv" and not r.backward]
    assert sum(r.flops for r in fwd) == 2 * 200 * 16 * 72 + 2 * 200 * 1 * 9 * 16


def test_channels_last_convolution_is_marked():
    x = torch.randn(2, 8, 10, 10).to(memory_format=torch.channels_last)
    w = torch.randn(16, 8, 3, 3).to(memory_format=torch.channels_last)
    ops = watched(lambda x, w: F.conv2d(x, w), x, params=(w,))
    assert [r.shape[4] for r in ops if r.kind == "conv" and not r.backward] == [1]


def test_grouped_mm_records_its_mean_group():
    """torch._grouped_mm (bf16): tokens sorted by expert (64, 32) x 4 experts' (32, 48): per group 16 x 48 x 32."""
    a = torch.randn(64, 32, dtype=torch.bfloat16)
    w = torch.randn(4, 32, 48, dtype=torch.bfloat16)
    offs = torch.tensor([16, 32, 48, 64], dtype=torch.int32)
    ops = watched(lambda a, offs, w: torch._grouped_mm(a, w, offs=offs), a, offs, params=(w,))
    (g,) = [r for r in ops if r.kind == "grouped_gemm" and not r.backward]
    assert g.shape == (4, 16, 48, 32) and g.flops == 2 * 64 * 48 * 32 and g.batch_dim == 1
    # the weight gradient: per group (32 x 16) x (16 x 48), growing in its depth (the tokens)
    assert {(r.shape, r.batch_dim) for r in ops if r.kind == "grouped_gemm" and r.backward} == {((4, 32, 48, 16), 3)}


def test_fusion_leaves_a_chain_of_elementwise_ops_its_inputs_and_what_is_read_after_it():
    """x @ w, then four elementwise ops, then @ w: eager moves every op's inputs and outputs; fused, the chain
    reads the GEMM's output once and writes what the next GEMM reads (no gradients needed: forward only)."""
    x = torch.randn(64, 64)
    w = torch.randn(64, 64)

    def chain(x, w):
        y = x @ w
        z = ((y * 2 + 1).relu() - 3)
        return z @ w

    ops = watched(lambda x, w: chain(x, w).detach(), x, params=(w,))
    eager = sum(r.bytes for r in ops if r.kind in ("elementwise",))
    (fused,) = [r for r in ops if r.kind == "fused"]
    tensor = 64 * 64 * 4
    assert eager == 4 * 2 * tensor  # four ops, each reading one tensor and writing one
    assert fused.bytes == 2 * tensor and fused.count == 1  # read y, write z: one kernel


def test_op_records_survive_the_json_round_trip(gpt):
    back = ModelProfile.from_dict(json.loads(json.dumps(gpt.to_dict())))
    assert back == gpt and back.op_groups == gpt.op_groups
