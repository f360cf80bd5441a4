"""One rank of tests/test_reliability_step.py's peer-batch test, launched by torchrun on 2 gloo processes.

argv: OUT_DIR. For each scenario, wrap the built-in GPT with a tensor- or pipeline-parallel plan over both ranks
(one group: both ranks must read the same batch) and train two steps on either the same batch on both ranks or
a different batch a rank (as a DistributedSampler over every rank gives), or with train_step and no loss_fn
(the GPT returns logits); record each step's loss, or the error and its message, and whether the parameters
moved. Each rank writes OUT_DIR/rank{R}.json.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import autopar
from autopar.models.gpt import lm_loss
from autopar.plans import Plan
from tests._training import batch, make_model, make_optimizer

SCENARIOS = {
    "tp-same": ({"tp": 2, "micro_batch_size": 8}, False, "same"),
    "tp-different": ({"tp": 2, "micro_batch_size": 8}, False, "different"),
    "pp-same": ({"pp": 2, "pp_schedule": "1f1b", "micro_batch_size": 4, "grad_accum": 2}, True, "same"),
    "pp-different": ({"pp": 2, "pp_schedule": "1f1b", "micro_batch_size": 4, "grad_accum": 2}, True, "different"),
    # train_step without loss_fn on a model that returns logits: refused on every stage, nothing stepped
    "pp-no-loss-fn": ({"pp": 2, "pp_schedule": "1f1b", "micro_batch_size": 4, "grad_accum": 2}, True, "same"),
}


def params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([(p.to_local() if hasattr(p, "to_local") else p).detach().flatten().clone()
                      for p in model.parameters()])


def run(name: str, plan: dict, use_train_step: bool, data: str, rank: int) -> dict:
    model = make_model("gpt")
    autopar.wrap(model, sample=batch(0), plan=Plan(**plan), loss_fn=lm_loss, verbose=False)
    opt = make_optimizer(model)
    loss_fn = None if name.endswith("no-loss-fn") else lm_loss
    step = autopar.train_step(model, opt, loss_fn) if use_train_step else None
    before = params(model)
    losses = []
    try:
        for i in range(2):
            x = batch(i if data == "same" else 10 * rank + i)
            if step is not None:
                losses.append(float(step(x)))
            else:
                loss = lm_loss(model(x), x)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(float(loss))
    except Exception as exc:  # recorded: the test asserts which error, on which ranks
        return {"error": type(exc).__name__, "message": str(exc), "losses": losses,
                "moved": not torch.equal(before, params(model)),
                "grads": any(p.grad is not None for p in model.parameters())}
    return {"error": None, "losses": losses, "moved": not torch.equal(before, params(model))}


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {name: run(name, *spec, rank) for name, spec in SCENARIOS.items()}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
