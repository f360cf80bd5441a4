"""Fit the cost model's factors to the H200 anchor measurements, and report prediction errors.

The anchors (../shared/anchors/h200_2026-11-29.json and grid_h200_2026-11-29.json) are plain-PyTorch
runs of Hugging Face GPT-2 (124M, 355M, 1.5B) and a Llama-1B shape on one H200 (torch 2.11): fp32, bf16
autocast with fused AdamW, + torch.compile, + full activation checkpointing. Each maps to one autopar plan
on one GPU. This script profiles each model on fake tensors (CPU, no memory), predicts every run with the
default calibration, fits the time and memory factors (coordinate search on the mean squared log error),
and prints and writes both error tables.

    python -m bench.calibrate_anchors [--anchors ../shared/anchors] [--out bench/results]

The fit is on these anchors: an independent check is the H200 grid of autopar-wrapped runs
(bench/grid_single_gpu.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
import time

import torch

import autopar
from autopar.cost import Calibration, predict_profile
from autopar.profile import profile_model
from bench._common import RESULTS, ROOT

GiB = 2**30
SETTINGS = {  # anchor setting -> plan options (fused AdamW in all but fp32, as autopar users would run)
    "fp32": dict(precision="fp32"),
    "bf16amp+fused": dict(precision="bf16"),
    "bf16amp+compile": dict(precision="bf16", compile=True),
    "bf16amp+ac": dict(precision="bf16", checkpointing="full"),
}


def build(name: str):
    """The anchors' models (GPT-2 with its default dropout, as the anchors ran it; not bench/_common.py's)."""
    import transformers  # optional (autopar[hf])

    if name.startswith("gpt2"):
        h, layers, heads = {"gpt2-124M": (768, 12, 12), "gpt2-355M": (1024, 24, 16), "gpt2-1.5B": (1600, 48, 25)}[name]
        cfg = transformers.GPT2Config(n_embd=h, n_layer=layers, n_head=heads, n_positions=1024,
                                      attn_implementation="sdpa")
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                                   num_key_value_heads=8, intermediate_size=8192, vocab_size=32000,
                                   max_position_embeddings=2048, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg)


def load_runs(anchors: str) -> list[dict]:
    runs = []
    for fname in ("h200_2026-11-29.json", "grid_h200_2026-11-29.json"):
        for r in json.load(open(os.path.join(anchors, fname))):
            if r["setting"] in SETTINGS:
                runs.append(r)
    return runs


def profiles(runs: list[dict]) -> dict:
    out = {}
    for r in runs:
        key = (r["model"], r["seq"])
        if key in out:
            continue
        t = time.perf_counter()
        with torch.device("meta"):
            model = build(r["model"])
        ids = torch.zeros(2, r["seq"], dtype=torch.long, device="meta")
        sample = {"input_ids": ids, "labels": ids}
        out[key] = (profile_model(model, sample, warn=False), profile_model(model, sample, precision="bf16", warn=False))
        print(f"profiled {r['model']} in {time.perf_counter() - t:.1f} s", flush=True)
    return out


def predict_all(runs: list[dict], profs: dict, cal: Calibration, topo) -> list[dict]:
    rows = []
    for r in runs:
        fp32, bf16 = profs[(r["model"], r["seq"])]
        plan = autopar.Plan(micro_batch_size=r["mb"], **SETTINGS[r["setting"]])
        pred = predict_profile(fp32, plan, topo, cal, variants={"bf16": bf16})
        row = dict(model=r["model"], setting=r["setting"], mb=r["mb"], oom=bool(r.get("oom")),
                   pred_step_ms=pred.step_s * 1e3, pred_alloc_GiB=pred.memory.allocated_bytes / GiB,
                   pred_peak_GiB=pred.memory.peak_bytes / GiB,
                   fits=pred.memory.peak_bytes <= topo.device.memory_bytes)
        if not r.get("oom"):
            row.update(step_ms=r["step_ms"], alloc_GiB=r["peak_GiB"],
                       time_err=pred.step_s * 1e3 / r["step_ms"] - 1,
                       mem_err=pred.memory.allocated_bytes / GiB / r["peak_GiB"] - 1)
        rows.append(row)
    return rows


def loss(rows: list[dict], key: str) -> float:
    errs = [math.log(1 + r[key]) ** 2 for r in rows if key in r]
    return sum(errs) / len(errs)


def fit(runs, profs, cal, topo, names, key, rounds=4):
    for _ in range(rounds):
        for name in names:
            best = (loss(predict_all(runs, profs, cal, topo), key), getattr(cal, name))
            for mult in (0.5, 0.7, 0.8, 0.9, 0.95, 1.05, 1.1, 1.25, 1.4, 2.0):
                trial = cal.replace(**{name: getattr(cal, name) * mult})
                value = loss(predict_all(runs, profs, trial, topo), key)
                if value < best[0]:
                    best = (value, getattr(trial, name))
            cal = cal.replace(**{name: best[1]})
    return cal


def table(rows: list[dict]) -> str:
    lines = [f"{'model':10} {'setting':16} {'mb':>3} {'step ms':>8} {'pred':>8} {'err':>7} {'GiB':>6} {'pred':>6} {'err':>7}"]
    for r in rows:
        if r["oom"]:
            lines.append(f"{r['model']:10} {r['setting']:16} {r['mb']:>3} {'OOM':>8} {r['pred_step_ms']:8.1f} {'':>7} "
                         f"{'OOM':>6} {r['pred_peak_GiB']:6.1f} {'fits' if r['fits'] else 'OOM':>7}")
        else:
            lines.append(f"{r['model']:10} {r['setting']:16} {r['mb']:>3} {r['step_ms']:8.1f} {r['pred_step_ms']:8.1f} "
                         f"{r['time_err']:+7.1%} {r['alloc_GiB']:6.1f} {r['pred_alloc_GiB']:6.1f} {r['mem_err']:+7.1%}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--anchors", default=str(ROOT.parent / "shared" / "anchors"))
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    topo = autopar.Topology.from_spec("H200")
    runs = load_runs(args.anchors)
    profs = profiles(runs)
    before = Calibration()
    rows_before = predict_all(runs, profs, before, topo)
    cal = fit(runs, profs, before, topo, ["matmul_efficiency", "matmul_half_width", "fp32_matmul_efficiency",
                                          "memory_efficiency", "compile_traffic_factor", "launch_s"], "time_err")
    cal = fit(runs, profs, cal, topo, ["transient_factor", "autocast_activation_factor", "compile_activation_factor",
                                       "compile_transient_factor", "gradient_peak_fraction"], "mem_err")
    rows_after = predict_all(runs, profs, cal, topo)
    print("default calibration\n" + table(rows_before))
    print("\nfitted calibration\n" + table(rows_after))
    changed = {f.name: getattr(cal, f.name) for f in dataclasses.fields(cal)
               if getattr(cal, f.name) != getattr(before, f.name) and f.name not in ("source", "extra")}
    print("\nfitted factors:", json.dumps(changed, indent=1))
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, f"calibration_anchors_{datetime.date.today().isoformat()}.json")
    json.dump({"date": datetime.date.today().isoformat(), "device": "NVIDIA H200 (anchor measurements)",
               "torch_measured": "2.11", "torch_profiled": torch.__version__, "command": " ".join(sys.argv),
               "fitted": changed, "before": rows_before, "after": rows_after}, open(out, "w"), indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
