"""Checkpoint test worker (also runs as one plain process): train, save, load under another plan, resume.

argv: MODE PLAN_JSON CKPT_DIR OUT.pt
  MODE "save": train SAVE_AT steps, autopar.save, record the full state, train on to STEPS (the
               uninterrupted run's losses).
  MODE "load": wrap under PLAN_JSON, autopar.load, record the full state, train steps SAVE_AT..STEPS-1.
Rank 0 (or the single process) writes the losses and the full model and optimizer state to OUT.pt.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import autopar
from tests._training import GLOBAL_BATCH, STEPS, batch, local_rows, make_model, make_optimizer
from autopar.models.gpt import lm_loss

SAVE_AT = 5


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True)  # on every rank (a pipeline stage has its own part)
    model_sd, optim_sd = get_state_dict(model, opt, options=opts)
    clone = lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t  # noqa: E731 - not live state
    state = {"model": torch.utils._pytree.tree_map(clone, model_sd),
             "optim": {"state": torch.utils._pytree.tree_map(clone, optim_sd.get("state", {}))}}
    if dist.is_initialized():  # pipeline stages hold different parameters: merge every rank's
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, state)
        for part in parts:
            for name, value in part["model"].items():
                state["model"].setdefault(name, value)
            for name, value in part["optim"]["state"].items():
                state["optim"]["state"].setdefault(name, value)
    return state


def main() -> None:
    mode, plan_json, ckpt, out = sys.argv[1:5]
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    world = dist.get_world_size() if distributed else 1
    plan = autopar.Plan(**json.loads(plan_json))
    model = make_model()
    model = autopar.wrap(model, sample=batch(0)[: GLOBAL_BATCH // plan.dp_size], plan=plan,
                         global_batch_size=GLOBAL_BATCH, verbose=False)
    opt = make_optimizer(model)
    shard = autopar.data_shard(model)
    step = autopar.train_step(model, opt, lambda out_, x: lm_loss(out_, x))
    result: dict = {"losses": []}

    def train(first: int, last: int) -> None:
        for s in range(first, last):
            loss = step(local_rows(batch(s), shard.rank, shard.size)).detach().clone()
            if distributed:
                dist.all_reduce(loss)
            result["losses"].append(loss.item() / world)

    if mode == "save":
        train(0, SAVE_AT)
        autopar.save(model, opt, ckpt)
        result["state"] = full_state(model, opt)
        result["losses"] = []
        train(SAVE_AT, STEPS)
    else:
        autopar.load(model, opt, ckpt)
        result["state"] = full_state(model, opt)
        train(SAVE_AT, STEPS)
    if not distributed or dist.get_rank() == 0:
        torch.save(result, out)
    if distributed:
        dist.destroy_process_group()
        # End here, before the interpreter's teardown: gloo's worker threads outlive destroy_process_group
        # (torch.distributed's device meshes keep their groups), and in about a third of the runs of
        # test_checkpoint.py torch 2.13 aborted at exit ("terminate called without an active exception",
        # SIGABRT) after the work was done and written. Flush, then leave without running C++ destructors.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
