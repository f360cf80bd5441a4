"""Worker of tests/strategies/test_fsdp_scalar_params.py (torchrun, gloo, 2 ranks; also one plain process).

argv: MODE OUT.pt [CKPT_DIR]
  MODE "ranks": every scenario under its plan on the ranks; rank 0 writes the results.
  MODE "reference": the same models trained unwrapped in this one process, on the global batch.
Results per scenario: the loss of every step, and after the last step every parameter and gradient in full;
also the gradients of the first step (`first_grads`), where a loop of its own steps (not train_step).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autopar
from bench.zoo import build_model, family, make_sample

STEPS = 3
ROWS = 8  # the global batch of the toy model: 4 per rank on 2 ranks
DIM, CLASSES = 16, 8


class Temperature(nn.Module):
    """Two blocks and a head whose logits a 0-d parameter scales: exp(log_temp) x logits."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(DIM, CLASSES)
        self.log_temp = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:  # train_step: model(*batch)
        h = self.inp(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h) * self.log_temp.exp()


def toy_model() -> Temperature:
    torch.manual_seed(0)
    return Temperature()


def toy_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, DIM, generator=g), torch.randint(0, CLASSES, (ROWS,), generator=g)


def toy_loss(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(out, batch[1])


def clip_model() -> nn.Module:
    return build_model(family("clip"), "tiny")


def clip_batch(step: int) -> dict:
    return make_sample(family("clip"), "tiny", 4, seed=step)


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _rows(batch, rows: slice):
    if isinstance(batch, dict):
        return {k: v[rows] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return tuple(t[rows] for t in batch)


def _state(model: nn.Module) -> dict:
    return {"params": {n: _full(p) for n, p in model.named_parameters()},
            "grads": {n: _full(p.grad) for n, p in model.named_parameters()}}


# name: (model, batch, loss, plan fields, train with autopar.train_step); every plan has 2 data-parallel ranks.
SCENARIOS = {
    "toy_shard": (toy_model, toy_batch, toy_loss, dict(dp_shard=2, micro_batch_size=4), False),
    "toy_shard_accum": (toy_model, toy_batch, toy_loss, dict(dp_shard=2, micro_batch_size=2, grad_accum=2), True),
    "toy_replicate_accum": (toy_model, toy_batch, toy_loss, dict(dp_replicate=2, micro_batch_size=2, grad_accum=2),
                            True),
    "clip": (clip_model, clip_batch, lambda out, b: out.loss, dict(dp_shard=2, micro_batch_size=2), False),
}


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)


def run_ranks(name: str, ckpt: str | None) -> dict:
    build, batch_of, loss_fn, fields, with_step = SCENARIOS[name]
    plan = autopar.Plan(**fields)
    first = batch_of(0)
    local = plan.local_batch_size
    model = build()
    scalar_name = next(n for n, p in model.named_parameters() if p.dim() == 0)
    if dist.get_rank() == 1:  # another start on this rank only: wrap makes it rank 0's
        with torch.no_grad():
            model.get_parameter(scalar_name).add_(1.0)
    model = autopar.wrap(model, sample=_rows(first, slice(0, local)), plan=plan, loss_fn=loss_fn, verbose=False)
    rank, size = autopar.data_shard(model)
    opt = _optimizer(model)
    step = autopar.train_step(model, opt, loss_fn) if with_step else None
    losses = []
    for i in range(STEPS):
        mine = _rows(batch_of(i), slice(rank * local, (rank + 1) * local))
        if step is not None:
            loss = step(mine).detach()
        else:
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(**mine) if isinstance(mine, dict) else model(mine[0]), mine)
            loss.backward()
            if i == 0:
                first_grads = _state(model)["grads"]
            opt.step()
            loss = loss.detach()
        dist.all_reduce(loss)
        losses.append(loss.item() / size)
    if step is not None:  # train_step zeroes the gradients after its step: take them from one more backward
        mine = _rows(batch_of(STEPS), slice(rank * local, (rank + 1) * local))
        loss_fn(model(**mine) if isinstance(mine, dict) else model(mine[0]), mine).backward()
    result = {"losses": losses, **_state(model)}
    if step is None:
        result["first_grads"] = first_grads
    scalar = model.get_parameter(scalar_name)
    on_ranks = [None] * dist.get_world_size()
    dist.all_gather_object(on_ranks, (scalar.detach().clone(), scalar.grad.detach().clone()))
    result["scalar_on_ranks"] = on_ranks
    result["kinds"] = {n: type(p).__name__ for n, p in model.named_parameters()}
    if ckpt is not None:
        result["checkpoint"] = _checkpoint(model, opt, build, first, plan, loss_fn, ckpt)
    return result


def _checkpoint(model, opt, build, first, plan, loss_fn, ckpt: str) -> dict:
    """Save, then load into a freshly wrapped model whose 0-d parameter was changed first."""
    autopar.save(model, opt, ckpt)
    fresh = build()
    with torch.no_grad():
        fresh.log_temp.fill_(-3.0)
    fresh = autopar.wrap(fresh, sample=_rows(first, slice(0, plan.local_batch_size)), plan=plan, loss_fn=loss_fn,
                         verbose=False)
    fresh_opt = _optimizer(fresh)
    for p in fresh.parameters():  # AdamW's state exists after one step: make it, to be overwritten by the load
        p.grad = torch.zeros_like(p)
    fresh_opt.step()
    autopar.load(fresh, fresh_opt, ckpt)
    saved_state = opt.state[model.log_temp]
    loaded_state = fresh_opt.state[fresh.log_temp]
    return {"saved": _full(model.log_temp), "loaded": _full(fresh.log_temp),
            "saved_exp_avg": saved_state["exp_avg"].clone(), "loaded_exp_avg": loaded_state["exp_avg"].clone(),
            "loaded_weight": _full(fresh.head.weight), "saved_weight": _full(model.head.weight)}


def run_reference(name: str) -> dict:
    build, batch_of, loss_fn, _, with_step = SCENARIOS[name]
    model = build()
    opt = _optimizer(model)
    losses = []
    # A loss over the whole batch: the toy's mean cross-entropy, one forward. CLIP's contrastive loss compares
    # the samples of one forward with each other: the mean of the two data-parallel ranks' losses, each rank's
    # micro-batch its own forward, is what 2 ranks compute.
    chunks = 2 if name == "clip" else 1

    def loss_of(batch) -> torch.Tensor:
        rows = _rows(batch, slice(0, None))
        size = (batch[0] if isinstance(batch, tuple) else batch["input_ids"]).shape[0] // chunks
        parts = [_rows(rows, slice(c * size, (c + 1) * size)) for c in range(chunks)]
        return sum(loss_fn(model(**b) if isinstance(b, dict) else model(b[0]), b) for b in parts) / chunks

    for i in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(batch_of(i))
        loss.backward()
        if i == 0:
            first_grads = _state(model)["grads"]
        opt.step()
        losses.append(loss.item())
    if with_step:
        opt.zero_grad(set_to_none=True)
        loss_of(batch_of(STEPS)).backward()
    return {"losses": losses, "first_grads": first_grads, **_state(model)}


def main() -> None:
    mode, out = sys.argv[1:3]
    ckpt = sys.argv[3] if len(sys.argv) > 3 else None
    names = [n for n in (os.environ.get("SCENARIOS") or ",".join(SCENARIOS)).split(",") if n]
    if mode == "reference":
        torch.save({n: run_reference(n) for n in names}, out)
        return
    dist.init_process_group("gloo")
    results = {n: run_ranks(n, ckpt if n == "toy_shard" else None) for n in names}
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
