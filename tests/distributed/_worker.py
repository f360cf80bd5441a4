"""One rank of a multi-process test, launched by torchrun (see _launch.py).

argv: SPEC.json OUT.pt. The spec is a list of scenarios; for each, build the model, autopar.wrap it with
the scenario's plan (or none), train STEPS steps on this rank's data shard with a plain loop, and record
per-step losses (averaged over data-parallel ranks), the plan every rank applied, and the final full
parameters. Rank 0 writes everything to OUT.pt.
"""

from __future__ import annotations

import json
import sys
import traceback

import torch
import torch.distributed as dist

import autopar
from autopar.models.gpt import lm_loss
from tests._training import GLOBAL_BATCH, STEPS, batch, local_rows, make_model, make_optimizer


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().float().cpu().clone()
    return out


def run(scenario: dict) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    plan = autopar.Plan(**scenario["plan"]) if scenario.get("plan") is not None else None
    topology = scenario.get("topology")
    if isinstance(topology, dict):  # per-rank topology spec, to check that rank 0's choice wins
        topology = topology.get(str(rank))
    model = autopar.wrap(model, sample=batch(0)[: GLOBAL_BATCH // world], plan=plan,
                         topology=topology, global_batch_size=scenario.get("global_batch"),
                         verbose=False)
    opt = make_optimizer(model)
    shard = autopar.data_shard(model)
    losses = []
    for step in range(scenario.get("steps", STEPS)):
        x = local_rows(batch(step), shard.rank, shard.size)
        loss = lm_loss(model(x), x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    plans = [None] * world
    dist.all_gather_object(plans, autopar.plan_of(model).to_yaml())
    shards = [None] * world
    dist.all_gather_object(shards, tuple(shard))
    return {"losses": losses, "params": full_params(model), "plans": plans, "shards": shards,
            "applied_checkpointed": list(autopar.applied(model).checkpointed)}


def main() -> None:
    spec_path, out_path = sys.argv[1], sys.argv[2]
    scenarios = json.loads(open(spec_path).read())
    dist.init_process_group("gloo")
    results = {}
    for scenario in scenarios:
        try:
            results[scenario["name"]] = run(scenario)
        except Exception as exc:  # recorded, so one broken scenario does not hide the others
            results[scenario["name"]] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        dist.barrier()
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
