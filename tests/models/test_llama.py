"""Tests of autopar.models.llama: shapes, parameter count, causality, grouped-query attention, RoPE, the
loss, a CPU forward/backward, the meta device, and that autopar's profile finds its blocks and shape."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopar.models.llama import Llama, LlamaConfig, apply_rope, lm_loss, rope_angles
from autopar.profile import profile_model

TINY = LlamaConfig(vocab_size=97, seq_len=32, num_layers=2, hidden_dim=32, num_heads=4, num_kv_heads=2, ffn_dim=48)


def _model(cfg: LlamaConfig = TINY, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(cfg)


def test_logits_shape_and_parameter_count():
    model = _model()
    tokens = torch.randint(0, TINY.vocab_size, (3, 16))
    assert model(tokens).shape == (3, 16, TINY.vocab_size)
    assert sum(p.numel() for p in model.parameters()) == TINY.num_params
    assert model.lm_head.weight is not model.tok_emb.weight  # untied, as in Llama 3
    tied = LlamaConfig(**{**TINY.__dict__, "tie_embeddings": True})
    assert sum(p.numel() for p in Llama(tied).parameters()) == tied.num_params


def test_gqa_projection_shapes():
    attn = _model().layers[0].attn
    head = TINY.hidden_dim // TINY.num_heads
    assert attn.q_proj.weight.shape == (TINY.num_heads * head, TINY.hidden_dim)
    assert attn.k_proj.weight.shape == attn.v_proj.weight.shape == (TINY.num_kv_heads * head, TINY.hidden_dim)
    assert (attn.num_heads, attn.num_kv_heads) == (4, 2)


def test_causal_future_tokens_do_not_change_the_past():
    model = _model().eval()
    a = torch.randint(0, TINY.vocab_size, (2, 20))
    b = a.clone()
    b[:, 12:] = (b[:, 12:] + 5) % TINY.vocab_size
    with torch.no_grad():
        la, lb = model(a), model(b)
    assert torch.allclose(la[:, :12], lb[:, :12], atol=1e-6)
    assert not torch.allclose(la[:, 12:], lb[:, 12:])


def test_gqa_equals_attention_with_repeated_kv_heads():
    torch.manual_seed(0)
    b, s, d = 2, 8, 8
    q, k, v = torch.randn(b, 4, s, d), torch.randn(b, 2, s, d), torch.randn(b, 2, s, d)
    grouped = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    full = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    assert torch.allclose(grouped, full, atol=1e-6)


def test_rope_is_a_rotation_that_depends_on_relative_position():
    cos, sin = rope_angles(16, 8, 10000.0)
    assert cos.shape == sin.shape == (16, 8)
    assert torch.equal(cos[:, :4], cos[:, 4:])  # pair (i, i + 4) turns by one angle
    x = torch.randn(1, 1, 16, 8)
    rotated = apply_rope(x, cos, sin)
    assert torch.allclose(rotated.norm(dim=-1), x.norm(dim=-1), atol=1e-5)  # norms kept
    assert torch.allclose(rotated[..., 0, :], x[..., 0, :])  # position 0 does not turn
    # <R_m q, R_n k> depends only on m - n: the same pair of vectors at (3, 1) and (7, 5)
    q, k = torch.randn(8), torch.randn(8)
    at = torch.zeros(1, 1, 16, 8)
    at[0, 0, [3, 7]] = q
    at2 = torch.zeros(1, 1, 16, 8)
    at2[0, 0, [1, 5]] = k
    rq, rk = apply_rope(at, cos, sin)[0, 0], apply_rope(at2, cos, sin)[0, 0]
    assert torch.allclose(rq[3] @ rk[1], rq[7] @ rk[5], atol=1e-5)


def test_targets_give_the_loss_and_backward_reaches_every_parameter():
    model = _model()
    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    loss = model(tokens[:, :-1], tokens[:, 1:])
    assert loss.shape == () and abs(loss.item() - torch.log(torch.tensor(97.0)).item()) < 0.5  # ~ln(vocab) at init
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    # a few SGD steps on one batch lower the loss
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    first = loss.item()
    for _ in range(5):
        opt.step()
        opt.zero_grad()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
    assert loss.item() < first


def test_lm_loss_matches_shifted_targets():
    model = _model().eval()
    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    with torch.no_grad():
        logits = model(tokens)
        expected = F.cross_entropy(logits[:, :-1].reshape(-1, TINY.vocab_size), tokens[:, 1:].reshape(-1))
    assert torch.allclose(lm_loss(logits, tokens), expected)


def test_too_long_sequence_and_bad_configs_are_refused():
    with pytest.raises(ValueError, match="longer than LlamaConfig.seq_len=32"):
        _model()(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="num_heads=4 must divide by num_kv_heads=3"):
        LlamaConfig(hidden_dim=32, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="hidden_dim=30 must divide by num_heads=4"):
        LlamaConfig(hidden_dim=30, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="ffn_dim must be a positive integer"):
        LlamaConfig(ffn_dim=0)


def test_builds_on_the_meta_device_and_materialises():
    with torch.device("meta"):
        model = Llama(TINY)
    assert all(p.is_meta for p in model.parameters()) and not list(model.buffers())
    model.to_empty(device="cpu")
    model.reset_parameters()
    out = model(torch.randint(0, TINY.vocab_size, (1, 8)))
    assert torch.isfinite(out).all()


def test_profile_finds_the_blocks_and_the_shape():
    model = _model()
    tokens = torch.randint(0, TINY.vocab_size, (2, 32))
    p = profile_model(model, tokens, loss_fn=lm_loss)
    assert p.blocks_path == "layers" and p.num_blocks == 2 and p.block_class == "LlamaBlock" and p.repeated
    assert (p.hidden_dim, p.num_heads, p.num_kv_heads, p.ffn_dim, p.vocab_size, p.num_layers) == (32, 4, 2, 48, 97, 2)
    assert p.num_params == TINY.num_params and p.tied_params == ()
    assert p.block_input == "arg0" and p.block_num_args == 3  # (hidden states, cos, sin)
    assert p.tokens_per_sample == 32
    assert p.flops == pytest.approx(p.formula_flops(), rel=0.1)
    names = [c.name for c in p.matmul_calls if c.name.startswith("layers.0.")]
    assert names[:3] == ["layers.0.attn.q_proj", "layers.0.attn.k_proj", "layers.0.attn.v_proj"]


def test_profile_of_a_meta_model_equals_the_real_one():
    tokens = torch.randint(0, TINY.vocab_size, (2, 32))
    real = profile_model(_model(), tokens, loss_fn=lm_loss)
    with torch.device("meta"):
        meta = Llama(TINY)
    p = profile_model(meta, tokens.to("meta"), loss_fn=lm_loss)
    assert (p.num_params, p.flops, p.saved_bytes, p.fingerprint) == (real.num_params, real.flops, real.saved_bytes,
                                                                     real.fingerprint)


def test_matches_hugging_face_llama_with_the_same_weights():
    transformers = pytest.importorskip("transformers")
    cfg = LlamaConfig(**{**TINY.__dict__, "rope_theta": 10000.0, "norm_eps": 1e-6})
    model = _model(cfg).eval()
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_dim, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.seq_len, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False)).eval()
    names = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "lm_head.weight": "lm_head.weight"}
    state = {}
    for name, value in model.state_dict().items():
        state[names.get(name) or "model." + name.replace("attn_norm", "input_layernorm")
              .replace("mlp_norm", "post_attention_layernorm").replace("attn.", "self_attn.")] = value
    hf.load_state_dict(state, strict=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    with torch.no_grad():
        assert torch.allclose(model(tokens), hf(tokens).logits, atol=1e-5)
