"""Worker of tests/strategies/test_ema.py (torchrun, gloo, 2 ranks): an average of the weights (EMA) kept by the
user's loop as docs/train_step.md shows, under a sharded and a replicated plan. argv: OUT.pt. Rank 0 writes the
EMA's and the weights' full tensors after the steps. `reference()`: the same loop in one plain process on the
whole batch."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autopar

STEPS, DECAY = 4, 0.9
PLANS = {"sharded": dict(dp_shard=2, micro_batch_size=4), "replicated": dict(dp_replicate=2, micro_batch_size=4)}


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)


def train(model: nn.Module, rows: slice) -> list[torch.Tensor]:
    """The loop of docs/train_step.md: the EMA made of the model's own parameters after wrap, updated after each step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = [p.detach().clone() for p in model.parameters()]  # under FSDP: this rank's shards
    for step in range(STEPS):
        x, y = batch(step)
        F.cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for average, p in zip(ema, model.parameters()):
                average.lerp_(p.detach(), 1 - DECAY)
    return ema


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def reference() -> dict:
    model = build()
    ema = train(model, slice(0, 8))
    return {"ema": [e.clone() for e in ema], "params": [p.detach().clone() for p in model.parameters()]}


def run_ranks(name: str) -> dict:
    rank = dist.get_rank()
    rows = slice(4 * rank, 4 * rank + 4)
    model = autopar.wrap(build(), sample=batch(0)[0][rows], plan=autopar.Plan(**PLANS[name]),
                         loss_fn=lambda out, b: out.square().mean(), verbose=False)
    ema = train(model, rows)
    return {"ema": [_full(e) for e in ema], "params": [_full(p) for p in model.parameters()],
            "kinds": [type(e).__name__ for e in ema]}


def main() -> None:
    from tests.distributed._launch import worker_main

    worker_main(run_ranks, list(PLANS), sys.argv[1])


if __name__ == "__main__":
    main()
