"""Worker of tests/strategies/test_fsdp_shared.py (torchrun, gloo, 2 ranks; the reference in one plain process).

argv: OUT.pt. Every scenario under its FSDP plan on the ranks; rank 0 writes the results: the loss of every step,
after the last step every parameter and gradient in full, the first step's gradients (a loop of its own steps),
and what the wrapped model shares (`tied`). `run_reference(name)`: the same model trained unwrapped in one
process on the global batch.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autopar

STEPS = 3
ROWS = 8  # the global batch: 4 per rank on 2 ranks
DIM, CLASSES, BLOCKS = 16, 8, 4


class Block(nn.Module):
    """A block with a layer of its own and `shared`, one module object held by every block."""

    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        self.shared = shared
        self.own = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.own(h) + self.shared(h))


class SharedLayer(nn.Module):
    """Four blocks that all hold the same `shared` Linear; with `in_root`, the model holds it too and applies it
    once more after the blocks."""

    def __init__(self, in_root: bool = False) -> None:
        super().__init__()
        shared = nn.Linear(DIM, DIM)
        self.inp = nn.Linear(DIM, DIM)
        if in_root:
            self.shared = shared
        self.blocks = nn.ModuleList(Block(shared) for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        if hasattr(self, "shared"):
            h = torch.tanh(self.shared(h))
        return self.head(h)


class MixBlock(nn.Module):
    """A block with two Linears of its own, `mix` and `own`."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(DIM, DIM)
        self.own = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.own(h) + self.mix(h))


class SharedWeight(nn.Module):
    """Four blocks whose `mix` Linears are distinct modules that hold one Parameter object as their weight."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(MixBlock() for _ in range(BLOCKS))
        for block in self.blocks[1:]:
            block.mix.weight = self.blocks[0].mix.weight
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _seeded(cls, **kwargs):
    def build() -> nn.Module:
        torch.manual_seed(0)
        return cls(**kwargs)
    return build


def batch_of(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, DIM, generator=g), torch.randint(0, CLASSES, (ROWS,), generator=g)


def loss_fn(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(out, batch[1])


# name: (model, plan fields, train with autopar.train_step); every plan shards over 2 data-parallel ranks.
SCENARIOS = {
    "shared_module": (_seeded(SharedLayer), dict(dp_shard=2, micro_batch_size=4), False),
    "shared_module_in_root_accum": (_seeded(SharedLayer, in_root=True),
                                    dict(dp_shard=2, micro_batch_size=2, grad_accum=2), True),
    "shared_module_checkpointed": (_seeded(SharedLayer), dict(dp_shard=2, micro_batch_size=4, checkpointing="full"),
                                   False),
    "shared_weight": (_seeded(SharedWeight), dict(dp_shard=2, micro_batch_size=4), False),
}


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _state(model: nn.Module) -> dict:
    return {"params": {n: _full(p) for n, p in model.named_parameters()},
            "grads": {n: _full(p.grad) for n, p in model.named_parameters()}}


def tied(model: nn.Module) -> list[list[str]]:
    """The groups of names under which one Parameter object is held (a wrapped model's, or a plain one's)."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return sorted(g for g in groups.values() if len(g) > 1)


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)


def run_ranks(name: str) -> dict:
    build, fields, with_step = SCENARIOS[name]
    plan = autopar.Plan(**fields)
    local = plan.local_batch_size
    x, y = batch_of(0)
    model = autopar.wrap(build(), sample=(x[:local], y[:local]), plan=plan, loss_fn=loss_fn, verbose=False)
    rank, size = autopar.data_shard(model)
    opt = _optimizer(model)
    step = autopar.train_step(model, opt, loss_fn) if with_step else None
    losses, first_grads = [], None
    for i in range(STEPS):
        x, y = batch_of(i)
        mine = (x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local])
        if step is not None:
            loss = step(mine).detach()
        else:
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(mine[0]), mine)
            loss.backward()
            if i == 0:
                first_grads = _state(model)["grads"]
            opt.step()
            loss = loss.detach()
        dist.all_reduce(loss)
        losses.append(loss.item() / size)
    if step is not None:  # train_step zeroes the gradients after its step: take them from one more backward
        x, y = batch_of(STEPS)
        mine = (x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local])
        loss_fn(model(mine[0]), mine).backward()
    return {"losses": losses, "first_grads": first_grads, **_state(model), "tied": tied(model),
            "kinds": {n: type(p).__name__ for n, p in model.named_parameters()},
            "modules_tied": all(b.shared is model.blocks[0].shared for b in model.blocks)
            if isinstance(model.blocks[0], Block) else None}


def run_reference(name: str) -> dict:
    build, _, with_step = SCENARIOS[name]
    model = build()
    opt = _optimizer(model)
    losses, first_grads = [], None
    for i in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(batch_of(i)[0]), batch_of(i))
        loss.backward()
        if i == 0:
            first_grads = _state(model)["grads"]
        opt.step()
        losses.append(loss.item())
    if with_step:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(batch_of(STEPS)[0]), batch_of(STEPS)).backward()
    return {"losses": losses, "first_grads": first_grads, **_state(model), "tied": tied(model)}


def main() -> None:
    from tests.distributed._launch import worker_main

    names = [n for n in (os.environ.get("SCENARIOS") or ",".join(SCENARIOS)).split(",") if n]
    worker_main(run_ranks, names, sys.argv[1])


if __name__ == "__main__":
    main()
