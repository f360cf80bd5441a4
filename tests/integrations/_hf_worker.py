"""One rank of the Hugging Face Trainer tests on several processes, launched once by torchrun for every scenario.

argv: SCENARIOS.json OUT.pt. Each scenario builds the tiny Llama, prepares it (or, for the cases prepare
exists to avoid, marks or wraps it by hand), runs the Trainer STEPS steps and records the logged losses, the
rows every rank read at each step, the plan, the files a save wrote, or the error raised. Rank 0 writes
{name: result} to OUT.pt.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import autopar
from autopar.integrations import hf
from tests.integrations import _hf


def _rows_of_every_rank(rows: list[list[int]]) -> list[list[list[int]]]:
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    return gathered  # [rank][step] -> rows


def _prepared(scenario: dict, out: str) -> tuple:
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    plan = autopar.Plan(**scenario["plan"]) if scenario.get("plan") else None
    accum = scenario.get("accum", 1)
    args = _hf.args(out, per_device=_hf.GLOBAL // world // accum, accum=accum, **scenario.get("args", {}))
    model, args = hf.prepare(_hf.make_model(), args, sample=_hf.sample(_hf.GLOBAL // world), plan=plan,
                             verbose=False)
    return model, args


def run(scenario: dict, out: str) -> dict:
    kind = scenario["kind"]
    if kind == "prepare":
        model, args = _prepared(scenario, out)
        callback = hf.AutoparCallback(warmup_steps=2, feedback=False)
        result = _hf.train(model, args, callbacks=[callback])
        result["saved"] = sorted(str(p.relative_to(out)) for p in Path(out).glob("checkpoint-*/**/*") if p.is_file())
        result["measured_steps"] = callback.measurement.steps if callback.measurement else 0
        result["plan"] = autopar.plan_of(model).to_dict()
    elif kind == "resume":  # stopped after the checkpoint at step 5, then resumed from it by a new Trainer, under
        # the scenario's resume_plan (another plan than the one that saved)
        model, args = _prepared(scenario, out)
        _hf.train(model, args, callbacks=[hf.AutoparCallback(feedback=False), _hf.StopAt(5)])
        model, args = _prepared({**scenario, "plan": scenario["resume_plan"]}, out)
        result = _hf.train(model, args, callbacks=[hf.AutoparCallback(feedback=False)], resume_from_checkpoint=True)
        result["saved"] = sorted(str(p.relative_to(out)) for p in Path(out).glob("checkpoint-*/**/*") if p.is_file())
        result["plan"] = autopar.plan_of(model).to_dict()
    elif kind == "tp_marked_by_hand":  # the markers without _tp_size: what prepare refuses on CPU
        plan = autopar.Plan(tp=2, micro_batch_size=_hf.GLOBAL)
        model = autopar.wrap(_hf.make_model(), sample=_hf.sample(_hf.GLOBAL), plan=plan, verbose=False)
        model._is_distributed_loading_by_transformers = True
        result = _hf.train(model, _hf.args(out, per_device=_hf.GLOBAL))
    elif kind == "fsdp_unmarked":  # wrap, then the Trainer, without prepare's markers
        plan = autopar.Plan(dp_shard=2, micro_batch_size=_hf.GLOBAL // 2)
        model = autopar.wrap(_hf.make_model(), sample=_hf.sample(_hf.GLOBAL // 2), plan=plan, verbose=False)
        result = _hf.train(model, _hf.args(out, per_device=_hf.GLOBAL // 2))
    else:
        raise ValueError(f"unknown scenario kind {kind!r}")
    result["rows_by_rank"] = _rows_of_every_rank(result.pop("rows"))
    return result


def main() -> None:
    scenarios = json.loads(Path(sys.argv[1]).read_text())
    results = {}
    for scenario in scenarios:
        out = str(Path(sys.argv[2]).parent / scenario["name"])
        try:
            results[scenario["name"]] = run(scenario, out)
        except Exception as exc:  # recorded: some scenarios show what fails without prepare
            results[scenario["name"]] = {"error": f"{type(exc).__name__}: {exc}",
                                         "traceback": traceback.format_exc()[-3000:]}
        dist.barrier()
    if dist.get_rank() == 0:
        torch.save(results, sys.argv[2])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
