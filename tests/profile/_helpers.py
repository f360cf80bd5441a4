"""Models and checks the profile tests share: a plain MLP, the built-in GPT, snapshots of a model."""

from __future__ import annotations

import torch
import torch.nn as nn

from autopar.models.gpt import GPT, GPTConfig


SMALL = GPTConfig(vocab_size=128, seq_len=64, num_layers=3, hidden_dim=64, num_heads=4)


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


def _hf_sample(vocab: int, batch: int = 2, seq: int = 128) -> dict:
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}

