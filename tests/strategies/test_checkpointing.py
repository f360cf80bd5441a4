"""Tests of autopar.strategies.checkpointing: names, state_dict keys and types are kept; full, selective,
alternate and gemms checkpointing give the same loss and gradients as none; the memory kept for backward is ordered
none > selective > alternate > gemms > full, and every=2 lies between none and full; the forward really runs
again."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.models.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens
from autopar.strategies.checkpointing import _alternate_context, _gemms_context, apply_checkpointing, selective_policy

CFG = GPTConfig(vocab_size=128, seq_len=64, num_layers=4, hidden_dim=64, num_heads=4)
MODES = [("full", 1), ("selective", 1), ("alternate", 1), ("gemms", 1), ("full", 2), ("selective", 2),
         ("alternate", 2), ("gemms", 2)]


def _model(mode: str = "none", every: int = 1) -> GPT:
    torch.manual_seed(0)
    model = GPT(CFG)
    apply_checkpointing(list(model.blocks.named_children()), mode=mode, every=every)
    return model


def _blocks(model: GPT):
    return [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]


def _x(batch: int = 4) -> torch.Tensor:
    return synthetic_tokens(batch, CFG, seed=3)


def _loss_and_grads(model: nn.Module):
    x = _x()
    loss = lm_loss(model(x), x)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


# ---- structure ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode, every", MODES)
def test_names_state_dict_and_types_are_kept(mode, every):
    torch.manual_seed(0)
    model = GPT(CFG)
    names = [n for n, _ in model.named_modules()]
    keys = list(model.state_dict())
    types = [type(m) for m in model.modules()]
    done = apply_checkpointing(_blocks(model), mode=mode, every=every)
    assert done == [f"blocks.{i}" for i in range(0, CFG.num_layers, every)]
    assert [n for n, _ in model.named_modules()] == names
    assert list(model.state_dict()) == keys
    assert [type(m) for m in model.modules()] == types
    for i, block in enumerate(model.blocks):
        assert ("forward" in vars(block)) == (i % every == 0)  # only the instance's forward is replaced
    assert "forward" not in vars(model)
    # a state dict saved before loads into the checkpointed model and back
    fresh = GPT(CFG)
    fresh.load_state_dict(model.state_dict())
    model.load_state_dict(fresh.state_dict())


def test_none_changes_nothing_and_bad_arguments_are_refused():
    torch.manual_seed(0)
    model = GPT(CFG)
    assert apply_checkpointing(_blocks(model), mode="none") == []
    assert all("forward" not in vars(b) for b in model.blocks)
    with pytest.raises(ValueError, match="'none', 'full', 'gemms', 'alternate' or 'selective'"):
        apply_checkpointing(_blocks(model), mode="partial")
    with pytest.raises(ValueError, match="n >= 1"):
        apply_checkpointing(_blocks(model), mode="full", every=0)
    assert all("forward" not in vars(b) for b in model.blocks)


# ---- numerics ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def baseline():
    return _loss_and_grads(_model("none"))


@pytest.mark.parametrize("mode, every", MODES)
def test_same_loss_and_gradients_as_no_checkpointing(baseline, mode, every):
    ref_loss, ref_grads = baseline
    loss, grads = _loss_and_grads(_model(mode, every))
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
    assert set(grads) == set(ref_grads)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=0, atol=1e-6, msg=n)


def test_eval_mode_and_no_grad_still_work():
    model = _model("full").eval()
    x = _x()
    with torch.no_grad():
        out = model(x)
    ref = _model("none").eval()
    with torch.no_grad():
        torch.testing.assert_close(out, ref(x), rtol=0, atol=1e-6)


class _ForwardCounter:
    """Counts calls of a module (a pre-hook: recomputation may stop early, before a module returns)."""

    def __init__(self, module: nn.Module):
        self.calls = 0
        module.register_forward_pre_hook(self)

    def __call__(self, *_):
        self.calls += 1


@pytest.mark.parametrize("mode, every, block, expected", [
    ("none", 1, 0, 1), ("full", 1, 0, 2), ("selective", 1, 0, 2), ("alternate", 1, 0, 2), ("gemms", 1, 0, 2),
    ("full", 2, 0, 2),
    ("full", 2, 1, 1),
])
def test_checkpointed_blocks_run_their_forward_again_in_backward(mode, every, block, expected):
    model = _model(mode, every)
    counter = _ForwardCounter(model.blocks[block].attn.q_proj)
    x = _x()
    loss = lm_loss(model(x), x)
    assert counter.calls == 1
    loss.backward()
    assert counter.calls == expected


def test_selective_policy_keeps_matmuls_and_recomputes_the_rest():
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    assert selective_policy(None, aten.mm.default) == CheckpointPolicy.MUST_SAVE
    assert selective_policy(None, aten.addmm.default) == CheckpointPolicy.MUST_SAVE
    assert selective_policy(None, aten._scaled_dot_product_flash_attention_for_cpu.default) == CheckpointPolicy.MUST_SAVE
    assert selective_policy(None, aten.convolution.default) == CheckpointPolicy.MUST_SAVE  # as the trace counts it
    assert selective_policy(None, aten._grouped_mm.default) == CheckpointPolicy.MUST_SAVE
    for op in (aten.gelu.default, aten.native_layer_norm.default, aten.add.Tensor, aten.mul.Tensor):
        assert selective_policy(None, op) == CheckpointPolicy.PREFER_RECOMPUTE


def _policy_of(make_context, monkeypatch):
    """The policy function a context maker hands torch's create_selective_checkpoint_contexts."""
    import autopar.strategies.checkpointing as ckpt

    seen = []
    monkeypatch.setattr(ckpt, "create_selective_checkpoint_contexts", lambda fn: seen.append(fn) or (None, None))
    make_context()
    (policy,) = seen
    return policy


_FORWARD, _AGAIN = type("Ctx", (), {"is_recompute": False})(), type("Ctx", (), {"is_recompute": True})()


def test_alternate_keeps_every_other_gemm_and_decides_alike_when_it_recomputes(monkeypatch):
    """The policy "alternate" hands torch's selective checkpointing: GEMMs kept and recomputed in turn (first,
    third, ... kept), the recomputation's own count giving each GEMM its forward's decision; attention kept, the
    cheap rest recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    policy = _policy_of(_alternate_context, monkeypatch)
    ops = [aten.mm.default, aten.gelu.default, aten.addmm.default, aten.bmm.default,
           aten._scaled_dot_product_flash_attention_for_cpu.default, aten.mm.default]
    keep, again_keep = [policy(_FORWARD, op) for op in ops], [policy(_AGAIN, op) for op in ops]
    save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert keep == [save, recompute, recompute, save, save, recompute]
    assert again_keep == keep


def test_gemms_recomputes_every_dense_gemm_and_keeps_attention(monkeypatch):
    """The policy "gemms" hands torch's selective checkpointing: every dense GEMM recomputed (in the forward and in
    the recomputation alike), attention and convolutions kept, the cheap rest recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    policy = _policy_of(_gemms_context, monkeypatch)
    ops = [aten.mm.default, aten.gelu.default, aten.addmm.default, aten.bmm.default,
           aten._scaled_dot_product_flash_attention_for_cpu.default, aten.convolution.default, aten.mm.default]
    save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    expected = [recompute, recompute, recompute, recompute, save, save, recompute]
    assert [policy(_FORWARD, op) for op in ops] == expected and [policy(_AGAIN, op) for op in ops] == expected


# ---- memory --------------------------------------------------------------------------------------------
def _hooked_saved_bytes(model: nn.Module) -> int:
    """Bytes of the distinct storages autograd saves for backward, seen by saved_tensors_hooks in forward."""
    params = {StorageWeakRef(p.untyped_storage()) for p in model.parameters()}
    seen: dict = {}

    def pack(t):
        key = StorageWeakRef(t.untyped_storage())
        if key not in params:
            seen[key] = t.untyped_storage().nbytes()
        return t

    x = _x()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lm_loss(model(x), x)
    return sum(seen.values())


class _Allocations(TorchDispatchMode):
    """Weak references to every storage an op creates."""

    def __init__(self):
        super().__init__()
        self.storages: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                self.storages[StorageWeakRef(s)] = s.nbytes()
        return out


def _live_bytes_after_forward(model: nn.Module) -> int:
    """Bytes of the storages created by forward that are still alive when backward could start.

    This is what checkpointing saves: non-reentrant checkpointing keeps what it needs behind its own
    saved-tensor hooks (which take precedence over an outer `saved_tensors_hooks`), so the memory it
    keeps is measured by what stays alive, not by what an outer hook sees.
    """
    x = _x()
    with _Allocations() as alloc:
        loss = lm_loss(model(x), x)
    gc.collect()
    live = sum(n for ref, n in alloc.storages.items() if not ref.expired())
    del loss
    return live


@pytest.fixture(scope="module")
def live_bytes():
    return {(mode, every): _live_bytes_after_forward(_model(mode, every))
            for mode, every in [("none", 1)] + MODES}


def test_memory_kept_for_backward_is_ordered_none_selective_alternate_gemms_full(live_bytes):
    none, selective, full = live_bytes["none", 1], live_bytes["selective", 1], live_bytes["full", 1]
    assert none > selective > live_bytes["alternate", 1] > live_bytes["gemms", 1] > full
    # full checkpointing keeps little more than each block's input: well under half of none here
    assert full < 0.5 * none
    # selective keeps the matmul outputs: a real saving, but less than full
    assert selective < 0.9 * none


def test_checkpointing_every_second_block_lies_between(live_bytes):
    assert live_bytes["none", 1] > live_bytes["full", 2] > live_bytes["full", 1]
    assert live_bytes["none", 1] > live_bytes["selective", 2] > live_bytes["selective", 1]
    # half of the blocks checkpointed: about halfway
    mid = (live_bytes["none", 1] + live_bytes["full", 1]) / 2
    assert live_bytes["full", 2] == pytest.approx(mid, rel=0.15)


def test_saved_tensor_hooks_see_less_saved_with_checkpointing():
    none = _hooked_saved_bytes(_model("none"))
    every2 = _hooked_saved_bytes(_model("full", 2))
    full = _hooked_saved_bytes(_model("full", 1))
    assert none > every2 > full > 0


def test_live_measure_follows_the_batch():
    small = _live_bytes_after_forward(_model("none"))
    x8 = synthetic_tokens(8, CFG, seed=3)
    model = _model("none")
    with _Allocations() as alloc:
        loss = lm_loss(model(x8), x8)
    gc.collect()
    big = sum(n for ref, n in alloc.storages.items() if not ref.expired())
    del loss
    assert big == pytest.approx(2 * small, rel=0.1)


# ---- a Hugging Face model ------------------------------------------------------------------------------
def _llama_loss_and_grads(mode, *, cache_hook=False, **call_kwargs):
    transformers = pytest.importorskip("transformers")
    from autopar._util.kv_cache import kv_cache_off_in_training

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    keys = list(model.state_dict())
    done = apply_checkpointing(list(model.model.layers.named_children()), mode=mode)
    assert list(model.state_dict()) == keys and len(done) == (0 if mode == "none" else 2)
    if cache_hook:
        assert kv_cache_off_in_training(model) == ["", "model"]
    out = model(input_ids=ids, labels=ids, **call_kwargs)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def llama_baseline():
    return _llama_loss_and_grads("none")


def _assert_same(result, baseline):
    (loss, grads), (ref_loss, ref_grads) = result, baseline
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("mode", ["full", "selective", "alternate", "gemms"])
def test_llama_layers_checkpointed_without_cache_give_the_same_gradients(llama_baseline, mode):
    _assert_same(_llama_loss_and_grads(mode, use_cache=False), llama_baseline)


def test_llama_full_checkpointing_with_the_default_call(llama_baseline):
    _assert_same(_llama_loss_and_grads("full"), llama_baseline)


def test_llama_selective_checkpointing_needs_the_kv_cache_off(llama_baseline):
    """With the cache on (the default call), the recomputed layer appends to the cache the first run
    filled and selective checkpointing's replay no longer matches (in the transformers versions whose
    cache is filled during a training forward, e.g. 5.24; 5.17 did not fill it): with the hook apply_plan
    puts on the model (kv_cache_off_in_training) the default call runs without the cache, and matches."""
    try:
        _llama_loss_and_grads("selective")
    except RuntimeError as exc:  # the failure the cache causes, where it does
        assert "encountered during backward" in str(exc)
    _assert_same(_llama_loss_and_grads("selective", cache_hook=True), llama_baseline)


# ---- BatchNorm's running statistics --------------------------------------------------------------------
class _ConvBlock(nn.Module):
    def __init__(self, channels: int, momentum: float | None) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(channels, momentum=momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.conv(x))) + x


class _ConvNet(nn.Module):
    """A tiny conv net with BatchNorm in every block (momentum None: a cumulative average, where the batch
    count decides the statistics)."""

    def __init__(self, momentum: float | None = 0.1) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList(_ConvBlock(8, momentum) for _ in range(3))
        self.head = nn.Linear(8, 5)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.stem(pixel_values)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x.mean(dim=(2, 3)))
        return nn.functional.cross_entropy(logits, labels)


def _conv_sample(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return {"pixel_values": torch.randn(4, 3, 8, 8, generator=gen), "labels": torch.randint(0, 5, (4,), generator=gen)}


def _train_conv(model: nn.Module, steps: int = 3) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    for step in range(steps):
        model(**_conv_sample(step)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _assert_same_state(model: nn.Module, reference: nn.Module) -> None:
    buffers, ref_buffers = dict(model.named_buffers()), dict(reference.named_buffers())
    assert buffers.keys() == ref_buffers.keys()
    for name, want in ref_buffers.items():  # running_mean, running_var, num_batches_tracked
        torch.testing.assert_close(buffers[name], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"buffer {name}: {m}")
    params = dict(model.named_parameters())
    for name, want in reference.named_parameters():
        torch.testing.assert_close(params[name].detach(), want.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"parameter {name}: {m}")


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("mode", ["full", "selective", "alternate", "gemms"])
def test_recomputation_leaves_batchnorm_running_statistics_as_the_unwrapped_model(mode, momentum):
    """The recomputed forward in backward runs BatchNorm in training mode again; it must not update the
    running statistics a second time: after 3 steps buffers and parameters equal the unwrapped model's."""
    torch.manual_seed(0)
    model = _ConvNet(momentum)
    reference = copy.deepcopy(model)
    done = apply_checkpointing(list(model.blocks.named_children()), mode=mode)
    assert len(done) == 3
    _train_conv(model)
    _train_conv(reference)
    assert int(model.blocks[0].norm.num_batches_tracked) == 3
    _assert_same_state(model, reference)


def test_wrap_with_full_checkpointing_keeps_batchnorm_statistics(one_plain_process):
    import autopar

    torch.manual_seed(0)
    model = _ConvNet()
    reference = copy.deepcopy(model)
    autopar.wrap(model, sample=_conv_sample(0), plan=autopar.Plan(micro_batch_size=4, checkpointing="full"),
                 verbose=False)
    assert len(autopar.applied(model).checkpointed) == 3
    _train_conv(model)
    _train_conv(reference)
    _assert_same_state(model, reference)
