"""Worker of tests/strategies/test_materialize.py (torchrun, gloo, 2 ranks): a real backbone with a head built
on meta, wrapped under FSDP on both ranks; rank 0 writes the backbone's full parameters after wrap and the
head's, and whether any were meta. argv: OUT.pt"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import autopar


class Net(nn.Module):
    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2))
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def pretrained() -> Net:
    """The same real weights on every rank (seeded), and a head on meta."""
    torch.manual_seed(0)
    with torch.device("meta"):
        head = nn.Linear(16, 4)
    return Net(head)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def main(out: str) -> None:
    model = pretrained()
    real = {n: p.detach().clone() for n, p in model.named_parameters() if not p.is_meta}
    sample = torch.randn(4, 16)
    wrapped = autopar.wrap(model, sample=sample, plan=autopar.Plan(dp_shard=2, micro_batch_size=4), verbose=False)
    after = {n: full(p) for n, p in wrapped.named_parameters()}
    if dist.get_rank() == 0:
        torch.save({"real": real, "after": after, "plan": autopar.applied(wrapped).plan.dp_shard}, out)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
