"""Hugging Face GPT-2 / Llama / BERT built from tiny configs (no downloads): blocks, tied weights, shape
facts, FLOPs against the formula, meta models, and that profiling never touches them."""

from __future__ import annotations

import pytest
import torch

from autopar.profile import profile_model
from tests.profile._helpers import _assert_untouched, _hf_sample, _snapshot


@pytest.fixture(scope="module")
def hf_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=256, n_layer=4, n_head=4, vocab_size=1000, n_positions=128,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    sample = _hf_sample(1000)
    before = _snapshot(model)
    return model, sample, profile_model(model, sample), before


@pytest.fixture(scope="module")
def hf_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=1000, max_position_embeddings=128,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg)
    sample = _hf_sample(1000)
    before = _snapshot(model)
    return model, sample, profile_model(model, sample), before


@pytest.fixture(scope="module")
def hf_bert():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                                  vocab_size=1000, max_position_embeddings=128, pad_token_id=0)
    model = transformers.BertForMaskedLM(cfg)
    sample = _hf_sample(1000)
    before = _snapshot(model)
    return model, sample, profile_model(model, sample), before


def test_hf_gpt2(hf_gpt2):
    model, _, p, before = hf_gpt2
    assert p.num_params == sum(q.numel() for q in model.parameters())
    assert p.blocks_path == "transformer.h" and p.num_blocks == 4 and p.block_class == "GPT2Block"
    assert p.num_params_in_blocks == sum(q.numel() for q in model.transformer.h.parameters())
    assert p.tied_params == (("transformer.wte.weight", "lm_head.weight"),)
    assert p.num_lookup_params == 128 * 256  # wpe only
    assert (p.hidden_dim, p.num_heads, p.num_kv_heads, p.num_layers, p.vocab_size) == (256, 4, 4, 4, 1000)
    assert p.tokens_per_sample == 128
    assert p.flops == pytest.approx(p.formula_flops(), rel=0.05)
    assert p.model_flops() == p.formula_flops()  # MFU by the PaLM count, where the trace agrees with it
    _assert_untouched(model, before)


def test_hf_llama_gqa(hf_llama):
    model, _, p, before = hf_llama
    assert p.num_params == sum(q.numel() for q in model.parameters())
    assert p.blocks_path == "model.layers" and p.num_blocks == 4 and p.block_class == "LlamaDecoderLayer"
    assert p.num_params_in_blocks == sum(q.numel() for q in model.model.layers.parameters())
    assert p.tied_params == ()
    assert p.num_lookup_params == 1000 * 256  # untied input embedding
    assert (p.hidden_dim, p.num_heads, p.num_kv_heads, p.num_layers, p.vocab_size, p.ffn_dim) == (
        256, 4, 2, 4, 1000, 688)
    # k/v projections are half the size of q (GQA): the block count reflects it
    h, kv = 256, 2 * 64
    per_block = 2 * h * h + 2 * h * kv + 3 * h * 688 + 2 * h
    assert [b.num_params for b in p.blocks] == [per_block] * 4
    assert p.flops == pytest.approx(p.formula_flops(), rel=0.05)
    _assert_untouched(model, before)


def test_hf_bert(hf_bert):
    model, _, p, before = hf_bert
    assert p.num_params == sum(q.numel() for q in model.parameters())
    assert p.blocks_path == "bert.encoder.layer" and p.num_blocks == 2 and p.block_class == "BertLayer"
    assert p.num_params_in_blocks == sum(q.numel() for q in model.bert.encoder.layer.parameters())
    assert ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight") in p.tied_params
    assert (p.hidden_dim, p.num_heads, p.num_kv_heads, p.num_layers, p.vocab_size) == (64, 2, 2, 2, 1000)
    assert p.flops > 0 and p.saved_bytes > 0
    _assert_untouched(model, before)  # includes BERT's position_ids / token_type_ids buffers
    assert len(before["buffers"]) >= 1


def test_hf_blocks_by_class(hf_llama):
    model, sample, auto, _ = hf_llama
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    p = profile_model(model, sample, blocks=LlamaDecoderLayer)
    assert [b.name for b in p.blocks] == [f"model.layers.{i}" for i in range(4)]
    assert p.flops == auto.flops


def test_hf_meta_model_with_meta_sample(hf_llama):
    transformers = pytest.importorskip("transformers")
    model, sample, real, _ = hf_llama
    with torch.device("meta"):
        meta_model = transformers.LlamaForCausalLM(model.config)
    meta_sample = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in sample.items()}
    p = profile_model(meta_model, meta_sample)
    assert p.num_params == real.num_params and p.flops == real.flops and p.saved_bytes == real.saved_bytes
    assert all(q.is_meta for q in meta_model.parameters())



def test_a_mixture_of_experts_counts_the_experts_each_token_runs_for_its_mfu():
    """6 N puts all 8 experts in every token's matmuls; each token runs 2: MFU reads the trace's FLOPs, below 1
    where the formula's would not be."""
    transformers = pytest.importorskip("transformers")
    import autopar

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                     num_experts_per_tok=2, vocab_size=1000, max_position_embeddings=128)
    model = transformers.MixtralForCausalLM(cfg)
    sample = _hf_sample(1000)
    p = profile_model(model, sample, warn=False)
    assert p.formula_flops() > 2 * p.flops
    assert p.model_flops() == p.flops
    plan = autopar.plan(model, sample=sample, topology="1xH100-SXM")
    prediction = autopar.predict(model, plan, sample=sample, topology="1xH100-SXM")
    assert 0 < prediction.mfu < 1
    from autopar.cost import model_flops_per_step
    assert model_flops_per_step(p, plan) == pytest.approx(p.flops / p.sample_batch_size * plan.global_batch_size)
