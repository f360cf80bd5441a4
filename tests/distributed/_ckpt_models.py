"""The model and optimizer of the checkpoint fault tests (tests/test_checkpoint.py and its kill worker): a few
large layers (a save takes a fraction of a second), with Adam state after one step; seeded."""

from __future__ import annotations

import torch
import torch.nn as nn


def model_and_optimizer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The same values bit for bit in every process: one thread for the step (a matmul's sums are ordered by
    the thread count, which differs between pytest's workers and the kill worker)."""
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model(torch.randn(4, 1024)).square().mean().backward()
        opt.step()
    finally:
        torch.set_num_threads(threads)
    opt.zero_grad()
    return model, opt
