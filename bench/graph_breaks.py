"""Where torch.compile splits each zoo family's forward: dynamo's graphs and graph breaks, on the device.

autopar prices a compiled step as one graph whose memory-bound work fuses (autopar.profile.fusion); a graph
break leaves the ops between graphs eager, and an opaque custom op (transformers' fp32 MoE fallback,
`transformers::grouped_mm_fallback`) runs its own ops eagerly inside a graph. This records, per family at
its realistic size and batch, what `torch._dynamo.explain` finds for the forward as the user's compiled
step runs it (bf16 autocast around the model): the number of graphs, of breaks, and each break's reason
and the user frame where it happened. Dynamo only traces here (no inductor), so a family takes seconds.

One JSON line per family, appended to `--out`; each family in its own process, killed at `--family-timeout-s`.

    python -m bench.graph_breaks --families qwen2-moe,olmoe,gpt2 --out $OUT/graph_breaks.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench._common import results_path
from bench.zoo import FAMILIES, ZOO, Family, build_model, make_sample

NUM_REASONS = 12  # breaks kept per family (the first ones; a break in a block repeats per block)


def _to(sample: Any, device: torch.device) -> Any:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in sample.items()}


def explain_family(family: Family, *, size: str, device: str) -> dict[str, Any]:
    """dynamo's graphs and breaks for the family's forward under bf16 autocast on `device`."""
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(family, size).train()
    sample = _to(make_sample(family, size), torch.device(device))

    def forward(**kwargs: Any) -> Any:
        with torch.autocast(device, dtype=torch.bfloat16):
            return model(**kwargs)

    t0 = time.perf_counter()
    explained = torch._dynamo.explain(forward)(**sample)
    reasons = []
    for brk in explained.break_reasons[:NUM_REASONS]:
        frame = brk.user_stack[-1] if brk.user_stack else None
        reasons.append({"reason": str(brk.reason).strip().splitlines()[0][:300] if str(brk.reason).strip() else "",
                        "where": (f"{Path(frame.filename).name}:{frame.lineno} {frame.name}" if frame else "")})
    return {"graphs": explained.graph_count, "breaks": explained.graph_break_count,
            "ops": explained.op_count, "reasons": reasons, "explain_s": round(time.perf_counter() - t0, 2)}


def environment(device: str) -> dict[str, Any]:
    try:
        import transformers

        tf = transformers.__version__
    except ImportError:
        tf = None
    return {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "transformers": tf,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.graph_breaks", description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(f.name for f in ZOO))
    ap.add_argument("--size", choices=("realistic", "tiny"), default="realistic")
    ap.add_argument("--family-timeout-s", type=float, default=120.0)
    ap.add_argument("--time-budget-s", type=float, default=400.0, help="no family starts after this (s)")
    ap.add_argument("--out", default=None, help="the JSON-lines file (default: $OUT/graph_breaks.jsonl)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = results_path(args.out, "graph_breaks.jsonl")
    given = sys.argv[1:] if argv is None else list(argv)
    if args.child:
        family = FAMILIES[args.child]
        rec: dict[str, Any] = {"family": family.name, "size": args.size, **environment(device),
                               "command": " ".join(["python -m bench.graph_breaks", *given])}
        why = family.unavailable()
        try:
            rec.update({"status": "unavailable", "error": why} if why else
                       {"status": "ok", **explain_family(family, size=args.size, device=device)})
        except Exception as exc:  # recorded; the other families still run
            rec.update(status="error", error=f"{type(exc).__name__}: {str(exc).strip()[:300]}")
        with open(out, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"{family.name:20} {rec['status']:6} graphs {rec.get('graphs')} breaks {rec.get('breaks')}",
              flush=True)
        return 0
    start = time.perf_counter()
    for name in args.families.split(","):
        left = args.time_budget_s - (time.perf_counter() - start)
        if left < 10:
            print(f"{name}: not reached (the time budget is spent)", flush=True)
            continue
        proc = subprocess.Popen([sys.executable, "-m", "bench.graph_breaks", "--child", name, *given],
                                cwd=Path(__file__).resolve().parents[1], start_new_session=True)
        try:
            proc.wait(timeout=min(args.family_timeout_s, left))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            print(f"{name}: killed at its time limit", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
