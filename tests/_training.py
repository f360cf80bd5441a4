"""Shared by the parity tests and their worker processes: the model, the data and the reference run.

The reference is one process on the full global batch, plain PyTorch, no autopar. Its bf16 variant
reproduces FSDP2's MixedPrecisionPolicy by hand: parameters cast to bf16 for compute (with autograd, so
gradients land on the fp32 parameters), outputs cast to fp32, fp32 master weights and optimizer state.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from autopar.models.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens

CFG = GPTConfig(vocab_size=128, seq_len=32, num_layers=4, hidden_dim=64, num_heads=4)
GLOBAL_BATCH = 8
STEPS = 10
LR = 3e-3


def make_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=False)


def batch(step: int) -> torch.Tensor:
    return synthetic_tokens(GLOBAL_BATCH, CFG, step=step, seed=1)


def local_rows(x: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    n = x.shape[0] // size
    return x[rank * n:(rank + 1) * n]


def _bf16_forward(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        params = {name: p.to(torch.bfloat16) for name, p in model.named_parameters()}
        return torch.func.functional_call(model, params, (x,), tie_weights=True).float()

    return forward


def reference(precision: str = "fp32", steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses per step and final parameters of one process training on the full batch."""
    model = make_model()
    opt = make_optimizer(model)
    forward = _bf16_forward(model) if precision == "bf16" else model
    losses = []
    for step in range(steps):
        x = batch(step)
        loss = lm_loss(forward(x), x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
