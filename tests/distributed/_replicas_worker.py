"""Worker of tests/strategies/test_replicas.py (torchrun, gloo, 2 ranks): each rank seeds its model
differently, wraps it under a replicated plan (dp_replicate=2), trains 2 steps on its own samples; rank 0
writes every rank's parameters at wrap and after the steps, rank 0's initial ones, and the warnings seen.
argv: OUT.pt"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

import autopar


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 2)
        self.register_buffer("feature_mean", torch.zeros(8))  # a running mean of its own, written in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        with torch.no_grad():
            self.feature_mean.mul_(0.9).add_(0.1 * x.mean(0))
        return self.head(self.norm(x))


def flat(model: nn.Module) -> torch.Tensor:
    local = [(p.to_local() if hasattr(p, "to_local") else p).detach().reshape(-1) for p in model.parameters()]
    return torch.cat(local)


def gathered(model: nn.Module) -> list[torch.Tensor]:
    mine = flat(model)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return out


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)  # a different model on each rank
    model = Net()
    initial = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = autopar.wrap(model, sample=torch.randn(4, 8), plan=autopar.Plan(dp_replicate=2, micro_batch_size=4),
                             verbose=False)
    at_wrap = gathered(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    after = gathered(model)
    initials = [torch.empty_like(initial) for _ in range(dist.get_world_size())]
    dist.all_gather(initials, initial)
    if rank == 0:
        torch.save({"at_wrap": at_wrap, "after": after, "initials": initials,
                    "warnings": [str(w.message) for w in seen]}, out)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
