"""Worker of tests/test_step_items.py (torchrun, gloo, 2 ranks): a tiny Hugging Face Llama whose labels are masked
unevenly (-100: padding, prompts), trained by autopar.train_step under PLAN (each rank its half of the global batch,
split into micro-batches), against `reference` in one plain process on the whole batch. argv: OUT.pt PLAN-NAME."""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist

import autopar
from tests._training import make_model

STEPS, GLOBAL, SEQ, LR = 3, 8, 32, 0.1
PLANS = {"one": dict(micro_batch_size=2, grad_accum=4), "fsdp": dict(dp_shard=2, micro_batch_size=2, grad_accum=2),
         "ddp": dict(dp_replicate=2, micro_batch_size=2, grad_accum=2),
         "tp": dict(tp=2, micro_batch_size=4, grad_accum=2)}


def batch(step: int) -> dict[str, torch.Tensor]:
    """The global batch of `step`: each row's labels masked from a length of its own on (padding), and the first
    rows' prompts masked too; the valid counts differ between every micro-batch and rank."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 128, (GLOBAL, SEQ), generator=g)
    labels = ids.clone()
    for row in range(GLOBAL):
        keep = 4 + (row * 7 + step * 3) % (SEQ - 4)
        labels[row, keep:] = -100
        if row % 3 == 0:
            labels[row, :keep // 2] = -100
    return {"input_ids": ids, "labels": labels}


def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = make_model("llama")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = model(**batch(step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def main(out: str, name: str) -> None:
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = make_model("llama")
    plan = autopar.Plan(**PLANS[name])
    shard, shards = rank % plan.dp_size, plan.dp_size  # (dp is the mesh's inner axis here: tp=1 or dp=1)
    rows = GLOBAL // shards
    local = lambda b: {k: v[shard * rows:(shard + 1) * rows] for k, v in b.items()}  # noqa: E731
    autopar.wrap(model, sample=local(batch(0)), plan=plan, loop="train_step", verbose=False)
    assert autopar.data_shard(model).rank == shard
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    step = autopar.train_step(model, opt)
    losses = []
    for s in range(STEPS):
        loss = step(local(batch(s))).detach().clone()
        counted = (local(batch(s))["labels"][:, 1:] != -100).sum().double()
        both = torch.stack([loss.double() * counted, counted])
        dist.all_reduce(both)  # the global batch's mean, from each rank's mean and count (TP peers: the same)
        losses.append((both[0] / both[1]).item())
    params = {}
    for n, p in model.named_parameters():
        params[n] = p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone()
    if rank == 0:
        torch.save({"losses": losses, "params": params}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
