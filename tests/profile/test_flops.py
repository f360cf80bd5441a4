"""Attention in the trace: flash_like_sdpa() routes F.scaled_dot_product_attention to the flash-like stand-in
(also under FakeTensorMode, bf16 autocast and the CUDA autocast policy, as the trace runs it), and leaves
nothing behind."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import autopar.profile.flops as flops
from autopar.models.gpt import lm_loss, synthetic_tokens
from autopar.profile import flash_like_sdpa, profile_model
from tests.profile._helpers import SMALL, _gpt


class _Ops(TorchDispatchMode):
    """Records the name of every aten op that runs."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _qkv(heads: int = 4, kv_heads: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, heads, 8, 16, generator=g), torch.randn(2, kv_heads, 8, 16, generator=g),
            torch.randn(2, kv_heads, 8, 16, generator=g))


def test_flash_like_sdpa_runs_the_fused_kernel_and_gives_sdpa_result():
    q, k, v = _qkv()
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with flash_like_sdpa(), _Ops() as ops:
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert "_scaled_dot_product_flash_attention_for_cpu" in ops.names
    torch.testing.assert_close(got, expected)
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention  # nothing was replaced


def test_grouped_query_attention_in_fp32_takes_the_math_kernel_as_cuda_does():
    q, k, v = _qkv(heads=4, kv_heads=2)
    expected = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    with flash_like_sdpa(), _Ops() as ops:
        got = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert "_scaled_dot_product_flash_attention_for_cpu" not in ops.names
    assert "bmm" in ops.names  # the math kernel (composite: its parts run) materialises the attention matrix
    torch.testing.assert_close(got, expected)


def test_the_trace_routes_every_blocks_attention_to_the_stand_in_at_every_precision(monkeypatch):
    """Under FakeTensorMode, FlopCounterMode, bf16 autocast and the CUDA autocast policy (itself a
    TorchFunctionMode above this one), each block's F.scaled_dot_product_attention reaches the stand-in."""
    calls: list[torch.dtype] = []
    stand_in = flops.flash_like_attention

    def spy(query, *args, **kwargs):
        calls.append(query.dtype)
        return stand_in(query, *args, **kwargs)

    monkeypatch.setattr(flops, "flash_like_attention", spy)
    model, x = _gpt(), synthetic_tokens(2, SMALL)
    for precision in ("fp32", "bf16", "bf16-pure"):
        calls.clear()
        profile_model(model, x, loss_fn=lm_loss, precision=precision)
        assert len(calls) == SMALL.num_layers, precision
    assert torch._C._len_torch_function_stack() == 0  # every mode the trace entered is gone


def test_flash_like_sdpa_covers_the_forward_only():
    """Tensor.backward is a torch function: torch pops the mode while it runs, so a forward recomputed in
    backward (checkpointing) would meet torch's own SDPA. Why the exact check replaces F's function instead."""
    modes_in_backward: list[int] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            modes_in_backward.append(torch._C._len_torch_function_stack())
            return grad * 2

    x = torch.randn(3, requires_grad=True)
    with flash_like_sdpa():
        assert torch._C._len_torch_function_stack() == 1
        Probe.apply(x).sum().backward()
    assert modes_in_backward == [0]


def test_an_fp32_grouped_mm_runs_on_fake_tensors_with_a_float32_output():
    """The fake kernel of torch._grouped_mm refuses float32; the stand-in gives the GPU's float32 (tokens, out)
    result, and leaves bf16 calls (and other ops) to torch."""
    grouped = torch.ops.aten._grouped_mm.default
    with FakeTensorMode():
        a, w = torch.randn(64, 32), torch.randn(4, 32, 48)
        offs = torch.tensor([16, 32, 48, 64], dtype=torch.int32)
        out = flops.fp32_grouped_mm(grouped, (a, w), {"offs": offs})
        assert out is not None and out.dtype == torch.float32 and tuple(out.shape) == (64, 48)
        assert flops.fp32_grouped_mm(grouped, (a.bfloat16(), w.bfloat16()), {"offs": offs}) is None
        assert flops.fp32_grouped_mm(torch.ops.aten.mm.default, (a, a.t()), {}) is None


def _dispatched(q, k, v, mask, dropout_p):
    """The aten ops and the dtype of every softmax the stand-in runs for this call under bf16 autocast, on fake
    tensors (as the trace runs it)."""
    softmax_dtypes: list[torch.dtype] = []

    class Watch(_Ops):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "softmax" in func.overloadpacket.__name__:
                softmax_dtypes.append(args[0].dtype)
            return super().__torch_dispatch__(func, types, args, kwargs)

    with FakeTensorMode() as mode:
        q, k, v, mask = (mode.from_tensor(t) for t in (q, k, v, mask))
        with torch.autocast("cpu", dtype=torch.bfloat16), flash_like_sdpa(), Watch() as ops:
            F.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), attn_mask=mask, dropout_p=dropout_p)
    return ops.names, softmax_dtypes


def test_a_broadcast_learned_bias_under_dropout_takes_the_math_kernel_in_fp32_as_cuda_does():
    """T5 in training (bench/results/sdpa_calls_h200_2026-12-02.jsonl): a (1, heads, q, k) fp32 bias that requires
    grad, with dropout, ran SDPA's math kernel in fp32 on the H200; without dropout (Swin), or with a whole
    (batch, heads, q, k) bias, the memory-efficient kernel."""
    q, k, v = _qkv()
    broadcast = torch.randn(1, 4, 8, 8, requires_grad=True)
    names, softmax = _dispatched(q, k, v, broadcast, 0.1)
    assert "_scaled_dot_product_efficient_attention" not in names and softmax == [torch.float32]
    for mask, dropout_p in ((broadcast, 0.0), (torch.randn(2, 4, 8, 8, requires_grad=True), 0.1),
                            (torch.randn(1, 4, 8, 8), 0.1)):
        names, softmax = _dispatched(q, k, v, mask, dropout_p)
        assert softmax == [] and ("_scaled_dot_product_efficient_attention" in names
                                  or "_scaled_dot_product_flash_attention_for_cpu" in names), (mask.shape, dropout_p)


def test_dropout_in_training_runs_cudas_fused_kernel_and_keeps_a_boolean_mask():
    """On CPU tensors torch composes dropout from a float mask; CUDA's fused kernel keeps a bool one for backward.
    Evaluation and in-place dropout are torch's own."""
    saved: list[torch.dtype] = []
    with FakeTensorMode():
        x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
        with flash_like_sdpa(), _Ops() as ops, \
                torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t):
            y = torch.nn.Dropout(0.1)(x)
        assert "native_dropout" in ops.names and y.dtype == torch.bfloat16
        assert torch.bool in saved and torch.bfloat16 not in saved
        with flash_like_sdpa(), _Ops() as ops:
            F.dropout(x, 0.1, training=False)
            F.dropout(x.detach().clone(), 0.1, training=True, inplace=True)
        assert "native_dropout" not in ops.names


class _Tallied(TorchDispatchMode):
    """Runs every op through a FlopTally in scope 0, as the trace's StepWatcher does."""

    def __init__(self, tally: flops.FlopTally) -> None:
        super().__init__()
        self.tally = tally

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.tally.run(func, args, kwargs or {}, 0)


def test_the_tally_counts_a_training_step_as_torchs_flop_counter_does():
    from torch.utils.flop_counter import FlopCounterMode

    def step() -> None:
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
        x = torch.randn(4, 16)
        q, k, v = (t.requires_grad_() for t in _qkv())
        (model(x).square().sum() + F.scaled_dot_product_attention(q, k, v).sum()).backward()

    with FlopCounterMode(display=False, custom_mapping=flops.flop_formulas()) as counter:
        step()
    tally = flops.FlopTally()
    with _Tallied(tally):
        step()
    assert tally.total == counter.get_total_flops() > 0
    assert dict(tally.by_scope) == {0: tally.total}


def test_the_tally_counts_an_op_that_decomposes_by_its_pieces():
    tally = flops.FlopTally()
    with FakeTensorMode():
        x, w = torch.empty(4, 16), torch.empty(8, 16)
        out = tally.run(torch.ops.aten.linear.default, (x, w), {}, 3)  # no formula of its own: mm inside
    assert tuple(out.shape) == (4, 8)
    assert tally.total == tally.by_scope[3] == 2 * 4 * 16 * 8


def test_identical_blocks_of_an_encoder_decoder_are_counted_alike_and_the_head_outside_them():
    """Each op's FLOPs go to the block whose forward made its autograd node (the watcher's scope): the decoder's
    last block gets none of the head's backward (torch's module tracker gave it some), and the blocks with the
    rest add up to the step."""
    t = __import__("pytest").importorskip("transformers")
    cfg = t.BartConfig(vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                       decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32)
    model = t.BartForConditionalGeneration(cfg)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    profile = profile_model(model, {"input_ids": ids, "labels": ids}, warn=False)
    block_flops = [b.flops for b in profile.blocks]
    assert len(block_flops) == 4
    assert block_flops[0] == block_flops[1] and block_flops[2] == block_flops[3]  # encoder, decoder
    assert sum(block_flops) < profile.flops
