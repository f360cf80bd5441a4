"""How long `autopar.plan` + `autopar.predict` take per zoo family at its realistic size, on this CPU (issue 33's
CPU must-show: within 60 s a family, none raising, for "1xH200" and "8xH100-SXM").

Each family runs in its own process (a fresh Python, torch imported once, the model built on the meta device at
its realistic size); per topology the record has the seconds of `autopar.plan` and of `autopar.predict` on the
plan it chose, in that order, and each call's phases (the traces, the search) as autopar logs them. The first
topology's time includes the traces; the second reuses nothing that autopar does not itself reuse.

    python -m bench zoo-plan-speed [--families a,b] [--family-timeout-s 300] [--time-budget-s 3000] [--out FILE]

One JSON line per family is appended to `--out` (default $OUT/zoo_plan_speed.jsonl) as it ends; `--report FILE`
prints the table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from bench._common import results_path, stamp

TOPOLOGIES = ("1xH200", "8xH100-SXM")
TARGET_S = 60.0  # the bound, per family and topology


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default=None, help="comma-separated zoo families (default: all)")
    p.add_argument("--family-timeout-s", type=float, default=300.0)
    p.add_argument("--time-budget-s", type=float, default=3000.0)
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--report", default=None, help="print the table of a results file")
    return p


def measure_family(name: str) -> dict[str, Any]:
    """plan + predict of one family at its realistic size, per topology, in this process."""
    import autopar
    from bench.zoo import build_model, family, make_sample

    f = family(name)
    start = time.perf_counter()
    model = build_model(f, "realistic")
    sample = make_sample(f, "realistic")
    rec: dict[str, Any] = {"build_s": round(time.perf_counter() - start, 2)}
    for topology in TOPOLOGIES:
        row: dict[str, Any] = {}
        try:
            t0 = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                plan = autopar.plan(model, sample=sample, topology=topology, loss_fn=f.loss_fn)
            t1 = time.perf_counter()
            prediction = autopar.predict(model, plan, sample=sample, topology=topology, loss_fn=f.loss_fn)
            t2 = time.perf_counter()
            row.update(status="ok", plan_s=round(t1 - t0, 2), predict_s=round(t2 - t1, 2),
                       total_s=round(t2 - t0, 2), step_ms=round(prediction.step_s * 1e3, 2),
                       plan=plan.describe().splitlines()[0],
                       warnings=[str(w.message)[:200] for w in caught if "autopar" in str(w.message)][:3])
        except Exception as exc:  # recorded: the must-show says none raises
            row.update(status="error", error=f"{type(exc).__name__}: {str(exc).strip()[:300]}",
                       total_s=round(time.perf_counter() - t0, 2))
        rec[topology] = row
    return rec


def report(path: str) -> str:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    out = [f"| family | build s | {' | '.join(f'{t} plan + predict s' for t in TOPOLOGIES)} | status |",
           "| --- | ---: | " + " | ".join("---:" for _ in TOPOLOGIES) + " | --- |"]
    over = 0
    for r in rows:
        if r.get("status") != "ok":
            out.append(f"| {r['family']} | | {' | '.join('' for _ in TOPOLOGIES)} | {r.get('status')}: "
                       f"{r.get('error', '')[:120]} |")
            continue
        cells = []
        for t in TOPOLOGIES:
            x = r[t]
            if x.get("status") != "ok":
                cells.append(f"{x.get('status')}: {x.get('error', '')[:80]}")
                continue
            flag = " **over**" if x["total_s"] > TARGET_S else ""
            over += bool(flag)
            cells.append(f"{x['plan_s']:.1f} + {x['predict_s']:.1f}{flag}")
        out.append(f"| {r['family']} | {r['build_s']:.1f} | {' | '.join(cells)} | ok |")
    out.append(f"\n{len(rows)} families; {over} cells over {TARGET_S:.0f} s.")
    return "\n".join(out)


def _without_flag(argv: list[str], flag: str) -> list[str]:
    """`argv` without `flag` and its value (`--flag value` or `--flag=value`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.report:
        print(report(args.report))
        return 0
    out = results_path(args.out, "zoo_plan_speed.jsonl")
    given = sys.argv[1:] if argv is None else list(argv)
    if args.child:
        from bench.zoo import family

        rec: dict[str, Any] = {"family": args.child, **stamp(" ".join(["python -m bench.zoo_plan_speed", *given]))}
        why = family(args.child).unavailable()
        try:
            rec.update({"status": "unavailable", "error": why} if why else
                       {"status": "ok", **measure_family(args.child)})
        except Exception as exc:  # recorded; the other families still run
            rec.update(status="error", error=f"{type(exc).__name__}: {str(exc).strip()[:300]}")
        with open(out, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(json.dumps({k: rec.get(k) for k in ("family", "status", "build_s", *TOPOLOGIES)}), flush=True)
        return 0
    from bench.zoo import ZOO

    names = args.families.split(",") if args.families else [f.name for f in ZOO]
    start = time.perf_counter()
    for name in names:
        left = args.time_budget_s - (time.perf_counter() - start)
        if left < 10:
            print(f"{name}: not reached (the time budget is spent)", flush=True)
            continue
        child = _without_flag(given, "--families")
        proc = subprocess.Popen([sys.executable, "-m", "bench.zoo_plan_speed", *child, "--child", name, "--out",
                                 str(out)], cwd=Path(__file__).resolve().parents[1], start_new_session=True)
        try:
            proc.wait(timeout=min(args.family_timeout_s, left))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            with open(out, "a") as f:
                f.write(json.dumps({"family": name, "status": "timeout",
                                    "error": f"killed at {min(args.family_timeout_s, left):.0f} s"}) + "\n")
            print(f"{name}: killed at its time limit", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
