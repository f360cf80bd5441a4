"""profile_model on a plain MLP and the built-in GPT: parameter counts, FLOPs against 6N + 12 L h s, shape
facts, bytes saved for backward, the largest tensor, meta-device models, that profiling never touches the
model; and the errors a user meets."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from autopar.errors import ProfileError
from autopar.models.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens
from autopar.profile import ModelProfile, model_fingerprint, profile_model
from tests.profile._helpers import SMALL, _assert_untouched, _gpt, _mlp, _snapshot


# Shapes where attention matters (12 L h s is 20-30% of 6N per token) and embeddings do not dominate.
ATTENTION_SHAPES = [
    GPTConfig(vocab_size=256, seq_len=256, num_layers=2, hidden_dim=128, num_heads=4),
    GPTConfig(vocab_size=512, seq_len=256, num_layers=3, hidden_dim=192, num_heads=6),
]


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


# ---- the built-in GPT ------------------------------------------------------------------------------
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


class _Branchy(nn.Module):
    """A forward whose control flow reads a value its weights compute (`if y.sum() > threshold`)."""

    def __init__(self, threshold: float = 0.0):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.threshold = threshold

    def forward(self, x):
        y = self.lin(x)
        return y * 2 if bool(y.sum() > self.threshold) else y


def test_data_dependent_control_flow_is_reported():
    with torch.device("meta"):  # no values to read: no trace can follow its branch
        meta = _Branchy()
    with pytest.raises(ProfileError, match="data-dependent"):
        profile_model(meta, torch.randn(2, 4), warn=False)


def test_a_forward_that_reads_what_its_weights_compute_is_traced_with_their_values_and_says_so_once():
    """Issue 33, item 3: control flow on a value the weights compute (`if y.sum() > 0`, `nonzero`) cannot run on
    fake tensors alone; a model with real weights is traced again with their values beside the fake tensors,
    with one warning that names the op, and plans."""
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.out = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            y = self.out(y) if bool(y.sum() > -1e9) else y  # always taken: the trace must follow it
            return y * (y != 0).nonzero().shape[0]

    model = Branchy()
    before = _snapshot(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profile = profile_model(model, torch.randn(2, 4))
    said = [str(w.message) for w in caught if "weights compute" in str(w.message)]
    assert len(said) == 1 and "aten._local_scalar_dense" in said[0], said
    assert any("weights compute" in n for n in profile.notes) and profile.value_reads >= 1
    assert profile.forward_flops >= 2 * (2 * 2 * 4 * 4)  # both Linears: the branch taken was traced
    _assert_untouched(model, before)


def test_the_bf16_traces_of_a_step_that_reads_its_weights_values_go_to_them_at_once(monkeypatch):
    """The fp32 profile found the step reads what its weights compute: the bf16 traces are made with the weights'
    values at once, not first on fake tensors alone (a trace that would fail the same way)."""
    import autopar.profile.build as build
    from autopar.planning import bf16_variants, resolve_topology

    model = _Branchy(threshold=-1e9)  # the branch always taken
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        profile = profile_model(model, torch.randn(2, 4))
    assert profile.traced_with_weight_values
    traced, real = [], build._traced

    def counting(*args, real_weights=False, **kwargs):
        traced.append((args[4], real_weights))
        return real(*args, real_weights=real_weights, **kwargs)

    monkeypatch.setattr(build, "_traced", counting)
    variants = bf16_variants(model, torch.randn(2, 4), resolve_topology("1xH200"), profile=profile)
    assert set(variants) == {"bf16", "bf16-pure"}
    assert traced == [("bf16", True), ("bf16-pure", True)]
    assert all(v.traced_with_weight_values for v in variants.values())
    assert not profile_model(nn.Linear(4, 4), torch.randn(2, 4)).traced_with_weight_values


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



def test_a_torchscript_module_is_refused_in_one_line_naming_it():
    """The trace's hooks (and FSDP2's) do not take TorchScript modules ("register_forward_pre_hook is not supported
    on ScriptModules", raised from deep in the trace): profile_model, so wrap and autopar.plan, refuse it first."""
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.tanh(self.lin(x))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(torch.jit.script(Block()) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    for model, named in ((Net(), "blocks.0"), (torch.jit.script(Block()), "RecursiveScriptModule")):
        with pytest.raises(ProfileError) as info:
            profile_model(model, torch.randn(4, 8), warn=False)
        assert "\n" not in str(info.value) and str(info.value).startswith(f"{named} is a TorchScript module")


class _DropPath(torch.nn.Module):
    """A forward that draws with a factory (torch.rand), as stochastic depth does."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * (torch.rand(x.shape[0], 1) > 0.2))


@pytest.mark.parametrize("weight_values", [False, True])
def test_tracing_leaves_the_random_stream_as_it_found_it(weight_values):
    """A seeded run draws the same masks wrapped or not (docs/reliability.md: planning changes nothing)."""
    torch.manual_seed(0)
    model, x = _DropPath(), torch.randn(8, 8)
    before = torch.get_rng_state()
    profile_model(model, x, warn=False, weight_values=weight_values)
    assert torch.equal(torch.get_rng_state(), before)


class _CheckpointedAttention(nn.Module):
    """Blocks whose forward the model checkpoints itself (torch.utils.checkpoint, non-reentrant) around attention with
    a boolean mask: the replay in backward ran outside the trace's flash-like attention and saved a float mask
    ("CheckpointError: Recomputed values ... have different metadata")."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.qkv = nn.ModuleList(nn.Linear(32, 96) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()

        def attend(qkv: nn.Module, h: torch.Tensor) -> torch.Tensor:
            q, k, v = qkv(h).view(h.shape[0], h.shape[1], 3, 2, 16).permute(2, 0, 3, 1, 4)
            return h + torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2) \
                .reshape(h.shape)

        for qkv in self.qkv:
            h = torch.utils.checkpoint.checkpoint(attend, qkv, h, use_reentrant=False)
        return h.pow(2).mean()


def test_a_forward_that_checkpoints_attention_itself_is_traced_with_torchs_attention():
    profile = profile_model(_CheckpointedAttention(), torch.randn(4, 10, 8), warn=False, graphs=False)
    assert profile.flops > 0 and any("checkpoints attention itself" in n for n in profile.notes)
