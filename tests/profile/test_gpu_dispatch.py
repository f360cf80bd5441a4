"""The trace runs what a GPU runs (issue 10): SDPA with a learned bias (a mask that requires grad: T5's and
Swin's relative positions) and with a value head dim other than the query's (MLA) takes the memory-efficient
kernel, its FLOPs counted; an op that exists only in bf16 on fake tensors (torch._grouped_mm, MoE experts)
gets its FLOPs counted and a model that uses it is profiled in bf16, flagged, and planned in bf16 only."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

import autopar
from autopar.errors import TraceError
from autopar.planning import bf16_variants, profile_variants, resolve_topology
from autopar.profile import flash_like_attention, flash_like_sdpa, profile_model
from autopar.profile.flops import flop_formulas
from autopar.topology import Topology

B, H, SQ, SK = 2, 4, 16, 32


class BiasedAttention(nn.Module):
    """One attention layer whose mask is a learned (heads, q, k) bias, as T5 and Swin pass it to SDPA."""

    def __init__(self, dim: int = 32, heads: int = H, seq: int = SQ) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.bias = nn.Parameter(torch.zeros(1, heads, seq, seq))
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


class MLA(nn.Module):
    """Attention with query/key heads of 24 and value heads of 16 (DeepSeek's MLA: 192 and 128)."""

    def __init__(self, dim: int = 32, heads: int = H, qk: int = 24, v: int = 16) -> None:
        super().__init__()
        self.heads, self.qk, self.v = heads, qk, v
        self.q = nn.Linear(dim, heads * qk)
        self.k = nn.Linear(dim, heads * qk)
        self.vp = nn.Linear(dim, heads * v)
        self.out = nn.Linear(heads * v, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.qk).transpose(1, 2)
        k = self.k(x).view(b, s, self.heads, self.qk).transpose(1, 2)
        v = self.vp(x).view(b, s, self.heads, self.v).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, self.heads * self.v))


class GroupedExperts(nn.Module):
    """MoE experts as transformers 5 runs them: every token's rows through torch._grouped_mm, in the weights'
    dtype (the input is cast to it, so autocast does not reach the op)."""

    def __init__(self, dim: int = 32, ffn: int = 64, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.up = nn.Parameter(torch.randn(experts, dim, ffn) * 0.02)
        self.down = nn.Parameter(torch.randn(experts, ffn, dim) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.size(-1))
        experts = self.up.size(0)
        order = torch.sort(self.router(flat).argmax(-1)).indices
        offs = torch.arange(1, experts + 1, dtype=torch.int32, device=x.device) * (flat.size(0) // experts)
        h = torch._grouped_mm(flat[order].to(self.up.dtype), self.up, offs=offs)
        out = torch._grouped_mm(F.gelu(h), self.down, offs=offs)
        return out.to(x.dtype).reshape(x.shape)


def _fake_flops(fn, *shapes_and_grads):
    """(output, {op: FLOPs}) of fn on fake tensors of the given (shape, requires_grad), forward and backward."""
    with FakeTensorMode():
        tensors = [torch.empty(shape).requires_grad_(grad) for shape, grad in shapes_and_grads]
        counter = FlopCounterMode(display=False, custom_mapping=flop_formulas())
        with counter, flash_like_sdpa():
            out = fn(*tensors)
            out.backward(torch.empty_like(out))
        grads = [t.grad for t in tensors]
    return out, {op.__name__: n for op, n in counter.get_flop_counts()["Global"].items()}, grads


# ---- SDPA ---------------------------------------------------------------------------------------------
def test_a_mask_that_requires_grad_takes_the_efficient_kernel_and_gets_its_gradient():
    out, flops, grads = _fake_flops(F.scaled_dot_product_attention, ((B, H, SQ, 16), True), ((B, H, SK, 16), True),
                                    ((B, H, SK, 16), True), ((1, H, SQ, SK), True))
    assert out.shape == (B, H, SQ, 16)
    assert grads[3] is not None and grads[3].shape == (1, H, SQ, SK)  # the bias's gradient, summed over batch
    assert flops["_scaled_dot_product_efficient_attention"] == 2 * B * H * SQ * SK * (16 + 16)
    assert flops["_scaled_dot_product_efficient_attention_backward"] == 2 * B * H * SQ * SK * (3 * 16 + 2 * 16)


def test_unequal_query_and_value_head_dims_give_values_head_dim_and_count_both_matmuls():
    out, flops, grads = _fake_flops(F.scaled_dot_product_attention, ((B, H, SQ, 24), True), ((B, H, SK, 24), True),
                                    ((B, H, SK, 16), True))
    assert out.shape == (B, H, SQ, 16) and grads[2].shape == (B, H, SK, 16)
    # q.k^T over 24, p.v over 16; backward: scores again, dq and dk over 24, dp and dv over 16
    assert flops["_scaled_dot_product_efficient_attention"] == 2 * B * H * SQ * SK * 24 + 2 * B * H * SQ * SK * 16
    assert flops["_scaled_dot_product_efficient_attention_backward"] == 2 * B * H * SQ * SK * (3 * 24 + 2 * 16)


@pytest.mark.parametrize("mask", ["bias", "bool", "none"])
def test_the_stand_in_gives_sdpas_values_on_real_tensors(mask):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(B, H, SQ, 24, generator=g), torch.randn(B, H, SK, 24, generator=g)
    v = torch.randn(B, H, SK, 16, generator=g)
    m = {"bias": torch.randn(1, H, SQ, SK, generator=g, requires_grad=True),
         "bool": torch.rand(B, 1, SQ, SK, generator=g) > 0.3, "none": None}[mask]
    torch.testing.assert_close(flash_like_attention(q, k, v, m), F.scaled_dot_product_attention(q, k, v, m))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-pure"])
def test_models_with_a_learned_bias_or_mla_heads_are_profiled(precision):
    x = torch.randn(B, SQ, 32)
    for model in (BiasedAttention(), MLA()):
        p = profile_model(model, x, warn=False, precision=precision)
        assert p.profile_precision == precision and p.flops > p.forward_flops > 0
        assert p.saved_bytes > 0


# ---- grouped GEMMs (MoE experts) ---------------------------------------------------------------------
def test_grouped_mm_flops_are_counted_forward_and_backward():
    a, b = torch.empty(64, 32, dtype=torch.bfloat16), torch.empty(4, 32, 48, dtype=torch.bfloat16)
    with FakeTensorMode():
        a, b = (torch.empty(t.shape, dtype=t.dtype, requires_grad=True) for t in (a, b))
        offs = torch.empty(4, dtype=torch.int32)
        counter = FlopCounterMode(display=False, custom_mapping=flop_formulas())
        with counter:
            out = torch._grouped_mm(a, b, offs=offs)
            out.backward(torch.empty_like(out))
    assert out.shape == (64, 48)
    # forward, the input's gradient (2-d x 3-d) and the weights' gradient (2-d x 2-d): 2 * 64 * 32 * 48 each
    assert counter.get_total_flops() == 3 * 2 * 64 * 32 * 48


def test_fake_kernels_take_grouped_mm_only_in_bf16_also_on_a_fake_cuda_device():
    """Why a model with grouped GEMMs is planned in bf16: FakeTensorMode runs the meta kernel, which refuses
    fp32 on every device (CUDA's own kernel takes fp32 through a per-group loop)."""
    for device in ("cpu", "cuda"):
        with FakeTensorMode(), pytest.raises(RuntimeError, match="BF16"):
            torch._grouped_mm(torch.empty(64, 32, device=device), torch.empty(4, 32, 48, device=device),
                              offs=torch.empty(4, dtype=torch.int32, device=device))


def test_a_model_with_fp32_grouped_gemms_is_traced_in_fp32_and_in_bf16_for_bf16_plans():
    """The fake kernel refuses fp32 grouped GEMMs (above); the trace's stand-in (flops.fp32_grouped_mm) runs
    them, so a GPU's fp32 experts are traced as they run: fp32 records, fp32 bytes, the same FLOPs. Autocast does
    not reach them; the bf16 trace names their weights and gives them in bf16, as a bf16 plan's forward does
    (autopar.strategies.precision)."""
    model, x = GroupedExperts(), torch.randn(B, SQ, 32)
    p = profile_model(model, x, warn=False)
    assert p.profile_precision == "fp32" and p.traced and not any("could not be traced" in n for n in p.notes)
    # Two grouped GEMMs of 2 * tokens * 32 * 64 FLOPs each, forward and backward (no input gradient for the
    # first: the sample needs none), and the router's forward (argmax: no gradient reaches it).
    tokens = B * SQ
    assert p.flops == 5 * 2 * tokens * 32 * 64 + 2 * tokens * 32 * 4
    profile, variants = profile_variants(model, x, Topology.from_spec("1xH200"), warn=False)
    assert set(variants) == {"bf16", "bf16-pure"}
    assert variants["bf16"].bf16_weights == ("down", "up")
    grouped = [r for g in variants["bf16"].op_groups for r in g.ops if r.kind == "grouped_gemm"]
    if grouped:  # the profile carries its op records: the experts' GEMMs in bf16, as wrap's forward runs them
        assert {r.dtype for r in grouped} == {"bfloat16"}


def test_it_is_planned_in_bf16_where_the_hardware_has_bf16():
    model, x = GroupedExperts(), torch.randn(B, SQ, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, sample=x, topology="8xH100-SXM")
        assert plan.precision == "bf16" and plan.prediction is not None


def test_a_traceable_model_keeps_both_bf16_variants():
    """Planned for a GPU with bf16, the profile is the autocast trace itself (the search's plans are bf16)."""
    model, x = MLA(), torch.randn(B, SQ, 32)
    profile, variants = profile_variants(model, x, Topology.from_spec("1xH200"), warn=False)
    assert profile.profile_precision == "bf16" and set(variants) == {"bf16", "bf16-pure"}
    assert variants["bf16"] is profile
    here = resolve_topology(None)  # this machine's CPU: no bf16, so the fp32 trace
    assert profile_variants(MLA(), x, here, warn=False)[0].profile_precision == "fp32"


def test_a_hugging_face_moe_with_grouped_mm_is_profiled_in_fp32():
    transformers = pytest.importorskip("transformers")
    if not hasattr(torch.nn.functional, "grouped_mm") and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no grouped mm")
    cfg = transformers.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)
    model = transformers.MixtralForCausalLM(cfg)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    p = profile_model(model, {"input_ids": ids, "labels": ids}, warn=False)
    assert p.profile_precision == "fp32" and p.flops > 0  # grouped GEMMs or not, the fp32 step traces
