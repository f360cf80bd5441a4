"""What is alive at an eager training step's memory peak, on the GPU and in autopar's fake trace (issue 10).

For each zoo family at its realistic size and batch: the hand recipe (bf16 autocast, fused AdamW, eager) runs
`--warmup` steps on the GPU, then one step under the caching allocator's memory history
(torch.cuda.memory._record_memory_history); the history is replayed to the step's peak, and the blocks alive
there are listed with the Python frames that allocated them. The same step is traced on fake tensors twice,
once dispatched as on the GPU (a fake CUDA device: CUDA's kernels and autocast) and once as on the CPU (what
autopar does on a machine without a GPU, with CUDA autocast's float32 casts), and each trace's live-memory
peak (autopar.profile.live) is listed the same way. One JSON line per family.

    python -m bench.memory_peak --families bert,t5 --out $OUT/memory_peak.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from autopar.profile.blocks import find_blocks
from autopar.profile.trace import StepTrace
from bench.zoo import Family, build_model, call, family, make_sample

GiB = 2**30


def fake_peak(fam: Family, sample: dict[str, Any], device: str) -> dict[str, Any]:
    """The family's bf16 step traced on fake tensors on `device`: its live-memory frontier and peak contents."""
    model = build_model(fam, "realistic")  # meta
    _, units, _ = find_blocks(model, None)
    on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in sample.items()}
    trace = StepTrace(model, on_device, units, loss_fn=fam.loss_fn, precision="bf16")
    result = trace.run()
    contents = trace.watcher.live.peak_contents()
    return {"frontier": [list(p) for p in result.live_frontier],
            "peak_bytes": max((a + g for a, g in result.live_frontier), default=0),
            "allocator_reserve_bytes": result.allocator_reserve_bytes,
            "top": [[op, list(shape), dtype, n, b] for (op, shape, dtype), n, b in contents[:30]]}


def _frames(event: dict[str, Any]) -> str:
    """The innermost Python frames outside torch's own files that allocated a block (or the innermost)."""
    frames = [f for f in event.get("frames", []) if f.get("filename", "").endswith(".py")]
    outside = [f for f in frames if "/torch/" not in f["filename"]]
    chosen = (outside or frames)[:2]
    return " < ".join(f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in chosen) or "(no Python frame)"


def gpu_peak(fam: Family, sample: dict[str, Any], warmup: int, compiled: bool) -> dict[str, Any]:
    """The hand recipe's step on the GPU (the model under torch.compile where `compiled`): the measured peak
    and what is alive there, by allocating frames."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = fam.build("realistic").train()
    runnable = torch.compile(model) if compiled else model
    batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in sample.items()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fam.loss_fn(call(runnable, batch), batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated()
    reserved = torch.cuda.max_memory_reserved()
    alive: dict[int, tuple[int, str]] = {}
    total, best, at_best = 0, 0, {}
    for event in snap["device_traces"][0]:
        if event["action"] == "alloc":
            alive[event["addr"]] = (event["size"], _frames(event))
            total += event["size"]
            if total > best:
                best, at_best = total, dict(alive)
        elif event["action"] == "free_completed" and event["addr"] in alive:
            total -= alive.pop(event["addr"])[0]
    groups: dict[str, list[int]] = {}
    for size, where in at_best.values():
        entry = groups.setdefault(where, [0, 0])
        entry[0] += 1
        entry[1] += size
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"peak_allocated_bytes": peak, "peak_reserved_bytes": reserved, "reserve_bytes": reserved - peak,
            "base_bytes": base, "replayed_peak_bytes": base + best,
            "parameter_bytes": params,
            "top": sorted(([w, n, b] for w, (n, b) in groups.items()), key=lambda g: -g[2])[:30]}


def one(name: str, warmup: int, modes: list[str]) -> dict[str, Any]:
    fam = family(name)
    sample = make_sample(fam, "realistic")
    rec: dict[str, Any] = {"family": name, "batch": fam.realistic_batch, "torch": torch.__version__,
                           "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv)}
    try:
        import transformers  # optional: the version the families were built with
        rec["transformers"] = transformers.__version__
    except ImportError:
        pass
    for device in ("cuda", "cpu"):
        if device == "cuda" and not torch.cuda.is_available():
            continue
        t0 = time.time()
        try:
            rec[f"fake_{device}"] = fake_peak(fam, sample, device)
        except Exception as exc:  # a trace that fails is recorded, the rest goes on
            rec[f"fake_{device}"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        rec[f"fake_{device}_s"] = round(time.time() - t0, 1)
    if torch.cuda.is_available():
        rec["device"] = torch.cuda.get_device_name()
    for mode in modes if torch.cuda.is_available() else ():
        gc.collect()
        torch.cuda.empty_cache()
        key = "gpu" if mode == "eager" else f"gpu_{mode}"
        t0 = time.time()
        try:
            rec[key] = gpu_peak(fam, sample, warmup, compiled=mode == "compile")
        except Exception as exc:  # an OOM or a failure is recorded, the rest goes on
            rec[key] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        rec[key + "_s"] = round(time.time() - t0, 1)
    return rec


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.memory_peak", description=__doc__.splitlines()[0])
    ap.add_argument("--families", required=True, help="comma-separated zoo families")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--modes", default="eager", help="comma-separated, of eager and compile (the GPU runs)")
    ap.add_argument("--out", required=True, help="the JSON-lines file the records are appended to")
    ap.add_argument("--family-timeout-s", type=float, default=150)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a family's own process
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.families, args.warmup, args.modes.split(","))))
        return
    for name in args.families.split(","):
        cmd = [sys.executable, "-m", "bench.memory_peak", "--one", "--families", name, "--warmup",
               str(args.warmup), "--modes", args.modes, "--out", args.out]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.family_timeout_s)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            rec = json.loads(lines[-1]) if lines else {"family": name, "error": proc.stderr[-2000:]}
        except subprocess.TimeoutExpired:
            rec = {"family": name, "error": f"timeout after {args.family_timeout_s} s"}
        with open(args.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(name, {k: v.get("peak_allocated_bytes", v.get("peak_bytes", v.get("error"))) for k, v in rec.items()
                     if isinstance(v, dict)}, flush=True)


if __name__ == "__main__":
    main()
