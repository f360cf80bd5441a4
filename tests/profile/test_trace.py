"""The bf16 trace: CUDA autocast's float32 ops, and weight traffic told from activation traffic."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autopar.errors import TraceError
from autopar.models.gpt import GPTConfig, lm_loss, synthetic_tokens
from autopar.profile import profile_model
from tests.profile._helpers import _gpt, _mlp


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
    import autopar.profile.cuda_autocast

    seen: list = []
    torch.manual_seed(0)
    model, x = _Cube(seen), torch.randn(4, 16)
    cuda_like = profile_model(model, x, precision="bf16", warn=False)
    assert seen and set(seen) == {torch.float32}
    seen.clear()
    monkeypatch.setattr(autopar.profile.cuda_autocast, "_CUDA_FP32_OPS", frozenset())
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



def test_a_step_that_cannot_run_on_fake_tensors_raises_trace_error_with_the_cause():
    """api.wrap branches on the type: a TraceError (a ProfileError) still lets a given plan be applied."""
    with pytest.raises(TraceError) as info:
        profile_model(_mlp(), torch.randn(3, 9), warn=False)  # 9 features, the model takes 8
    assert isinstance(info.value.__cause__, RuntimeError)


class _AttributeTable(nn.Module):
    """A position table kept as a plain tensor attribute (neither a parameter nor a buffer), read with detach()
    as VideoMAE reads its sinusoidal table; it was a real tensor in the fake step, and the trace failed."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.table = torch.randn(1, 8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x + self.table.detach().type_as(x).to(x.device))


def test_a_tensor_kept_as_a_plain_module_attribute_is_traced_and_left_as_it_was():
    model = _AttributeTable()
    table = model.table
    before = table.clone()
    profile = profile_model(model, torch.randn(4, 8, 16))
    assert profile.traced and profile.flops > 0
    assert model.table is table and torch.equal(model.table, before) and not model.table.is_meta


def test_a_forward_that_checkpoints_its_layers_is_traced_through_the_recompute():
    """torch.utils.checkpoint reruns a module's forward in backward: the trace keeps the fake weights swapped in
    until backward ends (it raised "Please convert all Tensors to FakeTensors" on the real weights)."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = checkpoint(layer, x, use_reentrant=False)
            return x.sum()

    model = Checkpointed()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    profile = profile_model(model, torch.randn(8, 16), warn=False)
    plain = profile_model(nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)]), torch.randn(8, 16), warn=False)
    assert profile.forward_flops == plain.forward_flops > 0
    assert profile.flops >= plain.flops
    assert all(b.flops > 0 for b in profile.blocks)
    assert all(torch.equal(p, before[n]) and p.grad is None for n, p in model.named_parameters())  # untouched


class _PairBlock(nn.Module):
    """A block whose forward makes a broadcast product (tokens x tokens x features) before summing it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        pairs = (h[:, :, None, :] * h[:, None, :, :]).sum(dim=2)  # (batch, tokens, tokens, 16), then summed
        return x + pairs


class _PairStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 16)
        self.layers = nn.ModuleList(_PairBlock() for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_the_profile_says_which_op_and_where_made_the_largest_tensor():
    profile = profile_model(_PairStack(), torch.randn(2, 64, 16))
    # the first block's broadcast product, 2 x 64 x 64 x 16 float32 values; later blocks' equal ones do not replace it
    assert profile.largest_transient_bytes == 2 * 64 * 64 * 16 * 4
    assert profile.largest_transient_op == "mul"
    assert profile.largest_transient_where == "the forward of block layers.0"
    assert "(mul, in the forward of block layers.0)" in profile.describe()


class _Converts(nn.Module):
    """A forward that converts a submodule, as NLLB-MoE's router does (`self.classifier = self.classifier.to(dtype)`):
    to its own dtype (nothing changes) or, in the bf16-weights trace, to float32 (a new tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.router, self.out = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = self.inp(x)
        self.router = self.router.to(torch.float32)
        return self.out(self.router(h.float()).to(h.dtype))


@pytest.mark.parametrize("precision", ["fp32", "bf16-pure"])
def test_a_forward_that_converts_a_submodule_is_traced_and_the_model_left_as_it_was(precision):
    torch.manual_seed(0)
    model, x = _Converts(), torch.randn(4, 16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    router = model.router.weight
    prof = profile_model(model, x, precision=precision, warn=False)  # torch's swap of a fake parameter raised here
    assert prof.traced and prof.num_params == sum(p.numel() for p in model.parameters()) and prof.flops > 0
    assert model.router.weight is router and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(type(p) is nn.Parameter and not p.is_meta for p in model.parameters())
    assert nn.Module._apply.__qualname__ == "Module._apply"  # the trace's own conversion is gone after it
