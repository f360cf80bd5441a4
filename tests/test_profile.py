"""Tests of autopar.profile: find_blocks and profile_model on a plain MLP, the built-in GPT and Hugging Face
GPT-2 / Llama / BERT built from tiny configs (no downloads): parameter counts, blocks, tied weights, FLOPs
against 6N + 12 L h s, shape facts, bytes saved for backward, the largest tensor, meta-device models, and
that profiling never touches the model; plus the errors a user meets."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn as nn

from autopar.errors import ProfileError
from autopar.models.gpt import GPT, Block, GPTConfig, lm_loss, synthetic_tokens
from autopar.profile import ModelProfile, find_blocks, iter_block_modules, model_fingerprint, profile_model

SMALL = GPTConfig(vocab_size=128, seq_len=64, num_layers=3, hidden_dim=64, num_heads=4)
# Shapes where attention matters (12 L h s is 20-30% of 6N per token) and embeddings do not dominate.
ATTENTION_SHAPES = [
    GPTConfig(vocab_size=256, seq_len=256, num_layers=2, hidden_dim=128, num_heads=4),
    GPTConfig(vocab_size=512, seq_len=256, num_layers=3, hidden_dim=192, num_heads=6),
]


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _gpt(cfg: GPTConfig = SMALL, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def _snapshot(model: nn.Module) -> dict:
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers(remove_duplicate=False)},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "training": [m.training for m in model.modules()],
        "ids": {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)},
    }


def _assert_untouched(model: nn.Module, before: dict) -> None:
    after = _snapshot(model)
    assert after["ids"] == before["ids"], "parameters were replaced"
    assert set(after["params"]) == set(before["params"])
    for n, p in before["params"].items():
        assert torch.equal(after["params"][n], p), f"parameter {n} changed"
    assert set(after["buffers"]) == set(before["buffers"])
    for n, b in before["buffers"].items():
        assert torch.equal(after["buffers"][n], b), f"buffer {n} changed"
    assert after["requires_grad"] == before["requires_grad"]
    assert after["training"] == before["training"]
    for n, p in model.named_parameters():
        assert p.grad is None, f"{n} got a .grad"
    for m in model.modules():  # every hook the profiler registered is gone
        assert not m._forward_hooks and not m._forward_pre_hooks
    assert "forward" not in vars(model)


# ---- a plain MLP: no repeated blocks ---------------------------------------------------------------
def test_mlp_falls_back_to_top_level_children_with_a_warning_and_a_note():
    model = _mlp()
    x = torch.randn(3, 8)
    with pytest.warns(UserWarning, match="no repeated blocks") as record:
        p = profile_model(model, x)
    assert any("blocks='path.to.layers'" in str(w.message) for w in record)
    assert not p.repeated and p.blocks_path is None
    assert [b.name for b in p.blocks] == ["0", "2", "4"]  # the ReLUs hold no parameters
    assert [b.num_params for b in p.blocks] == [8 * 16 + 16, 16 * 16 + 16, 16 * 4 + 4]
    assert p.num_params == sum(q.numel() for q in model.parameters()) == p.num_params_in_blocks
    assert p.num_params_outside_blocks == 0
    assert len(p.notes) == 1 and "no repeated blocks" in p.notes[0] and "(0, 2, 4)" in p.notes[0]
    assert "note" in p.describe() and "3 top-level units" in p.describe()
    # FLOPs: forward 2 * batch * sum(in * out); backward twice that, except no input gradient for layer 0.
    fwd = 2 * 3 * (8 * 16 + 16 * 16 + 16 * 4)
    assert p.forward_flops == fwd
    assert p.flops == fwd + 2 * fwd - 2 * 3 * 8 * 16
    assert [b.flops for b in p.blocks] == [3 * 2 * 3 * 8 * 16 - 2 * 3 * 8 * 16, 3 * 2 * 3 * 16 * 16, 3 * 2 * 3 * 16 * 4]
    assert p.tokens_per_sample is None and p.sample_batch_size == 3
    assert p.param_dtype == "float32" and p.param_bytes == 4 * p.num_params


def test_warning_can_be_silenced_but_note_stays():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = profile_model(_mlp(), torch.randn(2, 8), warn=False)
    assert p.notes and not p.repeated


def test_mlp_sample_as_tuple_and_dict():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x, y):
            return self.a(x) + self.b(y)

    m = TwoInputs()
    x, y = torch.randn(5, 4), torch.randn(5, 4)
    by_tuple = profile_model(m, (x, y), warn=False)
    by_dict = profile_model(m, {"x": x, "y": y}, warn=False)
    assert by_tuple.sample_batch_size == by_dict.sample_batch_size == 5
    assert by_tuple.forward_flops == by_dict.forward_flops == 2 * (2 * 5 * 4 * 4)


def test_repeated_sequential_is_found_as_blocks():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), *[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(3)],
                          nn.Linear(32, 2))
    p = profile_model(model, torch.randn(2, 8))
    assert p.repeated and p.blocks_path == ""  # the root Sequential is the container
    assert [b.name for b in p.blocks] == ["1", "2", "3"]
    assert p.num_params_in_blocks == 3 * (32 * 32 + 32)


# ---- the built-in GPT ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt_profile():
    model = _gpt()
    x = synthetic_tokens(4, SMALL)
    return model, x, profile_model(model, x, loss_fn=lm_loss)


def test_gpt_counts_parameters_exactly(gpt_profile):
    model, _, p = gpt_profile
    assert isinstance(p, ModelProfile)
    assert p.num_params == SMALL.num_params == sum(q.numel() for q in model.parameters())
    assert p.num_trainable_params == p.num_params
    assert p.param_bytes == 4 * p.num_params and p.param_dtype == "float32"
    assert p.repeated and p.blocks_path == "blocks" and p.block_class == "Block"
    assert p.num_blocks == SMALL.num_layers
    assert [b.name for b in p.blocks] == [f"blocks.{i}" for i in range(SMALL.num_layers)]
    per_block = sum(q.numel() for q in model.blocks[0].parameters())
    assert [b.num_params for b in p.blocks] == [per_block] * SMALL.num_layers
    assert [b.param_bytes for b in p.blocks] == [4 * per_block] * SMALL.num_layers
    assert p.num_params_in_blocks == sum(q.numel() for q in model.blocks.parameters())
    outside = sum(q.numel() for n, q in model.named_parameters() if not n.startswith("blocks."))
    assert p.num_params_outside_blocks == outside
    assert p.tied_params == (("tok_emb.weight", "lm_head.weight"),)
    assert p.num_lookup_params == SMALL.seq_len * SMALL.hidden_dim  # only pos_emb: tok_emb is the tied head
    assert p.fingerprint == model_fingerprint(model)


def test_gpt_shape_facts(gpt_profile):
    _, _, p = gpt_profile
    assert (p.hidden_dim, p.num_heads, p.num_kv_heads, p.num_layers, p.vocab_size) == (64, 4, 4, 3, 128)
    assert p.tokens_per_sample == SMALL.seq_len and p.sample_batch_size == 4
    assert p.tokens_per_step == 4 * SMALL.seq_len
    assert p.profile_precision == "fp32"


def test_gpt_block_flops_and_saved_bytes_are_per_block(gpt_profile):
    _, _, p = gpt_profile
    flops = {b.flops for b in p.blocks}
    saved = {b.saved_bytes for b in p.blocks}
    assert len(flops) == 1 and len(saved) == 1  # identical blocks, identical costs
    # The blocks carry most of the step; the head (tied, vocab 128) the rest.
    in_blocks = sum(b.flops for b in p.blocks)
    assert 0.6 * p.flops < in_blocks < p.flops
    assert all(0.3 < b.forward_flops / b.flops < 0.36 for b in p.blocks)
    assert 0.3 < p.forward_flops / p.flops < 0.36
    assert p.saved_bytes == sum(b.saved_bytes for b in p.blocks) + p.saved_bytes_outside_blocks
    assert p.saved_bytes_outside_blocks > 0
    # A block saves at least its input and its MLP activation (b*s*4h fp32) for backward.
    b, s, h = 4, SMALL.seq_len, SMALL.hidden_dim
    assert p.blocks[0].saved_bytes >= b * s * (h + 4 * h) * 4
    assert p.flops_per_sample == p.flops / 4 and p.saved_bytes_per_sample == p.saved_bytes / 4


def test_gpt_largest_transient_is_at_least_the_logits():
    cfg = GPTConfig(vocab_size=1024, seq_len=64, num_layers=2, hidden_dim=32, num_heads=4)  # logits dominate
    x = synthetic_tokens(2, cfg)
    p = profile_model(_gpt(cfg), x, loss_fn=lm_loss)
    logits_bytes = 2 * cfg.seq_len * cfg.vocab_size * 4
    assert p.largest_transient_bytes >= logits_bytes
    assert p.largest_transient_op != "none"
    q = profile_model(_gpt(SMALL), synthetic_tokens(4, SMALL))
    assert q.largest_transient_bytes >= 4 * SMALL.seq_len * SMALL.vocab_size * 4


@pytest.mark.parametrize("cfg", ATTENTION_SHAPES, ids=["h128-s256", "h192-s256"])
def test_gpt_flops_match_the_formula(cfg):
    x = synthetic_tokens(2, cfg)
    p = profile_model(_gpt(cfg), x, loss_fn=lm_loss)
    assert p.num_params == cfg.num_params
    formula = p.formula_flops()
    n_matmul = p.num_params - p.num_lookup_params
    tokens = 2 * cfg.seq_len
    assert formula == (6 * n_matmul + 12 * cfg.num_layers * cfg.hidden_dim * cfg.seq_len) * tokens
    assert p.flops == pytest.approx(formula, rel=0.05)
    # Attention's FLOPs are counted (they are 20-30% on top of 6N here).
    assert p.flops > 1.15 * 6 * n_matmul * tokens
    assert p.forward_flops == pytest.approx(formula / 3, rel=0.05)


def test_formula_flops_is_none_without_tokens():
    p = profile_model(_mlp(), torch.randn(2, 8), warn=False)
    assert p.formula_flops() is None


def test_gpt_saved_bytes_scale_with_batch_and_precision():
    model = _gpt()
    p1 = profile_model(model, synthetic_tokens(2, SMALL))
    p2 = profile_model(model, synthetic_tokens(4, SMALL))
    assert p2.saved_bytes == pytest.approx(2 * p1.saved_bytes, rel=0.10)
    assert p2.saved_bytes > p1.saved_bytes
    assert p2.flops == pytest.approx(2 * p1.flops, rel=0.01)
    assert p2.saved_bytes_per_sample == pytest.approx(p1.saved_bytes_per_sample, rel=0.10)
    bf16 = profile_model(model, synthetic_tokens(2, SMALL), precision="bf16")
    assert bf16.profile_precision == "bf16"
    assert bf16.saved_bytes < p1.saved_bytes
    assert all(b16.saved_bytes < b32.saved_bytes for b16, b32 in zip(bf16.blocks, p1.blocks))
    assert bf16.flops == pytest.approx(p1.flops, rel=0.01)


def test_bf16_saved_bytes_are_linear_in_the_batch_too():
    model = _gpt()
    p1 = profile_model(model, synthetic_tokens(1, SMALL), precision="bf16")
    p2 = profile_model(model, synthetic_tokens(2, SMALL), precision="bf16")
    assert p2.saved_bytes == pytest.approx(2 * p1.saved_bytes, rel=0.10)
    assert p1.saved_bytes < profile_model(model, synthetic_tokens(1, SMALL)).saved_bytes


def test_profile_leaves_the_gpt_untouched(gpt_profile):
    model = _gpt()
    before = _snapshot(model)
    profile_model(model, synthetic_tokens(2, SMALL), loss_fn=lm_loss)
    profile_model(model, synthetic_tokens(2, SMALL), precision="bf16")
    _assert_untouched(model, before)
    assert model.lm_head.weight is model.tok_emb.weight  # the tie survives


def test_profile_of_a_training_and_eval_model_keeps_the_mode():
    model = _gpt().eval()
    profile_model(model, synthetic_tokens(2, SMALL))
    assert not any(m.training for m in model.modules())


def test_frozen_parameters_are_not_trainable():
    model = _gpt()
    model.pos_emb.weight.requires_grad_(False)
    p = profile_model(model, synthetic_tokens(2, SMALL))
    assert p.num_trainable_params == p.num_params - SMALL.seq_len * SMALL.hidden_dim
    assert model.pos_emb.weight.grad is None and model.tok_emb.weight.grad is None


def test_meta_device_model_profiles_like_the_real_one(gpt_profile):
    _, x, real = gpt_profile
    with torch.device("meta"):
        meta_model = GPT(SMALL)
    meta_x = torch.empty(x.shape, dtype=x.dtype, device="meta")
    p = profile_model(meta_model, meta_x, loss_fn=lm_loss)
    assert all(q.is_meta for q in meta_model.parameters())
    assert all(q.grad is None for q in meta_model.parameters())
    assert p.num_params == real.num_params and p.fingerprint == real.fingerprint
    assert p.flops == real.flops and p.forward_flops == real.forward_flops
    assert p.saved_bytes == real.saved_bytes
    assert p.largest_transient_bytes == real.largest_transient_bytes
    assert [b.name for b in p.blocks] == [b.name for b in real.blocks]
    # a real sample with a meta model works too
    assert profile_model(meta_model, x, loss_fn=lm_loss).flops == real.flops


def test_to_dict_and_describe(gpt_profile):
    _, _, p = gpt_profile
    d = json.loads(json.dumps(p.to_dict()))
    assert d["num_params"] == p.num_params and len(d["blocks"]) == p.num_blocks
    assert d["tied_params"] == [["tok_emb.weight", "lm_head.weight"]]
    text = p.describe()
    assert "3 x Block at blocks" in text and "tok_emb.weight = lm_head.weight" in text
    assert "hidden=64, heads=4, kv_heads=4, layers=3" in text and "4 samples, 64 tokens each" in text


# ---- explicit blocks= ------------------------------------------------------------------------------
def test_blocks_by_path_list_and_class(gpt_profile):
    model, x, auto = gpt_profile
    by_path = profile_model(model, x, blocks="blocks", loss_fn=lm_loss)
    assert by_path.blocks_path == "blocks" and [b.name for b in by_path.blocks] == [b.name for b in auto.blocks]
    assert by_path.flops == auto.flops
    by_list = profile_model(model, x, blocks=["blocks.0", "blocks.2"])
    assert by_list.blocks_path is None and [b.name for b in by_list.blocks] == ["blocks.0", "blocks.2"]
    assert by_list.num_params_outside_blocks == auto.num_params_outside_blocks + auto.blocks[1].num_params
    assert by_list.blocks[1].flops == auto.blocks[2].flops
    by_class = profile_model(model, x, blocks=Block)
    assert by_class.blocks_path is None and [b.name for b in by_class.blocks] == [b.name for b in auto.blocks]
    assert by_class.block_class == "Block"
    by_classes = profile_model(model, x, blocks=(nn.LayerNorm,))
    # outermost LayerNorms: two per block and the final one
    assert len(by_classes.blocks) == 2 * SMALL.num_layers + 1
    # the units named by hand on a model without repeated blocks
    p = profile_model(_mlp(), torch.randn(2, 8), blocks=["0", "4"], warn=False)
    assert p.repeated and not p.notes and [b.name for b in p.blocks] == ["0", "4"]


def test_find_blocks_returns_modules():
    model = _gpt()
    path, found, repeated = find_blocks(model)
    assert path == "blocks" and repeated
    assert [m for _, m in found] == list(model.blocks)
    assert [m for _, m in find_blocks(model, Block)[1]] == list(model.blocks)


def test_blocks_path_that_does_not_exist_lists_the_containers():
    with pytest.raises(ProfileError) as info:
        profile_model(_gpt(), synthetic_tokens(2, SMALL), blocks="model.layers")
    msg = str(info.value)
    assert "no module at 'model.layers' in GPT" in msg
    assert "blocks (ModuleList, 3 children)" in msg
    with pytest.raises(ProfileError, match="no module at 'blocks.9'"):
        profile_model(_gpt(), synthetic_tokens(2, SMALL), blocks=["blocks.0", "blocks.9"])


def test_blocks_errors_for_leaf_path_and_missing_class():
    with pytest.raises(ProfileError, match="no children"):
        find_blocks(_gpt(), "lm_head")
    with pytest.raises(ProfileError, match="no module of class .*Conv2d.*containers in the model: blocks"):
        find_blocks(_gpt(), nn.Conv2d)

    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(2, 2)

        def forward(self, x):
            return self.a(x)

    with pytest.raises(ProfileError, match="no ModuleList, Sequential or ModuleDict: pass blocks="):
        find_blocks(Flat(), "b")


def test_iter_block_modules_refuses_a_profile_of_another_model(gpt_profile):
    model, _, p = gpt_profile
    assert [m for _, m in iter_block_modules(model, p)] == list(model.blocks)
    with pytest.raises(ProfileError, match="another model"):
        list(iter_block_modules(_mlp(), p))


# ---- errors ---------------------------------------------------------------------------------------
def test_model_without_parameters_is_refused():
    with pytest.raises(ProfileError, match="ReLU has no parameters"):
        profile_model(nn.ReLU(), torch.randn(2, 3))


@pytest.mark.parametrize("sample", [3, "text", torch.tensor(1.0), {"n": 1}, (1, 2), [], None])
def test_sample_without_a_batched_tensor_is_refused(sample):
    with pytest.raises(ProfileError, match="sample must hold a batched tensor"):
        profile_model(_mlp(), sample, warn=False)


def test_bad_precision_is_refused():
    with pytest.raises(ProfileError, match="precision must be 'fp32', 'bf16' or 'bf16-pure'"):
        profile_model(_mlp(), torch.randn(2, 8), precision="fp16", warn=False)


def test_forward_that_fails_on_the_sample_says_what_to_check():
    with pytest.raises(ProfileError) as info:
        profile_model(_mlp(), torch.randn(3, 9), warn=False)  # 9 features, the model takes 8
    msg = str(info.value)
    assert "could not run one step of Sequential" in msg
    assert "Check that the sample is what the model takes" in msg
    assert "model(x), model(*tuple) or model(**dict)" in msg


def test_data_dependent_control_flow_is_reported():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            return y * 2 if bool(y.sum() > 0) else y

    model = Branchy()
    before = _snapshot(model)
    with pytest.raises(ProfileError, match="data-dependent"):
        profile_model(model, torch.randn(2, 4), warn=False)
    _assert_untouched(model, before)


def test_output_without_a_floating_tensor_needs_a_loss_fn():
    class Argmax(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x).argmax(-1)

    with pytest.raises(ProfileError, match="cannot make a loss .*pass loss_fn="):
        profile_model(Argmax(), torch.randn(2, 4), warn=False)


def test_loss_fn_gets_the_output_and_the_sample_and_must_return_a_scalar():
    model = _gpt()
    x = synthetic_tokens(2, SMALL)
    seen = []

    def loss_fn(out, sample):
        seen.append((tuple(out.shape), tuple(sample.shape)))
        return lm_loss(out, sample)

    profile_model(model, x, loss_fn=loss_fn)
    assert seen == [((2, SMALL.seq_len, SMALL.vocab_size), (2, SMALL.seq_len))]
    with pytest.raises(ProfileError, match="loss_fn must return a scalar tensor"):
        profile_model(model, x, loss_fn=lambda out, sample: out.sum(-1))
    assert all(q.grad is None for q in model.parameters())


# ---- Hugging Face models from configs ---------------------------------------------------------------
def _hf_sample(vocab: int, batch: int = 2, seq: int = 128) -> dict:
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


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


# ---- extrapolate_profile: a deep model's profile from two shallow traces ----------------------------
_EXTRA_CFG = GPTConfig(vocab_size=128, seq_len=64, num_layers=5, hidden_dim=64, num_heads=4)


def _depth_profile(depth: int, precision: str = "fp32") -> ModelProfile:
    from dataclasses import replace

    tokens = synthetic_tokens(2, _EXTRA_CFG)
    return profile_model(_gpt(replace(_EXTRA_CFG, num_layers=depth)), tokens, loss_fn=lm_loss, precision=precision)


@pytest.mark.parametrize("precision", ["fp32", "bf16-pure"])
def test_extrapolated_profile_equals_a_real_deeper_trace(precision):
    from autopar.profile import extrapolate_profile

    shallow, deeper, real = (_depth_profile(d, precision) for d in (2, 3, 5))
    p = extrapolate_profile(shallow, deeper, 5)
    for name in ("num_params", "num_trainable_params", "param_bytes", "flops", "forward_flops", "num_ops",
                 "traffic_bytes", "saved_bytes", "saved_bytes_outside_blocks", "largest_transient_bytes",
                 "num_params_outside_blocks", "num_lookup_params", "num_layers", "num_blocks", "block_input_bytes"):
        assert getattr(p, name) == getattr(real, name), name
    assert [b.name for b in p.blocks] == [b.name for b in real.blocks] == [f"blocks.{i}" for i in range(5)]
    assert [(b.flops, b.saved_bytes, b.num_params) for b in p.blocks] == \
        [(b.flops, b.saved_bytes, b.num_params) for b in real.blocks]
    assert p.formula_flops() == real.formula_flops()
    # it plans, but it is not the real model: its own fingerprint, and a note saying so
    assert p.fingerprint != real.fingerprint and p.fingerprint.startswith("x")
    assert any("extrapolated from traces with 2 and 3 blocks to 5 blocks" in n for n in p.notes)
    # the deeper trace's own depth is allowed (the blocks are then the trace's own)
    same = extrapolate_profile(shallow, deeper, 3)
    assert (same.num_params, same.flops, same.num_blocks) == (deeper.num_params, deeper.flops, 3)


def test_extrapolate_profile_refuses_bad_inputs():
    from autopar.profile import extrapolate_profile

    two, three = _depth_profile(2), _depth_profile(3)
    with pytest.raises(ProfileError, match="the second with more blocks"):
        extrapolate_profile(three, two, 8)
    with pytest.raises(ProfileError, match="the second with more blocks"):
        extrapolate_profile(two, two, 8)
    with pytest.raises(ProfileError, match="fewer than the deeper trace's 3 blocks"):
        extrapolate_profile(two, three, 2)
    with pytest.raises(ProfileError, match="same sample and precision"):
        extrapolate_profile(two, _depth_profile(3, "bf16"), 8)
    from dataclasses import replace

    longer = profile_model(_gpt(replace(_EXTRA_CFG, num_layers=3)), synthetic_tokens(4, _EXTRA_CFG), loss_fn=lm_loss)
    with pytest.raises(ProfileError, match="same sample and precision"):
        extrapolate_profile(two, longer, 8)


def test_from_dict_round_trips_exactly_through_json(gpt_profile):
    _, x, p = gpt_profile
    assert p.matmul_calls and p.blocks and p.tied_params  # the nested tuples are all exercised
    back = ModelProfile.from_dict(json.loads(json.dumps(p.to_dict())))
    assert back == p and back.to_dict() == p.to_dict()
    assert isinstance(back.blocks[0], type(p.blocks[0])) and isinstance(back.matmul_calls, tuple)
    assert back.block_input_shape == p.block_input_shape and isinstance(back.block_input_shape, tuple)
    assert back.tied_params == (("tok_emb.weight", "lm_head.weight"),)
    # a bf16 trace and a structure-only profile round-trip too
    model = _gpt()
    for q in (profile_model(model, x, loss_fn=lm_loss, precision="bf16-pure"), profile_model(model, x, trace=False)):
        assert ModelProfile.from_dict(json.loads(json.dumps(q.to_dict()))) == q
    with pytest.raises(ProfileError, match="unknown profile field"):
        ModelProfile.from_dict({**p.to_dict(), "bogus": 1})
    with pytest.raises(ProfileError, match="not a profile"):
        ModelProfile.from_dict({k: v for k, v in p.to_dict().items() if k != "fingerprint"})


# ---- bf16 traces: CUDA autocast's float32 ops, weight-shaped traffic --------------------------------
class _Cube(nn.Module):
    """lin1 -> pow(3) -> lin2, recording the dtype pow returns on each forward."""

    def __init__(self, seen: list) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(16, 32), nn.Linear(32, 16)
        self.seen = seen

    def forward(self, x):
        h = self.lin1(x)
        y = h.pow(3)
        self.seen.append(y.dtype)
        return self.lin2(y)


def test_bf16_trace_runs_cuda_autocast_fp32_ops_in_float32_and_moves_their_bytes(monkeypatch):
    """CPU autocast runs pow in bf16; CUDA autocast in float32. A bf16 profile made on the CPU casts the
    inputs of CUDA's float32 ops (_CUDA_FP32_OPS) to float32, as the GPU run does, and traces the bytes."""
    import autopar.profile

    seen: list = []
    torch.manual_seed(0)
    model, x = _Cube(seen), torch.randn(4, 16)
    cuda_like = profile_model(model, x, precision="bf16", warn=False)
    assert seen and set(seen) == {torch.float32}
    seen.clear()
    monkeypatch.setattr(autopar.profile, "_CUDA_FP32_OPS", frozenset())
    cpu_like = profile_model(model, x, precision="bf16", warn=False)
    assert seen and set(seen) == {torch.bfloat16}
    assert cuda_like.traffic_bytes > cpu_like.traffic_bytes  # the float32 casts and the wider pow


WEIGHTS_CFG = GPTConfig(vocab_size=128, seq_len=16, num_layers=3, hidden_dim=64, num_heads=4)


def test_weight_traffic_is_per_step_not_per_sample_and_the_rest_scales_with_the_batch():
    """weight_traffic_bytes (weight casts, and backward ops whose inputs and outputs all have a parameter's
    shape: gradient casts and accumulation) is the same at 1 and 2 samples (within 1%),
    a part of traffic_bytes; the rest of the traffic doubles with the batch."""
    model = _gpt(WEIGHTS_CFG)
    p1, p2 = (profile_model(model, synthetic_tokens(b, WEIGHTS_CFG), loss_fn=lm_loss, precision="bf16")
              for b in (1, 2))
    assert p1.weight_traffic_bytes > 0
    assert p2.weight_traffic_bytes == pytest.approx(p1.weight_traffic_bytes, rel=0.01)
    for p in (p1, p2):
        assert p.weight_traffic_bytes < p.traffic_bytes
    rest1, rest2 = (p.traffic_bytes - p.weight_traffic_bytes for p in (p1, p2))
    assert 1.8 * rest1 < rest2 < 2.2 * rest1


def test_weight_traffic_ignores_activations_shaped_like_a_weight():
    """Hugging Face GPT-2 flattens activations to 2-D (tokens, hidden) in its Conv1D layers: with 64 tokens and
    hidden 64 they have the shape of the (64, 64) position embedding and of the MLP's weights. Forward ops on
    them are not weight traffic, nor backward ops that read other tensors; what is left is the casts of
    activation gradients of exactly a weight's shape, which a shape cannot tell from a weight gradient's
    cast (15% of the weight traffic here). So at 1 and 2 samples the weight traffic is the same within 20%
    (the shape-only rule it replaced gave 1.6x as much at 1 sample as at 2, with a 30000 vocabulary), while
    the rest nearly doubles."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, n_positions=64, vocab_size=1000,
                                  attn_implementation="sdpa")
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    profiles = []
    for batch in (1, 2):
        ids = torch.zeros(batch, 64, dtype=torch.long, device="meta")
        profiles.append(profile_model(model, {"input_ids": ids, "labels": ids}, precision="bf16", warn=False))
    p1, p2 = profiles
    assert p1.weight_traffic_bytes > 0
    assert p2.weight_traffic_bytes == pytest.approx(p1.weight_traffic_bytes, rel=0.2)
    rest1, rest2 = (p.traffic_bytes - p.weight_traffic_bytes for p in (p1, p2))
    assert 1.8 <= rest2 / rest1 <= 2.2
