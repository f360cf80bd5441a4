"""Worker of tests/distributed/test_wrap_cache.py (torchrun, gloo, 2 ranks): wraps the same model twice with no
plan (autopar chooses), rank 1 with a cache folder of its own that stays empty (rank 0's cache decides), trains
each wrapped model 3 steps on this rank's data and writes, per rank and wrap, the plan, whether it came from wrap's
cache and the losses. argv: OUT.pt RANK1_CACHE_DIR"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

import autopar


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def main(out: str, rank1_cache: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 1:
        os.environ["AUTOPAR_CACHE_DIR"] = rank1_cache
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = autopar.wrap(Net(), sample=torch.randn(4, 16), verbose=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(10 + rank)
        losses = []
        for _ in range(3):
            loss = model(torch.randn(4, 16, generator=gen)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        plan = autopar.plan_of(model)
        runs.append({"plan": plan.to_yaml(), "cached": "cached_at" in (plan.prediction or {}), "losses": losses})
    gathered = [None, None]
    dist.all_gather_object(gathered, runs)
    if rank == 0:
        torch.save(gathered, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
