"""Worker of tests/distributed/test_checkpoint_buffers.py (torchrun, gloo, 2 ranks): a model with a BatchNorm1d
wrapped under FSDP (dp_shard=2); both ranks run a forward in train mode on the same samples and autopar.save;
then on different samples and autopar.save twice. Rank 0 writes each rank's autopar.save warnings per phase.
argv: CKPT_DIR OUT.pt"""

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
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))
        self.body = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(self.body(x))


def saved_warnings(model: nn.Module, opt: torch.optim.Optimizer, ckpt: str, times: int) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(times):
            autopar.save(model, opt, ckpt)
    return [str(w.message) for w in seen if str(w.message).startswith("autopar.save:")]


def main(ckpt: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # wrap's own BatchNorm note is not under test here
        model = autopar.wrap(Net(), sample=torch.randn(4, 8), plan=autopar.Plan(dp_shard=2, micro_batch_size=4),
                             verbose=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(1)))  # the same samples on both ranks
    same = saved_warnings(model, opt, ckpt, 1)
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(2 + rank)))  # each rank its own
    different = saved_warnings(model, opt, ckpt, 2)
    mine = {"same": same, "different": different}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if rank == 0:
        torch.save(every, out)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads can abort the interpreter's teardown (see _ckpt_worker.py)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
