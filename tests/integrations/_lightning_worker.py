"""One torchrun launch runs every Lightning scenario of tests/integrations/test_lightning.py in turn (a launch
costs more than a scenario). argv: the scenarios' JSON file, the output file (rank 0 writes it, torch.save).

A scenario is {"name", "run": one of RUNS, "args": keyword arguments}; its result, or the error it raised
({"error": type name, "message": ...}), is kept by name, per rank.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BatchSizeFinder

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import autopar  # noqa: E402
import autopar.integrations.lightning  # noqa: E402 - registers "autopar"
from autopar import plan_cache  # noqa: E402
from autopar.models.gpt import lm_loss  # noqa: E402
from autopar.topology import Topology  # noqa: E402
from tests.integrations._lightning_run import GPTModule, dataset, fit  # noqa: E402


def run_fit(**args) -> dict:
    return fit(**args)


def run_by_name(**args) -> dict:
    """Trainer(strategy="autopar"): the one line, after importing the integration."""
    return fit(strategy="autopar", **args)


def run_batch_size_finder(**args) -> dict:
    """BatchSizeFinder as a callback (Tuner.scale_batch_size is refused by Lightning itself under any distributed
    strategy, before fit)."""
    return fit(callbacks=[BatchSizeFinder(mode="power", max_trials=2)], **args)


def _store_in_plan_cache(cached: autopar.Plan, batch_size: int) -> None:
    module = GPTModule(batch_size)
    sample = dataset()[:batch_size]
    profile = autopar.profile_model(module, sample, loss_fn=lm_loss, warn=False)
    key = plan_cache.cache_key(profile, Topology.detect(), global_batch_size=cached.global_batch_size, loop="plain")
    plan_cache.store(cached, key, measurement={"step_s": 0.5, "tokens_per_s": 512.0})


def run_cached(*, plan: dict, batch_size: int) -> dict:
    """A plan stored in the plan cache as `autopar tune` stores its best (plan_cache.store under the job's key),
    then a Trainer whose strategy is given no plan."""
    cached = autopar.Plan(**plan)
    failure = [None]
    if dist.get_rank() == 0:
        try:
            _store_in_plan_cache(cached, batch_size)
        except Exception as exc:  # noqa: BLE001 - told to rank 1 below, so that neither waits on the other
            failure[0] = f"{type(exc).__name__}: {exc}"
    dist.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        raise RuntimeError(f"storing the plan on rank 0 failed: {failure[0]}")
    out = fit(batch_size=batch_size)
    out["cached_key"] = cached.key()
    return out


RUNS = {"fit": run_fit, "by_name": run_by_name, "batch_size_finder": run_batch_size_finder, "cached": run_cached}


def main() -> None:
    scenarios = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")  # Lightning's strategies find it started, and a refusal before theirs can wait
    results = {}
    for scenario in scenarios:
        try:
            results[scenario["name"]] = RUNS[scenario["run"]](**scenario.get("args", {}))
        except Exception as exc:  # noqa: BLE001 - a refusal is what some scenarios expect
            results[scenario["name"]] = {"error": type(exc).__name__, "message": str(exc)}
        dist.barrier()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        torch.save(gathered, sys.argv[2])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
