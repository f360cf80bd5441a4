"""Worker of tests/test_stale_optimizer.py (torchrun, gloo, 2 ranks): an FSDP plan applied to a model whose
optimizer was built before wrap; each rank writes what its first step raised, then whether an optimizer built
after wrap changes the parameters. argv: OUT (each rank writes OUT.RANK)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import autopar


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def main(out: str) -> None:
    torch.manual_seed(0)
    model = Net()
    early = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model = autopar.wrap(model, sample=torch.randn(4, 8), plan=autopar.Plan(dp_shard=2, micro_batch_size=4),
                         verbose=False)
    try:
        step(model, early)
        result = "no error"
    except Exception as exc:
        result = f"{type(exc).__name__}: {exc}"
    late = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = [p.detach().full_tensor().clone() for p in model.parameters()]
    step(model, late)
    changed = all(not torch.equal(a, p.detach().full_tensor()) for a, p in zip(before, model.parameters()))
    with open(f"{out}.{dist.get_rank()}", "w") as f:
        f.write(result + ("\nafter: trained" if changed else "\nafter: unchanged"))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
