"""The model and optimizer of the checkpoint fault tests (tests/test_checkpoint.py and its kill worker): a few
large layers (a save takes a fraction of a second), with Adam state after one step; seeded."""

from __future__ import annotations

import torch
import torch.nn as nn


def model_and_optimizer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 1024)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt
