"""One rank of tests/test_race.py's multi-process test, launched by torchrun on 2 gloo processes.

argv: OUT_DIR. wrap the built-in GPT for "2xH200" with measure=True (autopar's choice is raced on this CPU, the
compile backend aot_eager), then train one step on this rank's rows; each rank writes OUT_DIR/rank{R}.json: the
plan it kept, what the race measured, and the step's loss.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch.distributed as dist

os.environ["AUTOPAR_COMPILE_BACKEND"] = "aot_eager"

import autopar  # noqa: E402
from autopar.models.gpt import lm_loss  # noqa: E402
from tests._training import GLOBAL_BATCH, batch, make_model, make_optimizer  # noqa: E402


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = make_model("gpt")
    rows = batch(0)[rank * GLOBAL_BATCH // 2:(rank + 1) * GLOBAL_BATCH // 2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        autopar.wrap(model, sample=rows, topology="2xH200", loss_fn=lm_loss, measure=True, verbose=False)
    state = autopar.applied(model)
    opt = make_optimizer(model)
    loss = lm_loss(model(rows), rows)
    loss.backward()
    opt.step()
    p = state.plan.prediction
    record = {"plan": state.plan.to_yaml(), "compile": state.plan.compile, "world": state.plan.world_size,
              "measured_forward_backward_s": p.get("measured_forward_backward_s"), "step_s": p.get("step_s"),
              "optimizer_s": p.get("optimizer_s"), "grad_accum": state.plan.grad_accum,
              "notes": [n for n in state.notes if "measured on this device" in n], "loss": float(loss)}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
