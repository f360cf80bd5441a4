"""Check the cost model on one GPU: exact memory check, analytic memory and time, against measured runs.

For each single-GPU configuration (Hugging Face GPT-2-355M and a Llama-1B shape, bf16 plans with and
without checkpointing and accumulation): (1) the exact check (autopar.exact: the step traced under
FakeTensorMode on a fake CUDA device, no memory used), (2) the analytic prediction (autopar.predict),
(3) the real run: autopar.wrap with the plan, autopar.train_step, `--warmup` then `--steps` timed steps
(device synchronised), torch.cuda.max_memory_allocated / max_memory_reserved, plus the CUDA context
measured once (device used minus reserved, from NVML/mem_get_info). One JSON line per configuration,
written as it finishes to $OUT/validate.jsonl (so a run cut short keeps what it measured).

    python -m bench.validate_h200 [--deadline-s 150] [--only N] [--pick I,J] [--no-exact | --exact-only]
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
from autopar.cost import predict_profile
from autopar.exact import exact_memory
from autopar.planning import calibration_for, profile_variants
from bench._common import build, token_batch  # the same HF shapes as the grid

GiB = 2**30
CONFIGS = [  # (model, plan options); global batch = micro-batch x accumulation (one GPU)
    ("gpt2-355m", dict(micro_batch_size=8)),
    ("llama-1b", dict(micro_batch_size=4)),
    ("gpt2-355m", dict(micro_batch_size=16, checkpointing="full")),
    ("llama-1b", dict(micro_batch_size=8, checkpointing="full")),
    ("gpt2-355m", dict(micro_batch_size=16, checkpointing="selective")),
    ("llama-1b", dict(micro_batch_size=4, checkpointing="selective")),
    ("llama-1b", dict(micro_batch_size=2, grad_accum=2)),
    ("gpt2-355m", dict(micro_batch_size=4, precision="fp32")),
    ("gpt2-355m", dict(micro_batch_size=16, compile=True)),
]


_PROFILES: dict = {}


def profiles(name: str, topo):
    if name not in _PROFILES:
        with torch.device("meta"):
            model = build(name)
        _PROFILES[name] = profile_variants(model, token_batch(name, 1), topo, warn=False)
    return _PROFILES[name]


def predict(rec: dict, name: str, plan: autopar.Plan, topo) -> None:
    """The analytic prediction into `rec` (recomputed offline from these records too: bench/report_h200.py)."""
    t0 = time.perf_counter()
    try:
        profile, variants = profiles(name, topo)
        pred = predict_profile(profile, plan, topo, calibration_for(topo), variants=variants)
        rec.update(pred_alloc=pred.memory.allocated_bytes, pred_peak=pred.memory.peak_bytes,
                   pred_step_s=pred.step_s, pred_parts=pred.memory.parts(), pred_time_parts=pred.time.parts(),
                   profile_s=time.perf_counter() - t0)
    except Exception as exc:
        rec.update(pred_error=repr(exc)[:400])


def exact(rec: dict, name: str, plan: autopar.Plan) -> None:
    """The exact check's traced peak into `rec` (on a fake CUDA device: no GPU memory used)."""
    t0 = time.perf_counter()
    try:
        ex = exact_memory(lambda: build(name), token_batch(name, 1, "cpu"), plan, device="cuda")
        rec.update(exact_alloc=ex.peak_bytes, exact_parts=ex.by_category, exact_s=time.perf_counter() - t0)
    except Exception as exc:  # recorded; the real run still happens
        rec.update(exact_error=repr(exc)[:400])


def run(rec: dict, name: str, plan: autopar.Plan, *, warmup: int, steps: int) -> None:
    """The real run's step time and peak allocated and reserved memory into `rec`."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        with torch.device("cuda"):
            model = build(name)
        model = autopar.wrap(model, sample=token_batch(name, plan.micro_batch_size, "cuda"), plan=plan,
                             global_batch_size=plan.global_batch_size, verbose=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        step = autopar.train_step(model, opt)
        batch = token_batch(name, plan.local_batch_size, "cuda")
        batch["input_ids"] = torch.randint(0, 30000, batch["input_ids"].shape, device="cuda")
        batch["labels"] = batch["input_ids"]
        for _ in range(warmup):
            step(batch)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = step(batch)
        torch.cuda.synchronize()
        rec.update(step_s=(time.perf_counter() - t0) / steps, loss=float(loss),
                   real_alloc=torch.cuda.max_memory_allocated(), real_reserved=torch.cuda.max_memory_reserved(),
                   status="ok")
        del model, opt, step
    except torch.cuda.OutOfMemoryError as exc:
        rec.update(status="oom", error=str(exc)[:200])
    except Exception as exc:
        rec.update(status="error", error=repr(exc)[:400])
    gc.collect()
    torch.cuda.empty_cache()


def errors(rec: dict, context: int) -> None:
    if "real_alloc" in rec and "pred_alloc" in rec:
        rec["err_pred_alloc"] = rec["pred_alloc"] / rec["real_alloc"] - 1
        rec["err_pred_peak"] = rec["pred_peak"] / (rec["real_reserved"] + context) - 1
        rec["err_pred_step"] = rec["pred_step_s"] / rec["step_s"] - 1
    if "real_alloc" in rec and "exact_alloc" in rec:
        rec["err_exact_alloc"] = rec["exact_alloc"] / rec["real_alloc"] - 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deadline-s", type=float, default=150.0)
    ap.add_argument("--only", type=int, default=None, help="the first N configurations")
    ap.add_argument("--pick", default=None, help="comma-separated indices of CONFIGS to run")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    checks = ap.add_mutually_exclusive_group()
    checks.add_argument("--no-exact", action="store_true", help="no exact check")
    checks.add_argument("--exact-only", action="store_true", help="the exact check only: no prediction, no real run")
    args = ap.parse_args()
    start = time.perf_counter()
    out_dir = os.environ.get("OUT", "/tmp")
    path = os.path.join(out_dir, "validate.jsonl")
    topo = autopar.Topology.detect()
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    context = total - free - torch.cuda.memory_reserved()
    header = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "command": " ".join(sys.argv), "cuda_context_bytes": context}
    with open(path, "w") as f:
        f.write(json.dumps(header) + "\n")
    print(json.dumps(header), flush=True)
    configs = CONFIGS if args.only is None else CONFIGS[: args.only]
    if args.pick:
        configs = [CONFIGS[int(i)] for i in args.pick.split(",")]
    for name, kw in configs:
        if time.perf_counter() - start > args.deadline_s:
            print(json.dumps({"skipped": [name, kw], "reason": "deadline"}), flush=True)
            continue
        plan = autopar.Plan(**{"precision": "bf16", **kw})
        rec: dict = {"model": name, **kw}
        if not args.exact_only:
            predict(rec, name, plan, topo)
        if not args.no_exact:
            exact(rec, name, plan)
        if not args.exact_only:
            run(rec, name, plan, warmup=args.warmup, steps=args.steps)
        errors(rec, context)
        rec["wall_s"] = time.perf_counter() - start
        line = json.dumps(rec, default=float)
        print(line, flush=True)
        with open(path, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
