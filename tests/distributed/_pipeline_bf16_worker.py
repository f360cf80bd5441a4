"""One rank of tests/strategies/test_precision_weights.py's pipeline test, launched by torchrun on 2 gloo processes.

argv: OUT_DIR. wrap the zoo's tiny Mixtral with a two-stage bf16 pipeline plan (no FSDP: its stages run under
autocast), train one step with autopar.train_step, and write OUT_DIR/rank{R}.json: the dtypes in which this rank's
expert modules read their weights, those weights' and their gradients' dtypes, the plan's notes and the loss.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

import autopar
from bench.zoo import build_model, family, make_sample


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    fam = family("mixtral")
    model, sample = build_model(fam, "tiny"), make_sample(fam, "tiny")
    plan = autopar.Plan(pp=2, pp_schedule="1f1b", micro_batch_size=2, grad_accum=2, precision="bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        autopar.wrap(model, sample=sample, plan=plan, topology="2xH200", loss_fn=fam.loss_fn, verbose=False)
    seen: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            module.register_forward_pre_hook(
                lambda m, args, name=name: seen.setdefault(name, []).append(str(m.gate_up_proj.dtype)))
    grads: dict[str, set[str]] = {}
    experts = {n: p for n, p in model.named_parameters() if ".experts." in n and p.dim() == 3}
    for n, p in experts.items():
        p.register_post_accumulate_grad_hook(lambda p, n=n: grads.setdefault(n, set()).add(str(p.grad.dtype)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = autopar.train_step(model, opt, fam.loss_fn)(sample)
    experts = {n: (str(p.dtype), *sorted(grads.get(n, ()))) for n, p in experts.items()}
    record = {"seen": seen, "experts": experts, "notes": list(autopar.applied(model).notes), "loss": float(loss)}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
