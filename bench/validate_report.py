"""Report the H200 validation runs (bench/validate_h200.py) against the cost model as it is now.

Reads the measured records (real peak allocated / reserved memory, step time; the exact check's traced
peak where it ran), predicts each configuration again with the current analytic model (profiles traced
here on fake tensors), and prints and writes a table of the errors.

    python bench/validate_report.py bench/results/validate_h200_2026-11-29.jsonl [more.jsonl ...] --out FILE
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import autopar  # noqa: E402
from autopar.cost import predict_profile  # noqa: E402
from autopar.planning import calibration_for, profile_variants  # noqa: E402
from validate_h200 import build, sample  # noqa: E402

GiB = 2**30
PLAN_KEYS = ("micro_batch_size", "grad_accum", "checkpointing", "precision", "compile")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("records", nargs="+")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    header, runs, exact = None, [], {}
    for path in args.records:
        for line in open(path):
            rec = json.loads(line)
            if "device" in rec:
                header = rec
            elif "real_alloc" in rec:
                runs.append(rec)
            elif "exact_alloc" in rec:
                exact[json.dumps({k: rec.get(k) for k in ("model",) + PLAN_KEYS})] = rec["exact_alloc"]
    topo = autopar.Topology.from_spec("1xH200")
    cal = calibration_for(topo)
    context = header["cuda_context_bytes"] if header else cal.context_bytes
    profiles = {}
    lines = [f"# H200 validation, measured {header['date']} on {header['device']}, torch {header['torch']}",
             f"# measured with: {header['command']}", f"# reported {datetime.date.today()} with torch "
             f"{torch.__version__}: python bench/validate_report.py {' '.join(args.records)}",
             f"# CUDA context measured: {context / GiB:.2f} GiB",
             "model      plan                         real alloc  exact   err   | analytic alloc err | "
             "reserved+ctx  predicted  err | step ms  predicted  err"]
    for r in runs:
        name = r["model"]
        if name not in profiles:
            with torch.device("meta"):
                model = build(name)
            profiles[name] = profile_variants(model, sample(name, 1, "meta"), topo, warn=False)
        profile, variants = profiles[name]
        kw = {k: r[k] for k in PLAN_KEYS if k in r}
        plan = autopar.Plan(**{"precision": "bf16", **kw})
        p = predict_profile(profile, plan, topo, cal, variants=variants)
        key = json.dumps({k: r.get(k) for k in ("model",) + PLAN_KEYS})
        ex = r.get("exact_alloc", exact.get(key))
        ex_s = f"{ex / GiB:6.2f} {ex / r['real_alloc'] - 1:+6.1%}" if ex else "     -       -"
        reserved = r["real_reserved"] + context
        desc = " ".join(f"{k}={v}" for k, v in kw.items())
        lines.append(
            f"{name:10s} {desc:28s} {r['real_alloc'] / GiB:7.2f}  {ex_s} | {p.memory.allocated_bytes / GiB:6.2f} "
            f"{p.memory.allocated_bytes / r['real_alloc'] - 1:+6.1%} | {reserved / GiB:7.2f} {p.memory_bytes / GiB:8.2f} "
            f"{p.memory_bytes / reserved - 1:+6.1%} | {r['step_s'] * 1e3:6.1f} {p.step_s * 1e3:8.1f} "
            f"{p.step_s / r['step_s'] - 1:+6.1%}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
