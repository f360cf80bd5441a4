"""One rank of tests/strategies/test_float8.py's FSDP test, launched by torchrun on 2 gloo processes.

argv: OUT_DIR. wrap test_float8's model with an FSDP2 float8 plan (dp_shard=2, bf16), train 3 steps of a plain loop,
each rank on its half of the global batch of 16, and write OUT_DIR/rank{R}.json: the losses (this rank's), the
float8 layers, whether their weights are sharded, the notes, and the first block's up weight in full at the end."""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

import autopar
from tests.strategies.test_float8 import _Net, batch_of


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _Net()
    x, y = batch_of(16)
    x, y = x[rank * 8:(rank + 1) * 8], y[rank * 8:(rank + 1) * 8]

    def loss_fn(out, _):
        return (out.float() - y).square().mean()

    plan = autopar.Plan(dp_shard=2, micro_batch_size=8, precision="bf16", float8=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        autopar.wrap(model, sample=x, plan=plan, topology="2xH200", loss_fn=loss_fn, verbose=False)
    from torchao.float8.float8_linear import Float8Linear

    layers = sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear))
    sharded = all(type(m.weight).__name__ == "DTensor" for n, m in model.named_modules() if isinstance(m, Float8Linear))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(3):
        loss = loss_fn(model(x), x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    up = model.layers[0].up.weight.full_tensor().tolist()
    record = {"losses": losses, "layers": layers, "sharded": sharded, "notes": list(autopar.applied(model).notes),
              "up": up}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
