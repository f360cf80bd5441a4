"""Worker of tests/strategies/test_unused_params.py (torchrun, gloo, 2 ranks): models whose ranks' forwards use
different parameters, each rank training on its own batch. argv: OUT.pt. Rank 0 writes the mean loss of every step,
every parameter in full after the last, the parameters whose units reduce zeros, and what autopar said while
wrapping. `reference(name)`: one plain process whose step's loss is the mean of the ranks' losses on their batches
(the gradient DDP with find_unused_parameters=True averages)."""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autopar

STEPS = 3


class MultiTask(nn.Module):
    """Two task heads; the batch says which one its loss uses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
        self.head_a = nn.Linear(32, 3)
        self.head_b = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor, task: int) -> torch.Tensor:
        h = self.trunk(x)
        if task == 0:
            return F.cross_entropy(self.head_a(h), y)
        return F.mse_loss(self.head_b(h).squeeze(-1), y.float())


class LayeredMultiTask(nn.Module):
    """Two task heads over a trunk of repeated layers: the layers are the blocks, and the heads sit in the root
    unit."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 32)
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))
        self.head_a = nn.Linear(32, 3)
        self.head_b = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor, task: int) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        for layer in self.layers:
            h = torch.relu(layer(h))
        if task == 0:
            return F.cross_entropy(self.head_a(h), y)
        return F.mse_loss(self.head_b(h).squeeze(-1), y.float())


class Branches(nn.Module):
    """Two branches of one shape; the data's sign chooses one (ranks whose data differ take different ones)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 32)
        self.branches = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32)) for _ in range(2))
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = self.branches[0](h) if x.mean() > 0 else self.branches[1](h)
        return F.cross_entropy(self.head(h), y)


class ZeroBranches(Branches):
    """The branches end in zero-initialised layers (zero_init_residual, adaLN-Zero): the layers before get exact zero
    gradients where their branch runs, and one process still steps them (AdamW's decay and step count)."""

    def __init__(self) -> None:
        super().__init__()
        for branch in self.branches:
            nn.init.zeros_(branch[2].weight)
            nn.init.zeros_(branch[2].bias)


class Experts(nn.Module):
    """A top-1 mixture of experts that skips the experts no token was routed to (the usual loop)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.router = nn.Linear(16, 8)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(8))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        flat = h.reshape(-1, h.shape[-1])
        w, idx = torch.softmax(self.router(flat), -1).max(-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            sel = torch.nonzero(idx == e).squeeze(-1)
            if sel.numel() == 0:
                continue
            out = out.index_add(0, sel, expert(flat[sel]) * w[sel, None])
        return F.cross_entropy(self.head((h + out.view_as(h)).mean(1)), y)


def _tasks(step: int, rank: int, tasks: tuple[int, ...]) -> tuple:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g), tasks[rank]


def _signed(step: int, rank: int) -> tuple:
    g = torch.Generator().manual_seed(10 * step + rank)
    sign = 1.0 if (rank + step) % 2 == 0 else -1.0  # the ranks take different branches, swapped each step
    return torch.randn(4, 8, generator=g) + 2 * sign, torch.randint(0, 3, (4,), generator=g)


def _agreeing(step: int, rank: int) -> tuple:
    """The traced sample (step 0) takes a branch per rank; the later steps one branch on both ranks, in turn."""
    g = torch.Generator().manual_seed(10 * step + rank)
    sign = (1.0 if rank == 0 else -1.0) if step == 0 else (1.0 if step % 2 == 0 else -1.0)
    return torch.randn(4, 8, generator=g) + 2 * sign, torch.randint(0, 3, (4,), generator=g)


def _tokens(step: int, rank: int) -> tuple:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, 2, 8, generator=g), torch.randint(0, 3, (4,), generator=g)


# name: (model, batch(step, rank), plan fields)
SCENARIOS = {
    "tasks_sharded": (MultiTask, lambda s, r: _tasks(s, r, (0, 1)), dict(dp_shard=2)),
    "tasks_replicated": (MultiTask, lambda s, r: _tasks(s, r, (0, 1)), dict(dp_replicate=2)),
    # the traced sample has the ranks on different heads; the later steps have both on head a: no rank used head b,
    # whose gradient goes back to None, so AdamW leaves it as one process does
    "tasks_then_one_head": (MultiTask, lambda s, r: _tasks(s, r, (0, 1) if s == 0 else (0, 0)), dict(dp_shard=2)),
    "branches_replicated": (Branches, _signed, dict(dp_replicate=2)),
    "branches_sharded": (Branches, _signed, dict(dp_shard=2)),
    "experts_sharded": (Experts, _tokens, dict(dp_shard=2)),
    # every rank's sample and batches on task 0: head b (in the root unit, beside the trunk's layers) is never used
    # (kept None), and wrap warns that a later use on some ranks only would go unseen
    "one_task": (LayeredMultiTask, lambda s, r: _tasks(s, r, (0, 0)), dict(dp_shard=2)),
    # after the first step both ranks take one branch (the other unused: None), whose first layer gets exact zeros
    # (used: stepped)
    "zero_init_branches": (ZeroBranches, _agreeing, dict(dp_shard=2)),
}


def reference(name: str) -> dict:
    build, batch, _ = SCENARIOS[name]
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = (model(*batch(step, 0)) + model(*batch(step, 1))) / 2
        loss.backward()
        no_grad = [n for n, p in model.named_parameters() if p.grad is None]  # (the last step's, after backward)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "no_grad": no_grad}


def run_ranks(name: str) -> dict:
    build, batch, fields = SCENARIOS[name]
    rank = dist.get_rank()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model = autopar.wrap(build(), sample=batch(0, rank), plan=autopar.Plan(**fields, micro_batch_size=4),
                             verbose=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = model(*batch(step, rank))
        loss.backward()
        no_grad = [n for n, p in model.named_parameters() if p.grad is None]
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss)
        losses.append(loss.item() / 2)
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "used_on_some_ranks": autopar.applied(model).used_on_some_ranks,
            "no_grad": no_grad,
            "said": [str(w.message) for w in said if str(w.message).startswith("autopar:")]}


def main() -> None:
    from tests.distributed._launch import worker_main

    worker_main(run_ranks, list(SCENARIOS), sys.argv[1])


if __name__ == "__main__":
    main()
