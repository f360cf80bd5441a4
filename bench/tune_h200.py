"""Issue 5's must-show on one GPU: `autopar tune` against an exhaustive grid of the same plans.

For a Hugging Face model shape (bench/train_hf.py, the user's unmodified script, run as `python -m bench.train_hf`):
- `--what tune`: `python -m autopar tune --trials K ...` (the CLI, trials in the script's own process) with
  K the largest number of trials below a third of the search space (the cost model's feasible plans, eager
  and compiled: `autopar.candidates(..., eager=True)`), from a fresh inductor cache;
- `--what grid`: every plan of that space measured the same way (autopar.tune.study.tune with no trial
  budget, no pruning, every plan enqueued in predicted order), from another fresh inductor cache.
Each writes a JSON line per trial and a summary line to $OUT/tune_<model>.jsonl (the date, device, torch
version, command, the space, K, wall time). `python -m bench.tune_h200 --summarize FILE...` then compares
them: the tuned plan's grid throughput against the grid's fastest.

    python -m bench.tune_h200 --model gpt2-355m --global-batch 32 --what tune
    python -m bench.tune_h200 --model llama-1b --global-batch 32 --what grid --time-budget 500
    python -m bench.tune_h200 --summarize bench/results/tune_h200_2026-11-29.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch

import autopar
from autopar.tune.report import load_report
from autopar.tune.study import tune
from bench._common import ROOT, build, token_batch


def space_size(model: str, global_batch: int) -> int:
    with torch.device("meta"):
        m = build(model)
    ranked = autopar.candidates(m, sample=token_batch(model, 1), global_batch_size=global_batch, eager=True)
    return sum(1 for c in ranked if c.feasible)


def rows_of(study: str) -> list[dict]:
    rep = load_report(study)
    out = []
    for r in rep.rows:
        out.append(dict(number=r.number, key=r.key, plan=r.short, status=r.status, source=r.source,
                        predicted_step_s=r.predicted_step_s, predicted_tokens_per_s=r.predicted_throughput,
                        predicted_memory_bytes=r.predicted_memory_bytes,
                        predicted_allocated_bytes=r.predicted_allocated_bytes,
                        measured_step_s=r.measured_step_s, measured_tokens_per_s=r.measured_throughput,
                        measured_allocated_bytes=r.measured_allocated_bytes,
                        measured_reserved_bytes=r.measured_reserved_bytes, fitted_step_s=r.fitted_step_s,
                        wall_s=r.wall_s, cause=r.cause))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-355m")
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--what", choices=("tune", "grid"), default="tune")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--trials", type=int, default=None, help="tune: default the largest K < space / 3")
    ap.add_argument("--time-budget", type=float, default=None, help="start no trial after S seconds")
    ap.add_argument("--study", default=None, help="the study's SQLite file (default: a new temporary one); "
                    "an existing grid study is resumed")
    ap.add_argument("--summarize", nargs="*", default=None, metavar="FILE")
    args = ap.parse_args()
    if args.summarize is not None:
        return summarize(args.summarize)
    out_dir = os.environ.get("OUT", ".")
    path = os.path.join(out_dir, f"tune_{args.model}.jsonl")
    work = tempfile.mkdtemp(prefix=f"autopar-{args.what}-")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(work, "inductor"),
               TRITON_CACHE_DIR=os.path.join(work, "triton"), AUTOPAR_CACHE_DIR=os.path.join(work, "cache"),
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")  # for `-m bench.train_hf`
    script = [sys.executable, "-m", "bench.train_hf", "--model", args.model, "--global-batch", str(args.global_batch)]
    started = time.perf_counter()
    os.environ["AUTOPAR_CACHE_DIR"] = env["AUTOPAR_CACHE_DIR"]  # the space the tuner will see: no cached calibration
    n = space_size(args.model, args.global_batch)
    head = {"what": args.what, "model": args.model, "global_batch": args.global_batch, "space": n,
            "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "command": " ".join(sys.argv), "steps": args.steps, "warmup": args.warmup}
    study = args.study or os.path.join(work, "study.db")
    t0 = time.perf_counter()
    if args.what == "tune":
        k = args.trials or max(1, math.ceil(n / 3) - 1)
        head["trials"] = k
        cmd = [sys.executable, "-m", "autopar", "tune", "--study", study, "--trials", str(k), "--steps",
               str(args.steps), "--warmup", str(args.warmup), "--plan-out", os.path.join(work, "plan.yaml"),
               "--trial-timeout", "300"] + (["--time-budget", str(args.time_budget)] if args.time_budget else []) + ["--"]
        proc = subprocess.run(cmd + script, env=env, capture_output=True, text=True)
        head.update(returncode=proc.returncode, output_tail=(proc.stdout + proc.stderr)[-6000:])
    else:
        os.environ.update({k: v for k, v in env.items() if k != "PYTHONPATH"})
        rep = tune(script, study_path=study, trials=None, time_budget_s=args.time_budget, steps=args.steps,
                   warmup=args.warmup, top_k_enqueue=10_000, prune_factor=float("inf"), env=env)
        head.update(stopped=rep.stopped)
    head.update(wall_s=time.perf_counter() - t0, total_s=time.perf_counter() - started)
    rows = rows_of(study) if os.path.exists(study) else []
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps({"what": args.what, "model": args.model, **r}) + "\n")
        f.write(json.dumps({"summary": True, **head}) + "\n")
    print(json.dumps(head)[:3000], flush=True)
    return 0


def summarize(files: list[str]) -> int:
    """Per model: the grid's fastest plan, the plan tune chose, its throughput in the grid and in its own
    trial, the trials each took, and the plan the search ranks first (issue 4's choice quality)."""
    recs = [json.loads(line) for f in files for line in open(f) if line.strip()]
    for model in sorted({r["model"] for r in recs}):
        grid = [r for r in recs if r["model"] == model and r["what"] == "grid" and not r.get("summary")]
        tuned = [r for r in recs if r["model"] == model and r["what"] == "tune" and not r.get("summary")]
        heads = {r["what"]: r for r in recs if r["model"] == model and r.get("summary")}
        ok = [r for r in grid if r["status"] == "ok"]
        print(f"\n== {model}: space {heads.get('grid', heads.get('tune', {})).get('space')} plans")
        for r in sorted(grid, key=lambda r: -(r["measured_tokens_per_s"] or 0)):
            print(f"  grid  {r['plan']:34} {r['status']:7} measured {r['measured_tokens_per_s'] or 0:10,.0f} tok/s  "
                  f"predicted {r['predicted_tokens_per_s'] or 0:10,.0f}  ({r['source']})")
        for r in tuned:
            print(f"  tune  {r['plan']:34} {r['status']:7} measured {r['measured_tokens_per_s'] or 0:10,.0f} tok/s  "
                  f"({r['source']})")
        if ok and tuned:
            best = max(ok, key=lambda r: r["measured_tokens_per_s"])
            t_ok = [r for r in tuned if r["status"] == "ok"]
            chosen = max(t_ok, key=lambda r: r["measured_tokens_per_s"]) if t_ok else None
            in_grid = next((r for r in ok if chosen and r["key"] == chosen["key"]), None)
            print(f"  grid fastest: {best['plan']} {best['measured_tokens_per_s']:,.0f} tok/s over "
                  f"{len(grid)} trials in {heads.get('grid', {}).get('wall_s', 0):.0f} s")
            if chosen:
                print(f"  tune chose:   {chosen['plan']} {chosen['measured_tokens_per_s']:,.0f} tok/s in its trial; "
                      f"{(in_grid or {}).get('measured_tokens_per_s', 0):,.0f} in the grid "
                      f"({(in_grid or {}).get('measured_tokens_per_s', 0) / best['measured_tokens_per_s'] - 1:+.1%}); "
                      f"{len(tuned)} trials in {heads.get('tune', {}).get('wall_s', 0):.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
