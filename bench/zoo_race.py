"""wrap against the hand recipes, timed interleaved: issue 10's ratio must-show on a host whose speed drifts.

bench/zoo_h200.py times its modes one after another. On the GPU machine's virtual host, a host-bound step's
median moved by up to 1.4x between two modes of one family measured a minute apart, on one plan
(bench/results/zoo_h200_2026-12-01g.jsonl: torchvision-resnet's hand_compile 23.3 ms, wrap's 26.7 ms, the
host's tiny-op time 6.7 and 9.9 us at their starts), so a sequential ratio near 1 says little. Here one
process builds every mode's step (hand, hand_compile, wrap: models side by side on the GPU), warms each,
then times `--rounds` rounds of `--steps` steps of each mode in turn, the order rotated every round, so that
a drift of the host lands on every mode alike. A mode's figure is the median of all its per-step CUDA-event
times; its rounds' medians are kept too, and the report gives wrap's ratios both ways: of the medians, and the
geometric mean of the per-round ratios (paired: a round's modes ran seconds apart).

One JSON line per family, appended to `--out`; each family in its own process, killed at `--family-timeout-s`.

    python -m bench.zoo_race --families clip,torchvision-resnet --rounds 5 --steps 10 --out $OUT/race.jsonl
    python -m bench.zoo_race --report bench/results/zoo_race_DATE.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from autopar.strategies.compile import default_backend
from bench._common import host_op_us, results_path
from bench.zoo_h200 import (FAMILIES, Measurement, Options, Predictor, Runner, Step, append, batch_of,
                            build_on_device, environment, first_line, kernels_of, real_sample, sync, time_steps)

MODES = ("hand", "hand_compile", "wrap")
#: A diagnostic mode: the hand recipe with the model's forward compiled in place, as autopar's apply_compile
#: does it (not the module, as torch.compile(model) does): whether a gap between wrap and hand_compile on the
#: same plan comes from how the model is compiled or from the rest of what wrap does.
FORWARD_COMPILE = "hand_compile_forward"


def _step(measurement: Measurement, mode: str, rec: dict[str, Any]) -> Step:
    """The mode's step on a model of its own, built and wrapped (or compiled) as bench.zoo_h200 does."""
    model = build_on_device(measurement.family, measurement.opts)
    sample = real_sample(measurement.family, measurement.opts)
    if mode == "wrap":
        return measurement._wrap(model, sample, rec, mode)
    if mode == FORWARD_COMPILE:
        step = measurement._hand(model, sample, rec, "hand")
        model.forward = torch.compile(model.forward, backend=default_backend())
        rec["plan_short"] = rec["plan_short"].replace("eager", "compile") + " (forward compiled in place)"
        return step
    return measurement._hand(model, sample, rec, mode)


def _dynamo_counts() -> dict[str, int]:
    """torch._dynamo's counters (frames, graphs, recompiles), flattened: their change over one mode's build and
    warm-up says how many graphs it made and whether it recompiled (e.g. a dynamic batch dimension)."""
    from torch._dynamo.utils import counters

    return {f"{group}.{key}": int(value) for group, table in counters.items() for key, value in table.items()
            if isinstance(value, (int, float))}


def _profile(step: Step, num_steps: int) -> dict[str, Any]:
    """Where the mode's step goes (bench.zoo_h200.kernels_of), less its per-op table: GPU busy time, kernel
    seconds and counts by kind, the longest kernels and the host's busiest ops."""
    out = kernels_of(step, num_steps)
    out.pop("op_device_top", None)
    return out


def race_family(name: str, modes: list[str], opts: Options, rounds: int, profile_steps: int = 0) -> dict[str, Any]:
    """Every mode's step built and warmed, then `rounds` rotated rounds of `opts.steps` steps each."""
    family = FAMILIES[name]
    measurement = Measurement(family, opts, Predictor(family, opts))
    rec: dict[str, Any] = {"family": name, "batch": batch_of(family, opts), "rounds": rounds, "steps": opts.steps,
                           "warmup": opts.warmup, **environment(opts), "modes": {}}
    steps: dict[str, Step] = {}
    for mode in modes:
        mode_rec: dict[str, Any] = {"batch": rec["batch"]}
        before = _dynamo_counts()
        start = time.perf_counter()
        try:
            steps[mode] = _step(measurement, mode, mode_rec)
            mode_rec["build_s"] = round(time.perf_counter() - start, 2)  # wrap: planning, applying, racing
            for _ in range(opts.warmup):
                steps[mode]()
            sync(opts.device)
            mode_rec["ready_s"] = round(time.perf_counter() - start, 2)  # and the warm-up steps (compile)
            mode_rec["status"] = "ok"
            mode_rec["dynamo"] = {k: v - before.get(k, 0) for k, v in _dynamo_counts().items()
                                  if v != before.get(k, 0)}
        except Exception as exc:  # recorded; the other modes still race
            mode_rec.update(status="error", error=first_line(exc))
            steps.pop(mode, None)
        rec["modes"][mode] = {k: v for k, v in mode_rec.items() if k in ("status", "error", "plan_short",
                                                                          "predicted_step_s", "optimizer",
                                                                          "dynamo", "plan_text", "wrap_timing",
                                                                          "build_s", "ready_s")}
    timing = dataclasses.replace(opts, warmup=0)
    times: dict[str, list[float]] = {m: [] for m in steps}
    round_medians: dict[str, list[float]] = {m: [] for m in steps}
    host_us = []
    order = list(steps)
    if not order:  # no mode could be built: the record says why, mode by mode
        return rec
    for r in range(rounds):
        host_us.append(host_op_us(opts.device))
        for mode in order[r % len(order):] + order[:r % len(order)]:  # rotated: no mode always runs first
            out = time_steps(steps[mode], timing)
            times[mode] += out["step_s_all"]
            round_medians[mode].append(round(out["step_s"], 6))
    for mode in steps:
        rec["modes"][mode].update(step_s=statistics.median(times[mode]), round_step_s=round_medians[mode])
    rec["host_op_us_rounds"] = host_us
    if profile_steps and opts.device == "cuda":
        for mode in steps:
            rec["modes"][mode]["profile"] = _profile(steps[mode], profile_steps)
    return rec


def read_races(paths: list[Path]) -> list[dict[str, Any]]:
    """The race records of these files (a line cut short by a killed process is skipped)."""
    out = []
    for path in paths:
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and "modes" in rec:
                out.append(rec)
    return out


def ratios(rec: dict[str, Any]) -> dict[str, float | None]:
    """The hand modes' steps over wrap's (above 1: wrap is faster), where both ran."""
    modes = rec["modes"]
    wrap = modes.get("wrap", {}).get("step_s")
    return {m: (modes[m]["step_s"] / wrap if wrap and modes.get(m, {}).get("step_s") else None)
            for m in ("hand", "hand_compile")}


def paired(rec: dict[str, Any]) -> dict[str, float | None]:
    """The same ratios per round, their geometric mean: each round's modes ran within seconds of each other, so
    a drift of the host between rounds cancels."""
    modes = rec["modes"]
    wrap = modes.get("wrap", {}).get("round_step_s")
    out: dict[str, float | None] = {}
    for m in ("hand", "hand_compile"):
        other = modes.get(m, {}).get("round_step_s")
        out[m] = (statistics.geometric_mean([o / w for o, w in zip(other, wrap)]) if wrap and other else None)
    return out


def report(records: list[dict[str, Any]]) -> str:
    """The ratio table: per family, each mode's interleaved median and wrap's ratio to the hand modes."""
    lines = ["| family | batch | wrap plan | wrap ms | hand ms | compile ms | wrap/hand | wrap/compile | wrap/best |"
             " paired wrap/best | rounds x steps | host us (min-max) |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for rec in records:
        m, r = rec["modes"], ratios(rec)
        ms = {k: (f"{m[k]['step_s'] * 1e3:.1f}" if m.get(k, {}).get("step_s") else m.get(k, {}).get("status", "-"))
              for k in MODES}
        got = [x for x in r.values() if x is not None]
        best = f"{min(got):.3f}" if got else "-"
        pair = [x for x in paired(rec).values() if x is not None]
        best_paired = f"{min(pair):.3f}" if pair else "-"
        host = rec.get("host_op_us_rounds") or [0.0]
        lines.append(f"| {rec['family']} | {rec['batch']} | {m.get('wrap', {}).get('plan_short', '-')} | {ms['wrap']} | "
                     f"{ms['hand']} | {ms['hand_compile']} | "
                     + " | ".join("-" if r[k] is None else f"{r[k]:.3f}" for k in ("hand", "hand_compile"))
                     + f" | {best} | {best_paired} | {rec['rounds']} x {rec['steps']} | {min(host):.1f}-{max(host):.1f} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.zoo_race", description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="clip,torchvision-resnet,convnext,swin")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--size", choices=("realistic", "tiny"), default="realistic")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="after the rounds, profile this many steps of each mode (kernels, GPU busy time, host ops)")
    ap.add_argument("--family-timeout-s", type=float, default=300.0)
    ap.add_argument("--time-budget-s", type=float, default=480.0,
                    help="the call's seconds: no family starts after them, and one running then is cut (give it at "
                         "least --family-timeout-s)")
    ap.add_argument("--out", default=None, help="the JSON-lines file (default: $OUT/zoo_race.jsonl)")
    ap.add_argument("--report", nargs="+", default=None, help="print the ratio table of these files and exit")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.report:
        print(report(read_races([Path(p) for p in args.report])))
        return 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = results_path(args.out, "zoo_race.jsonl")
    given = sys.argv[1:] if argv is None else list(argv)
    opts = Options(device=device, size=args.size, batch=None, warmup=args.warmup, steps=args.steps, lr=args.lr,
                   hand_predictions=False, compile_on_cpu=False, out=out,
                   command=" ".join(["python -m bench.zoo_race", *given]))
    if args.child:
        append(out, race_family(args.child, args.modes.split(","), opts, args.rounds, args.profile_steps))
        return 0
    run_families(args, given)
    if out.exists():
        print(report(read_races([out])), flush=True)
    return 0


def run_families(args: argparse.Namespace, given: list[str]) -> None:
    """Each family in its own process (`--child`, the same arguments), killed at its time limit."""
    start = time.perf_counter()
    for name in args.families.split(","):
        left = args.time_budget_s - (time.perf_counter() - start)
        if left < 30:
            print(f"{name}: not reached (the time budget is spent)", flush=True)
            continue
        proc = subprocess.Popen([sys.executable, "-m", "bench.zoo_race", "--child", name, *given],
                                cwd=Path(__file__).resolve().parents[1], start_new_session=True)
        try:
            proc.wait(timeout=min(args.family_timeout_s, left))
        except subprocess.TimeoutExpired:
            Runner._kill(proc)
            print(f"{name}: killed at its time limit", flush=True)
        print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)

if __name__ == "__main__":
    raise SystemExit(main())
