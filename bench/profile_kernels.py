"""Where one training step's GPU time goes: torch.profiler over one autopar.train_step of a wrapped
Hugging Face model (bench/_common.py shapes), its CUDA kernels summed by kind (GEMM, attention,
optimizer, memory-bound elementwise/reduction/copy), the step time and the 30 longest kernels.
(The FLOP and byte counts to turn these into rates are the profile's: autopar.profile_model on the
same model and batch.) One JSON line per configuration in $OUT/kernels.jsonl.

    python -m bench.profile_kernels [--configs llama-1b:4,gpt2-355m:8,gpt2-355m:4:fp32]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gc
import json
import os
import sys
import time

import torch

import autopar
from bench._common import MODELS, build, kernel_kind


def one(name: str, mb: int, precision: str, compile_: bool) -> dict:
    seq = MODELS[name][1]
    plan = autopar.Plan(micro_batch_size=mb, precision=precision, compile=compile_)
    with torch.device("cuda"):
        model = build(name)
    ids = torch.randint(0, 30000, (mb, seq), device="cuda")
    batch = {"input_ids": ids, "labels": ids}
    model = autopar.wrap(model, sample=batch, plan=plan, verbose=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    step = autopar.train_step(model, opt)
    for _ in range(3):
        step(batch)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        step(batch)
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - t0) / 3
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(batch)
        torch.cuda.synchronize()
    by_kind: dict = collections.Counter()
    count: dict = collections.Counter()
    top = collections.Counter()
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = getattr(e, "cuda_time_total", 0)
        if not t or getattr(e, "device_type", None) not in (None, torch.autograd.DeviceType.CUDA):
            continue
        k = kernel_kind(e.key)
        by_kind[k] += t / 1e6
        count[k] += e.count
        top[e.key[:90]] += t / 1e6
    rec = {"model": name, "micro_batch_size": mb, "precision": precision, "compile": compile_, "step_s": step_s,
           "gpu_s": dict(by_kind), "kernels": dict(count), "top": top.most_common(30)}
    del model, opt, step
    gc.collect()
    torch.cuda.empty_cache()
    return rec


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="llama-1b:4,gpt2-355m:8,gpt2-355m:4:fp32,llama-1b:4:bf16:compile")
    args = ap.parse_args()
    path = os.path.join(os.environ.get("OUT", "."), "kernels.jsonl")
    head = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "command": " ".join(sys.argv)}
    with open(path, "a") as f:
        f.write(json.dumps(head) + "\n")
    for spec in args.configs.split(","):
        parts = spec.split(":")
        name, mb = parts[0], int(parts[1])
        precision = parts[2] if len(parts) > 2 else "bf16"
        compile_ = len(parts) > 3 and parts[3] == "compile"
        try:
            rec = one(name, mb, precision, compile_)
        except Exception as exc:  # recorded; the next configuration runs
            rec = {"model": name, "micro_batch_size": mb, "error": repr(exc)[:400]}
        print(json.dumps({k: v for k, v in rec.items() if k != "top"}), flush=True)
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
