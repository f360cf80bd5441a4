"""One rank of a multi-process test, launched by torchrun (see _launch.py).

argv: SPEC.json OUT.pt. The spec is a list of scenarios; for each, build the model (the built-in GPT, or a
tiny Hugging Face Llama or GPT-2), autopar.wrap it with the scenario's plan (or none), train STEPS steps on
this rank's data shard - with a plain loop, or with autopar.train_step when the scenario says so (pipeline
and accumulation plans need it) - and record per-step losses (averaged over ranks), the plan every rank
applied, each rank's data shard, and the final full parameters. Rank 0 writes everything to OUT.pt.
"""

from __future__ import annotations

import json
import sys
import traceback

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import autopar
from autopar._util.batch import call_model
from tests._training import GLOBAL_BATCH, STEPS, batch, local_rows, loss_of, make_model, make_optimizer, sample_of


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of the model as a full tensor on rank 0, gathered from all ranks (any plan)."""
    local = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        local[name] = t.detach().float().cpu().clone()
    return gather(local)  # pipeline stages hold different parameters


class FirstGrads(torch.optim.Optimizer):
    """Wraps the optimizer: records every gradient (full tensors) at the first step, then steps as usual."""

    def __init__(self, model: torch.nn.Module, inner: torch.optim.Optimizer) -> None:
        self.__dict__.update(inner.__dict__)
        self.model, self.inner, self.grads = model, inner, None

    def step(self, closure=None):
        if self.grads is None:
            self.grads = {}
            for name, p in self.model.named_parameters(remove_duplicate=False):
                g = p.grad
                if g is not None:
                    g = g.full_tensor() if hasattr(g, "full_tensor") else g
                    self.grads[name] = g.detach().float().cpu().clone()
        return self.inner.step(closure)

    def zero_grad(self, set_to_none: bool = True):
        return self.inner.zero_grad(set_to_none=set_to_none)


def gather(local: dict) -> dict:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    out = {}
    for part in gathered:
        for name, t in part.items():
            out.setdefault(name, t)
    return out


def run(scenario: dict) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    kind = scenario.get("model", "gpt")
    model = make_model(kind)
    plan = autopar.Plan(**scenario["plan"]) if scenario.get("plan") is not None else None
    topology = scenario.get("topology")
    if isinstance(topology, dict):  # per-rank topology spec, to check that rank 0's choice wins
        topology = topology.get(str(rank))
    dp = plan.dp_size if plan is not None else world
    compute = loss_of(kind)
    model = autopar.wrap(model, sample=sample_of(kind, batch(0)[: GLOBAL_BATCH // dp]), plan=plan,
                         topology=topology, global_batch_size=GLOBAL_BATCH, verbose=False,
                         loss_fn=compute)
    head_outputs: list[str] = []
    layout = autopar.applied(model).tensor_parallel
    if layout is not None and layout.head is not None:  # what the loss receives from the split head
        head = model.get_submodule(layout.head)
        head.register_forward_hook(lambda m, a, out: head_outputs.append(
            f"{type(out).__name__}{tuple(getattr(out, 'placements', ()))}"))
    gathered_at_start = _watch_gathers(model, scenario.get("watch_gathers"))
    scatters = _ReduceScatters() if scenario.get("count_reduce_scatters") else None
    opt = FirstGrads(model, make_optimizer(model))
    shard = autopar.data_shard(model)
    step_fn = autopar.train_step(model, opt, compute) if scenario.get("train_step") else None
    losses = []
    for step in range(scenario.get("steps", STEPS)):
        x = sample_of(kind, local_rows(batch(step), shard.rank, shard.size))
        if step_fn is not None:
            loss = step_fn(x)
        else:
            loss = compute(call_model(model, x), x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone().reshape(())
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    if scatters is not None:
        scatters.stop()
    plans = [None] * world
    dist.all_gather_object(plans, autopar.plan_of(model).to_yaml())
    shards = [None] * world
    dist.all_gather_object(shards, tuple(shard))
    heads = [None] * world
    dist.all_gather_object(heads, sorted(set(head_outputs)))  # the head lives on the last pipeline stage
    return {"losses": losses, "params": full_params(model), "grads": gather(opt.grads or {}), "plans": plans,
            "shards": shards, "head_outputs": sorted({h for part in heads for h in part}),
            "applied_checkpointed": list(autopar.applied(model).checkpointed), "gathered_at_start": gathered_at_start,
            "reduce_scatters": None if scatters is None else scatters.calls}


class _ReduceScatters:
    """Counts torch.distributed's reduce-scatter calls (FSDP2's gradient reduction) until stopped."""

    NAMES = ("reduce_scatter_tensor", "reduce_scatter_single")  # the name FSDP2 calls varies across torch versions

    def __init__(self) -> None:
        self.calls = 0
        self._originals = {n: getattr(dist, n) for n in self.NAMES if hasattr(dist, n)}
        for name, original in self._originals.items():
            setattr(dist, name, self._counting(original))

    def _counting(self, original):
        def call(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)
        return call

    def stop(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)


def _watch_gathers(model: torch.nn.Module, path: str | None) -> list[bool]:
    """Whether the module at `path` holds its parameters gathered over the data-parallel shard axis as each of
    its forwards starts, before FSDP2's own pre-forward gathers them; in order. Gathered: a plain tensor, or
    (under tensor parallelism) a DTensor on the tensor-parallel axis alone."""
    seen: list[bool] = []
    if path is None:
        return seen
    module = model.get_submodule(path)
    module.register_forward_pre_hook(
        lambda m, args: seen.append(_gathered(next(m.parameters()))), prepend=True)
    return seen


def _gathered(p: torch.Tensor) -> bool:
    return not isinstance(p, DTensor) or "dp_shard" not in (p.device_mesh.mesh_dim_names or ())


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
