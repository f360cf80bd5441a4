"""Tests of autopar.strategies.tensor_parallel in one process (no process group): which layers tensor parallelism
pairs up (column-wise group -> row-wise layer) in the built-in GPT, Hugging Face Llama (its own base_model_tp_plan),
GPT-2 (Conv1D, one fused q/k/v projection, tied head) and BERT; the names fallback for untraced models; the
refusals of `check_tensor_parallel` (each naming the dim that does not divide); `_divide_attrs`.

Applying the styles on several ranks is covered by tests/distributed/test_parallel_parity.py."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.errors import PlanError
from autopar.models.gpt import lm_loss
from autopar.profile import profile_model
from autopar.search import DropKind
from autopar.strategies.tensor_parallel import (TPPair, _divide_attrs, _norms_on_split_heads, check_tensor_parallel,
                                                tensor_parallel_refusal, tp_layout)
from tests._training import CFG, batch, make_model, sample_of

L = CFG.num_layers


def _profile(kind: str, model: nn.Module, *, trace: bool = True):
    loss_fn = lm_loss if kind == "gpt" else None
    return profile_model(model, sample_of(kind, batch(0)[:2]), loss_fn=loss_fn, warn=False, trace=trace)


@pytest.fixture(scope="module")
def gpt():
    model = make_model("gpt")
    return model, _profile("gpt", model)


@pytest.fixture(scope="module")
def llama():
    model = make_model("llama")
    return model, _profile("llama", model)


@pytest.fixture(scope="module")
def gpt2():
    model = make_model("gpt2")
    return model, _profile("gpt2", model)


@pytest.fixture(scope="module")
def bert():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=CFG.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=CFG.seq_len)
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(cfg)
    x = batch(0)[:2]
    return model, profile_model(model, {"input_ids": x, "labels": x}, warn=False)


# ---- expected layouts ---------------------------------------------------------------------------------
def _gpt_pairs(prefix: str = "blocks") -> tuple[TPPair, ...]:
    out = []
    for i in range(L):
        b = f"{prefix}.{i}"
        out.append(TPPair(colwise=(f"{b}.attn.q_proj", f"{b}.attn.k_proj", f"{b}.attn.v_proj"), rowwise=f"{b}.attn.o_proj",
                          kinds=("linear",) * 4, chunks=1, attention=True))
        out.append(TPPair(colwise=(f"{b}.mlp.up_proj",), rowwise=f"{b}.mlp.down_proj", kinds=("linear",) * 2,
                          chunks=1, attention=False))
    return tuple(out)


def _llama_pairs() -> tuple[TPPair, ...]:
    out = []
    for i in range(L):
        b = f"model.layers.{i}"
        out.append(TPPair(colwise=tuple(f"{b}.self_attn.{p}_proj" for p in "qkv"), rowwise=f"{b}.self_attn.o_proj",
                          kinds=("linear",) * 4, chunks=1, attention=True))
        out.append(TPPair(colwise=(f"{b}.mlp.gate_proj", f"{b}.mlp.up_proj"), rowwise=f"{b}.mlp.down_proj",
                          kinds=("linear",) * 3, chunks=1, attention=False))
    return tuple(out)


def _gpt2_pairs() -> tuple[TPPair, ...]:
    out = []
    for i in range(L):
        b = f"transformer.h.{i}"
        out.append(TPPair(colwise=(f"{b}.attn.c_attn",), rowwise=f"{b}.attn.c_proj", kinds=("conv1d", "conv1d"),
                          chunks=3, attention=True, parts_layout="whole"))
        out.append(TPPair(colwise=(f"{b}.mlp.c_fc",), rowwise=f"{b}.mlp.c_proj", kinds=("conv1d", "conv1d"),
                          chunks=1, attention=False))
    return tuple(out)


def _bert_pairs() -> tuple[TPPair, ...]:
    out = []
    for i in range(2):
        b = f"bert.encoder.layer.{i}"
        out.append(TPPair(colwise=tuple(f"{b}.attention.self.{p}" for p in ("query", "key", "value")),
                          rowwise=f"{b}.attention.output.dense", kinds=("linear",) * 4, chunks=1, attention=True))
        out.append(TPPair(colwise=(f"{b}.intermediate.dense",), rowwise=f"{b}.output.dense", kinds=("linear",) * 2,
                          chunks=1, attention=False))
    return tuple(out)


# ---- tp_layout from the trace -------------------------------------------------------------------------
def test_gpt_layout_from_the_trace(gpt):
    model, profile = gpt
    layout = tp_layout(model, profile)
    assert layout.source == "trace"
    assert layout.pairs == _gpt_pairs()
    assert layout.norms == tuple(f"blocks.{i}.{n}" for i in range(L) for n in ("ln_1", "ln_2"))
    assert (layout.embedding, layout.head, layout.tied_head) == ("tok_emb", "lm_head", True)
    assert layout.notes == ()
    assert layout.pairs[0].parent == "blocks.0.attn" and layout.pairs[1].parent == "blocks.0.mlp"


def test_llama_layout_from_its_own_tp_plan(llama):
    model, profile = llama
    assert model.config.base_model_tp_plan  # the model ships one: it is what the layout follows
    layout = tp_layout(model, profile)
    assert layout.source == "hf_tp_plan"
    assert layout.pairs == _llama_pairs()
    assert layout.norms == tuple(f"model.layers.{i}.{n}" for i in range(L)
                                 for n in ("input_layernorm", "post_attention_layernorm"))
    assert (layout.embedding, layout.head, layout.tied_head) == ("model.embed_tokens", "lm_head", False)
    assert layout.pairs[0].parent == "model.layers.0.self_attn"


def test_gpt2_layout_conv1d_fused_qkv_and_tied_head(gpt2):
    model, profile = gpt2
    layout = tp_layout(model, profile)
    assert layout.source == "trace"
    assert layout.pairs == _gpt2_pairs()
    assert layout.norms == tuple(f"transformer.h.{i}.{n}" for i in range(L) for n in ("ln_1", "ln_2"))
    assert (layout.embedding, layout.head, layout.tied_head) == ("transformer.wte", "lm_head", True)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_bert_layout(bert):
    model, profile = bert
    layout = tp_layout(model, profile)
    assert layout.source == "trace"  # BERT ships no base_model_tp_plan
    assert layout.pairs == _bert_pairs()
    assert layout.norms == tuple(f"bert.encoder.layer.{i}.{n}.LayerNorm" for i in range(2)
                                 for n in ("attention.output", "output"))
    assert (layout.embedding, layout.head, layout.tied_head) == (
        "bert.embeddings.word_embeddings", "cls.predictions.decoder", True)


# ---- the names fallback (trace=False) -----------------------------------------------------------------
@pytest.mark.parametrize("kind, expected", [("gpt", _gpt_pairs), ("llama", _llama_pairs), ("gpt2", _gpt2_pairs)])
def test_names_fallback_finds_the_same_pairs(kind, expected, request):
    model, traced = request.getfixturevalue(kind)
    profile = _profile(kind, model, trace=False)
    assert profile.matmul_calls == ()
    layout = tp_layout(model, profile)
    assert layout.source == "names"
    assert layout.pairs == expected() == tp_layout(model, traced).pairs
    assert any("not traced" in n for n in layout.notes)
    assert layout.norms == tp_layout(model, traced).norms


# ---- check_tensor_parallel ----------------------------------------------------------------------------
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_check_accepts_degrees_that_divide(gpt, tp):
    model, profile = gpt
    assert check_tensor_parallel(model, profile, tp) == tp_layout(model, profile)


def test_check_names_the_heads(gpt):
    model, profile = gpt
    with pytest.raises(PlanError, match=r"tp=3 does not divide the 4 attention heads \(num_heads\)"):
        check_tensor_parallel(model, profile, 3)


def test_check_names_the_key_value_heads(llama):
    model, profile = llama
    assert (profile.num_heads, profile.num_kv_heads) == (4, 2)
    check_tensor_parallel(model, profile, 2)
    with pytest.raises(PlanError, match="tp=4 does not divide the 2 key/value heads") as info:
        check_tensor_parallel(model, profile, 4)
    assert "num_kv_heads" in str(info.value)


def test_check_names_a_fused_projection(gpt2):
    model, profile = gpt2
    headless = dataclasses.replace(profile, num_heads=None, num_kv_heads=None)  # only the layers' widths are left
    check_tensor_parallel(model, headless, 2)
    with pytest.raises(PlanError, match=r"transformer\.h\.0\.attn\.c_attn \(64 per fused projection\)"):
        check_tensor_parallel(model, headless, 3)  # 192 = 3 x 64 divides by 3, but each projection's 64 does not


def test_check_names_a_plain_layer(gpt):
    model, profile = gpt
    headless = dataclasses.replace(profile, num_heads=None, num_kv_heads=None)
    with pytest.raises(PlanError, match=r"blocks\.0\.attn\.q_proj \(64\)") as info:
        check_tensor_parallel(model, headless, 3)
    assert "per fused projection" not in str(info.value)


@pytest.mark.parametrize("model", [
    nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)),
    nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(3)]),
], ids=["mlp", "repeated-linears"])
def test_no_splittable_layers(model):
    profile = profile_model(model, torch.randn(4, 16), warn=False)
    with pytest.raises(PlanError, match="found no Linear layers to split") as info:
        tp_layout(model, profile)
    assert "Sequential" in str(info.value) and "tp=1" in str(info.value)
    with pytest.raises(PlanError, match="found no Linear layers to split"):
        check_tensor_parallel(model, profile, 2)


# ---- _divide_attrs ------------------------------------------------------------------------------------
def test_divide_attrs_on_gpt2_attention(gpt2):
    model, profile = gpt2
    attn = make_model("gpt2").transformer.h[0].attn  # a fresh copy: the fixture's model stays as it is
    before = dict(vars(attn))
    assert (attn.num_heads, attn.split_size, attn.head_dim, attn.embed_dim) == (4, 64, 16, 64)
    changed = _divide_attrs(attn, 2, profile)
    assert sorted(changed) == ["num_heads", "split_size"]
    assert (attn.num_heads, attn.split_size) == (2, 32)
    assert (attn.head_dim, attn.embed_dim) == (16, 64)  # head size and the module's input width stay
    untouched = {k: v for k, v in vars(attn).items() if k not in ("num_heads", "split_size")}
    assert untouched == {k: v for k, v in before.items() if k not in ("num_heads", "split_size")}


def test_divide_attrs_leaves_what_does_not_match(gpt):
    _, profile = gpt
    module = nn.Module()
    module.num_heads = 8  # not the profile's 4 heads: not this model's head count
    module.split_size = profile.hidden_dim
    module.n_head = True  # a flag, not a count
    module.head_dim = 16
    assert _divide_attrs(module, 2, profile) == ["split_size"]
    assert (module.num_heads, module.split_size, module.n_head, module.head_dim) == (8, 32, True, 16)
    module.num_attention_heads = 4
    assert _divide_attrs(module, 3, profile) == []  # 3 divides neither 4 heads nor 32
    assert module.num_attention_heads == 4


def test_names_fallback_finds_the_head_tied_to_the_embedding(gpt):
    model, traced = gpt
    untraced = _profile("gpt", model, trace=False)
    assert ("tok_emb.weight", "lm_head.weight") in untraced.tied_params  # the profile knows they are tied
    layout = tp_layout(model, untraced)
    expected = tp_layout(model, traced)
    assert (layout.embedding, layout.head, layout.tied_head) == (expected.embedding, expected.head,
                                                                 expected.tied_head) == ("tok_emb", "lm_head", True)


# ---- models tensor parallelism cannot split correctly ---------------------------------------------------
class _BiasedAttention(nn.Module):
    """Attention with a learned bias per head and relative position, added to every head's scores (T5's
    relative attention bias, Swin's relative position bias table): the split q/k/v give each rank its share
    of the heads, and the whole bias no longer matches them."""

    def __init__(self, hidden: int, heads: int, seq: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, hidden // heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, hidden) for _ in range(3))
        self.o_proj = nn.Linear(hidden, hidden)
        self.relative_bias = nn.Parameter(torch.zeros(2 * seq - 1, heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        pos = torch.arange(s)
        bias = self.relative_bias[pos[None, :] - pos[:, None] + s - 1].permute(2, 0, 1)  # (heads, s, s)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


def _gpt_with(make_attention=None, **extra_params) -> nn.Module:
    model = make_model("gpt")
    if make_attention is not None:
        for block in model.blocks:
            block.attn = make_attention()
    for name, value in extra_params.items():
        model.register_parameter(name, nn.Parameter(value))
    return model


class _BufferBiasedAttention(_BiasedAttention):
    """The same bias kept as a buffer: not a parameter tensor parallelism splits."""

    def __init__(self, hidden: int, heads: int, seq: int) -> None:
        super().__init__(hidden, heads, seq)
        bias = self.relative_bias.detach()
        del self.relative_bias
        self.register_buffer("relative_bias", bias)


def test_a_per_head_parameter_is_split_with_the_heads_and_a_per_head_buffer_is_refused():
    """A learned tensor with one entry per head along its last dim (T5's relative attention bias, GPT-OSS's sinks)
    is split along it with the heads (hf-sweep-dist: T5-like models train under tp=2 as one process); a buffer is
    not split, so it is refused: each rank would add every head's values to its own share of the heads."""
    from autopar.strategies.tensor_parallel_layout import per_head_params

    model = _gpt_with(lambda: _BiasedAttention(CFG.hidden_dim, CFG.num_heads, CFG.seq_len))
    profile = _profile("gpt", model)
    assert tensor_parallel_refusal(model, profile) is None
    named = dict(model.named_modules())
    pair = next(p for p in check_tensor_parallel(model, profile, 2).pairs if p.parent == "blocks.0.attn")
    assert per_head_params(named, pair, profile) == [(named["blocks.0.attn"], "relative_bias")]
    model = _gpt_with(lambda: _BufferBiasedAttention(CFG.hidden_dim, CFG.num_heads, CFG.seq_len))
    profile = _profile("gpt", model)
    why = tensor_parallel_refusal(model, profile)
    assert why is not None and "blocks.0.attn.relative_bias" in why and why.endswith("set tp=1")
    shape = (2 * CFG.seq_len - 1, CFG.num_heads)
    expected = f"not blocks.0.attn.relative_bias {shape}, which holds a value per head"
    with pytest.raises(PlanError, match=re.escape(expected)):
        check_tensor_parallel(model, profile, 2)


class _QKNormAttention(_BiasedAttention):
    """Attention with an RMS norm over each head's width on q and k (Qwen3's, Gemma 3's q_norm / k_norm): every
    rank applies the whole norm weight to its own heads, so its gradient is a partial sum on each rank, which
    tensor parallelism sums over the ranks."""

    def __init__(self, hidden: int, heads: int, seq: int) -> None:
        super().__init__(hidden, heads, seq)
        del self.relative_bias
        self.q_norm, self.k_norm = nn.RMSNorm(self.head_dim), nn.RMSNorm(self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.q_norm(q), self._norm_k(k)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))

    def _norm_k(self, k: torch.Tensor) -> torch.Tensor:
        return self.k_norm(k)


def test_a_norm_over_one_head_s_width_is_not_refused_its_gradient_is_summed_over_the_ranks():
    """Trained as one process: tests/distributed/test_parallel_parity.py's qwen3 scenarios."""
    model = _gpt_with(lambda: _QKNormAttention(CFG.hidden_dim, CFG.num_heads, CFG.seq_len))
    profile = _profile("gpt", model)
    assert tensor_parallel_refusal(model, profile) is None
    check_tensor_parallel(model, profile, 2)
    layout = tp_layout(model, profile)
    pair = next(p for p in layout.pairs if p.attention and p.parent == "blocks.0.attn")
    per_head, across = _norms_on_split_heads(dict(model.named_modules()), pair, profile)
    assert [type(m).__name__ for m in per_head] == ["RMSNorm"] * 2 and across == []


class _CrossHeadNormAttention(_QKNormAttention):
    """OLMo 2's k_norm under grouped-query attention: one norm over two heads' width, which no rank holds whole."""

    def __init__(self, hidden: int, heads: int, seq: int) -> None:
        super().__init__(hidden, heads, seq)
        self.k_norm = nn.RMSNorm(2 * self.head_dim)

    def _norm_k(self, k: torch.Tensor) -> torch.Tensor:  # two heads at a time
        return self.k_norm(k.reshape(*k.shape[:2], -1, 2 * self.head_dim)).view_as(k)


def test_a_norm_over_several_heads_is_refused_no_rank_holds_its_heads_whole():
    model = _gpt_with(lambda: _CrossHeadNormAttention(CFG.hidden_dim, CFG.num_heads, CFG.seq_len))
    with pytest.raises(PlanError, match=re.escape("split the heads that blocks.0.attn.k_norm normalizes together")):
        check_tensor_parallel(model, _profile("gpt", model), 2)


class _WholeWidthNormAttention(_QKNormAttention):
    """OLMo 2's q_norm and k_norm: each over its projection's whole output (all heads), before the heads are viewed.
    `norm` makes them (nn.RMSNorm: split with the projections; nn.LayerNorm: refused)."""

    def __init__(self, hidden: int, heads: int, seq: int, norm=nn.RMSNorm) -> None:
        super().__init__(hidden, heads, seq)
        self.q_norm, self.k_norm = norm(hidden), norm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k = self.q_norm(self.q_proj(x)), self.k_norm(self.k_proj(x))
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, self.v_proj(x)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


def test_norms_over_a_split_projection_s_whole_output_are_split_with_it_as_the_trace_shows():
    """The trace records which tensor each norm read (NormCall.input_id, a projection's MatmulCall.output_id): the
    q and k norms read q_proj's and k_proj's whole outputs, so tensor parallelism splits them with those (their
    statistic all-reduced: tests/distributed/test_parallel_parity.py's olmo2 scenarios train as one process), and
    sequence parallelism leaves them to that; a LayerNorm there is refused (only RMS norms are split)."""
    from autopar.strategies.tensor_parallel_layout import norms_on_split_outputs

    model = _gpt_with(lambda: _WholeWidthNormAttention(CFG.hidden_dim, CFG.num_heads, CFG.seq_len))
    profile = _profile("gpt", model)
    assert tensor_parallel_refusal(model, profile) is None
    layout = check_tensor_parallel(model, profile, 2)
    attention = next(p for p in layout.pairs if p.attention and p.parent == "blocks.0.attn")
    mlp = next(p for p in layout.pairs if not p.attention and p.parent.startswith("blocks.0."))
    assert norms_on_split_outputs(attention, profile) == ["blocks.0.attn.q_norm", "blocks.0.attn.k_norm"]
    assert norms_on_split_outputs(mlp, profile) == []
    assert not any(n.endswith(("q_norm", "k_norm")) for n in layout.norms)
    ln = _gpt_with(lambda: _WholeWidthNormAttention(CFG.hidden_dim, CFG.num_heads, CFG.seq_len, norm=nn.LayerNorm))
    with pytest.raises(PlanError, match=re.escape("split the width that blocks.0.attn.q_norm normalizes")):
        check_tensor_parallel(ln, _profile("gpt", ln), 2)


def test_rms_norm_like_tells_an_rms_norm_from_a_layer_norm_also_on_meta():
    from autopar.strategies.tensor_parallel_layout import rms_norm_like

    class OnePlusWeight(nn.Module):  # Gemma's RMS norm: (1 + weight) as its scale
        def __init__(self, width: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(width))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + self.weight)

    assert rms_norm_like(nn.RMSNorm(8)) and rms_norm_like(OnePlusWeight(8))
    with torch.device("meta"):
        on_meta = nn.RMSNorm(8)
    assert rms_norm_like(on_meta)
    assert not rms_norm_like(nn.LayerNorm(8)) and not rms_norm_like(nn.LayerNorm(8, bias=False))
    assert not rms_norm_like(nn.RMSNorm(8, elementwise_affine=False))  # no weight to split


class _FusedPerHeadAttention(_BiasedAttention):
    """One nn.Linear computing q, k and v interleaved per head (GPT-NeoX's query_key_value): (.., heads, 3 x
    head_dim), each head's q, k and v side by side, which a shard of [q | k | v] would split wrongly."""

    def __init__(self, hidden: int, heads: int, seq: int) -> None:
        super().__init__(hidden, heads, seq)
        del self.relative_bias, self.q_proj, self.k_proj, self.v_proj
        self.query_key_value = nn.Linear(hidden, 3 * hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.query_key_value(x).view(b, s, -1, 3 * self.head_dim).transpose(1, 2).chunk(3, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class _FusedWholeAttention(_FusedPerHeadAttention):
    """One nn.Linear computing [q | k | v], each over all heads (MPT's Wqkv, Phi-3's qkv_proj), cut by a chunk."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in self.query_key_value(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class _FusedUnseenAttention(_FusedPerHeadAttention):
    """The fused output scaled before it is cut: the trace does not see how its parts lie."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.query_key_value(x) * 1.0
        q, k, v = qkv.view(b, s, -1, 3 * self.head_dim).transpose(1, 2).chunk(3, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


@pytest.mark.parametrize("attention,layout,chunks", [(_FusedPerHeadAttention, "interleaved", 1),
                                                     (_FusedWholeAttention, "whole", 3)])
def test_a_fused_linear_projection_is_split_as_the_trace_saw_it_cut(attention, layout, chunks):
    """The trace records the first op on each projection's output (MatmulCall.consumer): a view with the heads
    outermost says its parts are interleaved per head (a plain column shard holds whole heads); a chunk of the last
    dim into parts says [q | k | v] (a strided shard). tests/distributed/test_parallel_parity.py trains GPT-NeoX
    (interleaved) and GPT-2 (whole) under tp=2 as one process; hf-sweep-dist the transformers models."""
    model = _gpt_with(lambda: attention(CFG.hidden_dim, CFG.num_heads, CFG.seq_len))
    profile = _profile("gpt", model)
    call = next(c for c in profile.matmul_calls if c.name == "blocks.0.attn.query_key_value")
    assert call.consumer == ("view 2,32,4,48" if layout == "interleaved" else f"split -1 {CFG.hidden_dim},"
                             f"{CFG.hidden_dim},{CFG.hidden_dim}")
    pair = next(p for p in check_tensor_parallel(model, profile, 2).pairs if p.parent == "blocks.0.attn")
    assert (pair.parts_layout, pair.chunks) == (layout, chunks)


def test_a_fused_linear_projection_is_refused_where_the_trace_did_not_see_how_it_is_cut():
    model = _gpt_with(lambda: _FusedUnseenAttention(CFG.hidden_dim, CFG.num_heads, CFG.seq_len))
    profile = _profile("gpt", model)
    with pytest.raises(PlanError, match=re.escape("cannot tell how GPT's fused projection "
                                                  "blocks.0.attn.query_key_value lays out its parts (query, key and value")):
        check_tensor_parallel(model, profile, 2)


def test_a_fused_layer_beside_unsplit_readers_of_its_input_keeps_an_unknown_layout():
    """MiniCPM5-MoE: its plan splits the fused queries-and-gates layer but not the k and v projections, which read
    the same input; a plain shard of the queries alone trained apart (hf-sweep-dist 2026-12-06), so the trace's
    view of the cut does not decide there: the pair's layout stays unknown (refused for an nn.Linear)."""
    from autopar.layout import pairs_from_calls
    from autopar.profile import MatmulCall

    def call(name, input_id, out, consumer=""):
        return MatmulCall(name=name, kind="linear", input_id=input_id, in_features=64, out_features=out,
                          consumer=consumer)

    calls = [call("k", 0, 16), call("v", 0, 16), call("qg", 0, 128, "view 2,16,4,32"), call("o", 1, 64)]
    plan = {"qg": "colwise", "k": "unit_colwise", "v": "unit_colwise", "o": "rowwise"}
    (pair,) = pairs_from_calls(calls, 64, plan, num_heads=4)
    assert (pair.colwise, pair.chunks, pair.parts_layout) == (("qg",), 2, "")
    (alone,) = pairs_from_calls(calls[2:], 64, None, num_heads=4)
    assert (alone.chunks, alone.parts_layout) == (1, "interleaved")


def test_fused_parts_layout_reads_the_cut():
    from autopar.layout import fused_parts_layout
    from autopar.profile import MatmulCall

    def call(consumer, out=192):
        return MatmulCall(name="qkv", kind="linear", input_id=0, in_features=64, out_features=out, consumer=consumer)

    assert fused_parts_layout(call("view 2,16,4,3,16"), 3, 4) == "interleaved"  # Bloom's, Persimmon's
    assert fused_parts_layout(call("view 2,16,4,48"), 3, 4) == "interleaved"  # GPT-NeoX's
    assert fused_parts_layout(call("view 2,16,3,4,16"), 3, 4) == "whole"
    assert fused_parts_layout(call("split -1 64,64,64"), 3, 4) == "whole"  # a chunk
    assert fused_parts_layout(call("split -1 64"), 3, 4) == "whole"  # Phi-3's slice of the queries
    assert fused_parts_layout(call("split -1 16,16,16,16,16,16,16,16,16,16,16,16"), 3, 4) == ""  # per head
    assert fused_parts_layout(call("split -2 64,64,64"), 3, 4) == ""
    assert fused_parts_layout(call("view 2,16,3,64"), 3, 3) == ""  # 3 heads of 3 parts: which is which
    assert fused_parts_layout(call("mul"), 3, 4) == "" and fused_parts_layout(call(""), 3, 4) == ""


def test_a_zero_dim_parameter_is_refused():
    # CLIP's logit_scale: data parallelism keeps it out of FSDP2's sharding; beside TP's DTensors it is refused
    model = _gpt_with(logit_scale=torch.tensor(2.0))
    profile = _profile("gpt", model)
    with pytest.raises(PlanError, match="0-d parameter logit_scale of GPT a plain tensor beside the tensor-parallel DTensors, which autopar does not support: set tp=1"):
        check_tensor_parallel(model, profile, 2)


def test_the_models_tensor_parallelism_splits_are_not_refused(gpt, llama, gpt2, bert):
    for model, profile in (gpt, llama, gpt2, bert):
        assert tensor_parallel_refusal(model, profile) is None


def test_the_search_drops_tensor_parallel_plans_of_a_refused_model_with_the_reason():
    import autopar

    model = _gpt_with(logit_scale=torch.tensor(2.0))
    x = sample_of("gpt", batch(0)[:2])
    ranked = autopar.candidates(model, sample=x, topology="2xH100-SXM", loss_fn=lm_loss, global_batch_size=4)
    tp = [c for c in ranked if c.plan.tp > 1]
    assert tp and all(not c.feasible and c.drop.kind is DropKind.UNRUNNABLE and "0-d parameter" in c.reason
                      for c in tp)
    assert any(c.feasible for c in ranked)  # data parallelism remains
    plain = autopar.candidates(make_model("gpt"), sample=x, topology="2xH100-SXM", loss_fn=lm_loss,
                               global_batch_size=4)
    assert any(c.plan.tp > 1 and c.feasible for c in plain)


class _PReLUMLP(nn.Module):
    """An MLP whose activation has a learned parameter (Apertus's xIELU; here nn.PReLU): between the column and
    row layers it acts on each rank's share of the inner width, so each rank's gradient of it would be partial."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up_proj, self.act, self.down_proj = nn.Linear(hidden, 4 * hidden), nn.PReLU(), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


def test_a_learned_activation_between_the_split_layers_is_refused():
    model = make_model("gpt")
    for block in model.blocks:
        block.mlp = _PReLUMLP(CFG.hidden_dim)
    with pytest.raises(PlanError, match=re.escape("would keep blocks.0.mlp.act.weight whole on every rank inside a "
                                                  "module whose activations it splits")):
        check_tensor_parallel(model, _profile("gpt", model), 2)
