"""The H200 measurements of 2026-11-29 against the cost model as it is now: prediction errors and choice quality.

Reads the single-GPU validation runs (bench/validate_h200.py records: real step time and peak memory, the
exact check's traced peak) and the tuning grids (bench/tune_h200.py: every feasible plan of the tuner's
space measured, GPT-2-355M at global batch 16, Llama-1B at 32), predicts each plan with the current model
(profiles traced here on fake tensors, the default calibration for a 1 x H200 topology), and prints:
1. per configuration: exact check vs real allocated; analytic allocated, reserved + context, step time vs real;
2. per grid plan: the same analytic errors;
3. choice quality: the search's first plan among the grid (autopar.candidates(..., eager=True)) measured
   against the grid's fastest, and whether any plan the search calls feasible ran out of memory.

    python -m bench.report_h200 --validate bench/results/validate_h200_2026-11-29.jsonl \
        --grid bench/results/tune_h200_2026-11-29.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch

import autopar
from autopar.cost import predict_profile
from autopar.planning import calibration_for, profile_variants
from bench._common import PLAN_KEYS, build, plan_from_short, token_batch

GiB = 2**30


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--validate", nargs="+", required=True, help="validate_h200 records, later records win")
    ap.add_argument("--grid", nargs="+", required=True, help="tune_h200 records")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    topo = autopar.Topology.from_spec("1xH200")
    cal = calibration_for(topo)
    profiles: dict = {}

    def predict(name: str, kw: dict):
        if name not in profiles:
            with torch.device("meta"):
                model = build(name)
            profiles[name] = (model, *profile_variants(model, token_batch(name, 1), topo, warn=False))
        _, profile, variants = profiles[name]
        return predict_profile(profile, autopar.Plan(**{"precision": "bf16", **kw}), topo, cal, variants=variants)

    runs: dict = {}
    exact: dict = {}
    context = None
    for path in args.validate:
        for line in open(path):
            rec = json.loads(line)
            if "cuda_context_bytes" in rec:
                # a context read while another process held memory on the GPU is not the context
                if rec["cuda_context_bytes"] < 4 * GiB:
                    context = rec["cuda_context_bytes"]
                continue
            key = (rec.get("model"), json.dumps({k: rec[k] for k in PLAN_KEYS if k in rec}, sort_keys=True))
            if "exact_alloc" in rec:
                exact[key] = rec["exact_alloc"]
            if rec.get("status") == "ok" and "step_s" in rec:
                runs[key] = rec
    context = context if context is not None else cal.context_bytes
    out = [f"# H200 (torch 2.11) measurements of 2026-11-29 against the cost model as of {datetime.date.today()} "
           f"(torch {torch.__version__}, default calibration for 1 x H200)",
           f"# python -m bench.report_h200 --validate {' '.join(args.validate)} --grid {' '.join(args.grid)}",
           f"# CUDA context (measured): {context / GiB:.2f} GiB", "",
           "## 1. Validation configurations (bench/validate_h200.py)",
           f"{'model':10} {'plan':34} {'real GiB':>8} {'exact':>7} {'err':>6} | {'analytic':>8} {'err':>6} | "
           f"{'res+ctx':>7} {'pred':>6} {'err':>6} | {'step ms':>7} {'pred':>7} {'err':>6}"]
    errs: dict = {"exact": [], "alloc": [], "reserved": [], "step": []}
    for (name, kws), r in runs.items():
        kw = json.loads(kws)
        p = predict(name, kw)
        ex = exact.get((name, kws))
        reserved = r["real_reserved"] + context
        e = {"alloc": p.memory.allocated_bytes / r["real_alloc"] - 1, "reserved": p.memory_bytes / reserved - 1,
             "step": p.step_s / r["step_s"] - 1}
        if ex:
            e["exact"] = ex / r["real_alloc"] - 1
        for k, v in e.items():
            errs[k].append(v)
        desc = " ".join(f"{k}={v}" for k, v in kw.items())
        ex_s = f"{ex / GiB:7.2f} {e['exact']:+6.1%}" if ex else f"{'-':>7} {'-':>6}"
        out.append(f"{name:10} {desc:34} {r['real_alloc'] / GiB:8.2f} {ex_s} | {p.memory.allocated_bytes / GiB:8.2f} "
                   f"{e['alloc']:+6.1%} | {reserved / GiB:7.2f} {p.memory_bytes / GiB:6.2f} {e['reserved']:+6.1%} | "
                   f"{r['step_s'] * 1e3:7.1f} {p.step_s * 1e3:7.1f} {e['step']:+6.1%}")
    for k, v in errs.items():
        if v:
            out.append(f"  {k:9} error {min(v):+.1%} to {max(v):+.1%} over {len(v)} configurations")

    rows = [json.loads(line) for path in args.grid for line in open(path)]
    out += ["", "## 2. Tuning grids (bench/tune_h200.py: every feasible plan of the tuner's space, measured)",
            f"{'model':10} {'plan':30} {'status':6} {'step ms':>8} {'pred':>7} {'err':>6} | {'alloc':>6} {'pred':>6} "
            f"{'err':>6} | {'res+ctx':>7} {'pred':>6} {'err':>6}"]
    grid_errs: dict = {"step": [], "alloc": [], "reserved": []}
    for r in rows:
        if r.get("summary") or r.get("what") != "grid":
            continue
        kw = plan_from_short(r["plan"])
        p = predict(r["model"], kw)
        if r["status"] != "ok":
            out.append(f"{r['model']:10} {r['plan']:30} {r['status']:6} {r.get('cause') or ''}")
            continue
        reserved = r["measured_reserved_bytes"] + context
        e = (p.step_s / r["measured_step_s"] - 1, p.memory.allocated_bytes / r["measured_allocated_bytes"] - 1,
             p.memory_bytes / reserved - 1)
        for k, v in zip(("step", "alloc", "reserved"), e):
            grid_errs[k].append(v)
        out.append(f"{r['model']:10} {r['plan']:30} {r['status']:6} {r['measured_step_s'] * 1e3:8.1f} "
                   f"{p.step_s * 1e3:7.1f} {e[0]:+6.1%} | {r['measured_allocated_bytes'] / GiB:6.2f} "
                   f"{p.memory.allocated_bytes / GiB:6.2f} {e[1]:+6.1%} | {reserved / GiB:7.2f} "
                   f"{p.memory_bytes / GiB:6.2f} {e[2]:+6.1%}")
    for k, v in grid_errs.items():
        if v:
            within = sum(abs(x) <= (0.15 if k == "step" else 0.05) for x in v)
            out.append(f"  {k:9} error {min(v):+.1%} to {max(v):+.1%} over {len(v)} plans "
                       f"({within} within {'15' if k == 'step' else '5'}%)")

    out += ["", "## 3. Choice quality: the search's first plan, measured, against each grid's fastest"]
    summaries = {(r["model"]): r for r in rows if r.get("summary") and r["what"] == "grid"}
    for model in sorted({r["model"] for r in rows if not r.get("summary")}):
        grid = {r["key"]: r for r in rows if not r.get("summary") and r["model"] == model and r["what"] == "grid"}
        ok = [r for r in grid.values() if r["status"] == "ok"]
        if not ok:
            continue
        gb = summaries[model]["global_batch"]
        m, _, _ = profiles.get(model, (None, None, None))
        if m is None:
            predict(model, {"micro_batch_size": 1})
            m = profiles[model][0]
        ranked = autopar.candidates(m, sample=token_batch(model, 1), topology=topo, global_batch_size=gb, eager=True,
                                    calibration=cal)
        feasible = [c for c in ranked if c.feasible]
        first = grid.get(feasible[0].plan.key()) if feasible else None  # None: not measured in the grid
        fastest = max(ok, key=lambda r: r["measured_tokens_per_s"])
        ooms = [r for r in grid.values() if r["status"] == "oom"]
        out.append(f"{model} (global batch {gb}): {len(grid)} plans measured, {len(ok)} ok, {len(ooms)} out of memory")
        out.append(f"  fastest measured: {fastest['plan']} {fastest['measured_tokens_per_s']:,.0f} tokens/s")
        if first is not None:
            out.append(f"  search's first:   {first['plan']} {first['measured_tokens_per_s']:,.0f} tokens/s "
                       f"({first['measured_tokens_per_s'] / fastest['measured_tokens_per_s'] - 1:+.1%}); "
                       f"{len(feasible)} plans feasible now, "
                       f"{sum(1 for c in feasible if c.plan.key() not in grid)} of them not in the grid")
    text = "\n".join(out)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
