"""Measure a grid of single-GPU plans on two Hugging Face model shapes: the ground truth the cost model
(and the search) is checked against.

For each (model, plan): build the model (random init), autopar.wrap it with the plan, train with
autopar.train_step on a fixed global batch, time `--steps` steps after `--warmup` steps (device synchronised),
and record the step time, tokens/s, MFU (6N + 12 L h s per token against the device's bf16 peak), the peak
allocated and reserved memory, and out-of-memory as a status. One JSON line per configuration on stdout and
all of them in $OUT/grid_<device>_<date>.json, with the date, device, torch version and command.

    python -m bench.grid_single_gpu --models gpt2-355m,llama-1b --compile both
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time

import torch

import autopar
from bench._common import MODELS, build


def grid(compile_modes: list[bool], global_batch: int) -> list[dict]:
    plans = []
    for compile_ in compile_modes:
        for mb in (4, 8, 16):
            if global_batch % mb:
                continue
            for ckpt in ("none", "selective", "full"):
                plans.append(dict(micro_batch_size=mb, grad_accum=global_batch // mb, checkpointing=ckpt,
                                  precision="bf16", compile=compile_))
    return plans


def measure(name: str, plan_kw: dict, steps: int, warmup: int, peak_flops: float) -> dict:
    gb, seq = MODELS[name]
    torch.manual_seed(0)
    model = build(name)
    n_params = sum(p.numel() for p in model.parameters())
    cfg = model.config
    hidden = getattr(cfg, "hidden_size", None) or cfg.n_embd
    layers = getattr(cfg, "num_hidden_layers", None) or cfg.n_layer
    ids = torch.randint(0, cfg.vocab_size, (gb, seq))
    batch = {"input_ids": ids, "labels": ids}
    plan = autopar.Plan(**plan_kw)
    record = {"model": name, "global_batch": gb, "seq": seq, **plan_kw}
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        model = autopar.wrap(model, sample={k: v[: plan.micro_batch_size] for k, v in batch.items()}, plan=plan,
                             global_batch_size=gb, verbose=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        step = autopar.train_step(model, opt)
        t_compile = time.perf_counter()
        for _ in range(warmup):
            step(batch)
        torch.cuda.synchronize()
        record["warmup_s"] = round(time.perf_counter() - t_compile, 2)
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        losses = [step(batch) for _ in range(steps)]
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / steps
        tokens = gb * seq
        flops = (6 * n_params + 12 * layers * hidden * seq) * tokens
        record.update(status="ok", step_s=round(dt, 5), tokens_per_s=round(tokens / dt), mfu=round(flops / dt / peak_flops, 4),
                      peak_allocated_bytes=torch.cuda.max_memory_allocated(),
                      peak_reserved_bytes=torch.cuda.max_memory_reserved(),
                      final_loss=round(float(losses[-1]), 4), params=n_params)
    except torch.OutOfMemoryError:
        record.update(status="oom")
    except Exception as exc:  # recorded: the grid goes on
        record.update(status="error", error=f"{type(exc).__name__}: {str(exc)[:300]}")
    del model
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    return record


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="gpt2-355m,llama-1b")
    p.add_argument("--compile", choices=("on", "off", "both"), default="both")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--only", default=None, help="comma-separated indices of the grid to run")
    args = p.parse_args()
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.compile]
    topo = autopar.Topology.detect()
    peak = topo.device.peak_flops("bf16")
    meta = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "command": " ".join(sys.argv), "peak_bf16_flops_table": peak}
    print(json.dumps(meta), flush=True)
    out = []
    for name in args.models.split(","):
        plans = grid(modes, MODELS[name][0])
        if args.only:
            plans = [plans[int(i)] for i in args.only.split(",") if int(i) < len(plans)]
        for plan_kw in plans:
            r = measure(name, plan_kw, args.steps, args.warmup, peak)
            print(json.dumps(r), flush=True)
            out.append(r)
    path = os.path.join(os.environ.get("OUT", "."), f"grid_{torch.cuda.get_device_name().replace(' ', '_')}_{meta['date']}.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "runs": out}, f, indent=1)


if __name__ == "__main__":
    main()
