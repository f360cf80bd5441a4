"""The time model on CPU against what was measured: re-predicts every configuration of the H200 validation runs
(bench/results/validate_h200_2026-11-29.jsonl) and of the tuning grids (tune_h200_2026-11-29.jsonl) from their
recorded plans, and prints predicted vs measured step time; `--zoo` adds the model zoo's plans at realistic size
(bench/zoo.py) with their predicted step over the time their traced FLOPs take at peak (tests/zoo/test_zoo_plan.py's
lower bound, at least 1x; its upper bound is 10x the roofline, bench/zoo_roofline.py); `--zoo-measured` re-predicts
the zoo's own H200 runs (bench/zoo_h200.py), `--wrap-latest` only each family's latest wrap row (issue 10's table).

    python -m bench.step_time_check [--zoo vit,whisper,...] [--zoo-measured bench/results/zoo_h200_DATE.jsonl ...
        [--wrap-latest]] [--no-grid] > bench/results/step_time_check_DATE.txt

Profiles are traced here on fake tensors (Hugging Face GPT-2-355M and the Llama-1B shape, transformers needed),
with the default calibration for the topology. Where the profile does not yet carry its op records (a trace that
does not wire autopar.profile.watch's records into the profile), they are read from one more trace of the same
step, so that this runs before and after that wiring.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import autopar
from autopar.cost import predict_profile
from autopar.planning import calibration_for, profile_variants
from autopar.profile import find_blocks
from autopar.profile.trace import StepTrace
from autopar.topology import lookup_device
from bench._common import PLAN_KEYS, RESULTS, build, plan_from_short, token_batch
from bench.zoo_h200 import ONE_GPU_MODES, mode_plan
from bench.zoo_h200_report import latest_wraps, read_records


def with_op_records(profile: autopar.ModelProfile, model: torch.nn.Module, sample: Any, *, loss_fn: Any = None
                    ) -> autopar.ModelProfile:
    """`profile` with the op records of its step (traced once more where the profile lacks them)."""
    if getattr(profile, "op_groups", ()) or not profile.traced:
        return profile
    units = find_blocks(model, None)[1]
    trace = StepTrace(model, sample, units, loss_fn=loss_fn, precision=profile.profile_precision)
    trace.run()
    return dataclasses.replace(profile, op_groups=trace.watcher.op_groups())


def traced(model: torch.nn.Module, sample: Any, topology: autopar.Topology, *, loss_fn: Any = None
           ) -> tuple[autopar.ModelProfile, dict]:
    profile, variants = profile_variants(model, sample, topology, loss_fn=loss_fn, warn=False)
    profile = with_op_records(profile, model, sample, loss_fn=loss_fn)
    return profile, {k: with_op_records(v, model, sample, loss_fn=loss_fn) for k, v in variants.items()}


def measured_runs(validate: str, grid: str | None) -> list[tuple[str, dict, float, str]]:
    """(model, plan options, measured step s, source) of every measured configuration, later records winning."""
    runs: dict = {}
    for line in open(validate):
        rec = json.loads(line)
        if rec.get("status") == "ok" and "step_s" in rec:
            kw = {k: rec[k] for k in PLAN_KEYS if k in rec}
            runs[(rec["model"], json.dumps(kw, sort_keys=True))] = (rec["step_s"], "validate")
    if grid:
        for line in open(grid):
            rec = json.loads(line)
            if rec.get("what") == "grid" and not rec.get("summary") and rec.get("status") == "ok":
                kw = plan_from_short(rec["plan"])
                kw = {k: v for k, v in kw.items() if not (k == "precision" and v == "bf16")}
                runs.setdefault((rec["model"], json.dumps(kw, sort_keys=True)), (rec["measured_step_s"], "grid"))
    return [(m, json.loads(k), s, src) for (m, k), (s, src) in runs.items()]


def predicted_runs(validate: str, grid: str | None) -> list[tuple[str, dict, float, str, Any]]:
    """(model, plan options, measured step s, source, the cost model's prediction now) of every measured
    configuration of `measured_runs`, each model traced once on the meta device for one H200."""
    topo = autopar.Topology.from_spec("1xH200")
    cal = calibration_for(topo)
    profiles: dict = {}
    out = []
    for name, kw, measured, source in measured_runs(validate, grid):
        if name not in profiles:
            with torch.device("meta"):
                model = build(name)
            profiles[name] = traced(model, token_batch(name, 1), topo)
        profile, variants = profiles[name]
        pred = predict_profile(profile, autopar.Plan(**{"precision": "bf16", **kw}), topo, cal, variants=variants)
        out.append((name, kw, measured, source, pred))
    return out


def check_measured(args: argparse.Namespace) -> list[str]:
    out = [f"{'model':10} {'source':8} {'plan':44} {'measured ms':>11} {'pred ms':>8} {'err':>7} | "
           f"{'compute':>7} {'memory':>7} {'launch':>7} {'recomp':>7}"]
    errs: dict = {"validate": [], "grid": []}
    for name, kw, measured, source, pred in predicted_runs(args.validate, None if args.no_grid else args.grid):
        err = pred.step_s / measured - 1
        errs[source].append(err)
        t = pred.time
        desc = " ".join(f"{k}={v}" for k, v in sorted(kw.items()))
        out.append(f"{name:10} {source:8} {desc:44} {measured * 1e3:11.1f} {pred.step_s * 1e3:8.1f} {err:+7.1%} | "
                   f"{t.compute_s * 1e3:7.1f} {t.memory_s * 1e3:7.1f} {t.launch_s * 1e3:7.1f} "
                   f"{t.recompute_s * 1e3:7.1f}")
    for source, v in errs.items():
        if v:
            out.append(f"  {source:8} step error {min(v):+.1%} to {max(v):+.1%}, median |error| "
                       f"{statistics.median(abs(x) for x in v):.1%}, over {len(v)} configurations")
    return out


def check_zoo(names: list[str]) -> list[str]:
    from bench.zoo import build_model, family, make_sample  # the zoo needs transformers (and timm/torchvision)
    from tests.zoo.test_zoo_plan import TOPOLOGIES, peak_time_ratio

    out = [f"{'family':12} {'topology':11} {'plan':40} {'pred ms':>8} {'x FLOPs at peak':>15} | "
           f"{'compute':>7} {'memory':>7} {'launch':>7}"]
    for name in names:
        f = family(name)
        why = f.unavailable()
        if why is not None:
            out.append(f"{name:12} skipped: {why}")
            continue
        model, sample = build_model(f, "realistic"), make_sample(f, "realistic")
        t0 = time.perf_counter()
        try:
            profile, variants = traced(model, sample, autopar.Topology.from_spec(TOPOLOGIES[0]), loss_fn=f.loss_fn)
        except Exception as exc:  # a family the trace cannot run: said, and the others still run
            out.append(f"{name:12} not traced: {type(exc).__name__}: {str(exc).splitlines()[0][:150]}")
            continue
        for spec in TOPOLOGIES:  # both have bf16: the same traces
            topo = autopar.Topology.from_spec(spec)
            ranked = autopar.candidates(profile, topology=topo, variants=variants, loop="plain",
                                        global_batch_size=f.realistic_batch * topo.world_size)
            best = next(c for c in ranked if c.feasible)
            pred = best.prediction
            ratio = peak_time_ratio(pred.step_s, profile, best.plan, topo)
            p = best.plan
            desc = (f"mb{p.micro_batch_size} {p.precision} ac:{p.checkpointing} compile={p.compile} "
                    f"fsdp{p.dp_shard} tp{p.tp} pp{p.pp}")
            out.append(f"{name:12} {spec:11} {desc:40} {pred.step_s * 1e3:8.1f} {ratio:15.2f} | "
                       f"{pred.time.compute_s * 1e3:7.1f} {pred.time.memory_s * 1e3:7.1f} "
                       f"{pred.time.launch_s * 1e3:7.1f}   ({time.perf_counter() - t0:.0f} s)")
            print(out[-1], file=sys.stderr, flush=True)
    return out


def _measured_plan(rec: dict[str, Any]) -> autopar.Plan | None:
    """The one-GPU plan a zoo record ran: the hand recipe's and the plan modes' (zoo_h200.mode_plan) or
    the plan wrap chose (its record's `plan`); None for a record that did not run."""
    if rec.get("status") != "ok":
        return None
    if rec.get("mode") == "wrap" and isinstance(rec.get("plan"), dict):
        return autopar.Plan(**rec["plan"])
    if rec.get("mode") not in ONE_GPU_MODES:
        return None
    return mode_plan(rec["mode"], rec["batch"])


def zoo_records(paths: list[str], *, wrap_latest: bool) -> list[dict[str, Any]]:
    """The records of bench/zoo_h200.py files in order; with `wrap_latest`, only each family's wrap record that
    its report keeps (the latest measured one: bench/zoo_h200_report.results)."""
    records = read_records([Path(p) for p in paths])
    return latest_wraps(records) if wrap_latest else records


def same_run(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two zoo records ran the same step: family, mode, batch, plan (wrap's whole Plan), GPU, torch and
    transformers."""
    keys = ("family", "mode", "batch", "plan", "plan_short", "device", "torch", "transformers")
    return all(a.get(k) == b.get(k) for k in keys)


def record_topology(rec: dict[str, Any]) -> autopar.Topology:
    """One GPU of the kind the record ran on (its `device`, as torch names it: "NVIDIA H100 80GB HBM3"); the H200
    for a record that does not name one autopar's table knows."""
    spec = lookup_device(str(rec.get("device", "")))
    return autopar.Topology.from_spec(f"1x{spec.name}" if spec is not None else "1xH200")


def lease_steps(rec: dict[str, Any], records: list[dict[str, Any]]) -> list[float]:
    """The measured step seconds of every record of `records` that ran `rec`'s step (same_run), one a process
    and lease: host-bound steps differ up to 1.7x between leases of one H200 kind (bench/README.md)."""
    return [r["step_s"] for r in records if r.get("status") == "ok" and r.get("step_s") and same_run(r, rec)]


def check_zoo_measured(paths: list[str], *, wrap_latest: bool = False) -> list[str]:
    """The zoo's H200 runs (bench/zoo_h200.py records: the hand recipe and the plan modes, one GPU, bf16
    autocast, eager or compiled, and the plans wrap chose) re-predicted with the model as it is now. With
    `wrap_latest`, each row also gives the median of every lease's run of the same step (lease_steps) and the
    error against it."""
    from bench.zoo import build_model, family, make_sample  # the zoo needs transformers

    out = [f"{'family':12} {'mode':13} {'batch':>5} {'measured ms':>11} {'then ms':>8} {'now ms':>8} {'err':>7} | "
           f"{'compute':>7} {'memory':>7} {'launch':>7}"
           + (f" | {'leases':>6} {'min ms':>7} {'max ms':>7} {'median':>7} {'err':>7}" if wrap_latest else "")]
    traces: dict = {}
    errs, lease_errs = [], []
    everything = read_records([Path(p) for p in paths])
    for rec in zoo_records(paths, wrap_latest=wrap_latest):
        plan = _measured_plan(rec)
        if plan is None:
            continue
        name = rec["family"]
        f = family(name)
        why = f.unavailable()
        if why is not None:
            out.append(f"{name:12} {rec['mode']:13} skipped: {why}")
            continue
        topo = record_topology(rec)
        key = (name, rec["batch"], topo.device.name)
        if key not in traces:
            model, sample = build_model(f, "realistic"), make_sample(f, "realistic", rec["batch"])
            try:
                traces[key] = traced(model, sample, topo, loss_fn=f.loss_fn)
            except autopar.ProfileError as exc:  # TraceError included: the model cannot be predicted
                traces[key] = exc
        if isinstance(traces[key], Exception):
            out.append(f"{name:12} {rec['mode']:13} not traced: {type(traces[key]).__name__}: "
                       f"{str(traces[key]).splitlines()[0][:100]}")
            continue
        profile, variants = traces[key]
        pred = predict_profile(profile, plan, topo, calibration_for(topo), variants=variants)
        err = pred.step_s / rec["step_s"] - 1
        errs.append(err)
        then = rec.get("predicted_step_s")
        t = pred.time
        line = (f"{name:12} {rec['mode']:13} {rec['batch']:5} {rec['step_s'] * 1e3:11.1f} "
                f"{then * 1e3 if then else float('nan'):8.1f} {pred.step_s * 1e3:8.1f} {err:+7.1%} | "
                f"{t.compute_s * 1e3:7.1f} {t.memory_s * 1e3:7.1f} {t.launch_s * 1e3:7.1f}")
        if wrap_latest:
            steps = lease_steps(rec, everything)
            mid = statistics.median(steps)
            lease_errs.append(pred.step_s / mid - 1)
            line += (f" | {len(steps):6} {min(steps) * 1e3:7.1f} {max(steps) * 1e3:7.1f} {mid * 1e3:7.1f} "
                     f"{lease_errs[-1]:+7.1%}")
        out.append(line)
        print(out[-1], file=sys.stderr, flush=True)
    for what, e in (("latest lease", errs), ("median of the leases", lease_errs)):
        if e:
            out.append(f"  step error against the {what}: {min(e):+.1%} to {max(e):+.1%}, median |error| "
                       f"{statistics.median(abs(x) for x in e):.1%}, worst {max(e, key=abs):+.1%}, over {len(e)} runs")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--validate", default=str(RESULTS / "validate_h200_2026-11-29.jsonl"))
    ap.add_argument("--grid", default=str(RESULTS / "tune_h200_2026-11-29.jsonl"))
    ap.add_argument("--no-grid", action="store_true", help="the validation configurations only")
    ap.add_argument("--no-measured", action="store_true", help="the zoo only")
    ap.add_argument("--zoo", default="", help="comma-separated zoo families (bench/zoo.py), e.g. vit,whisper")
    ap.add_argument("--zoo-measured", default=None, nargs="+", metavar="JSONL",
                    help="bench/zoo_h200.py records to re-predict (e.g. bench/results/zoo_h200_2026-12-01.jsonl)")
    ap.add_argument("--wrap-latest", action="store_true",
                    help="with --zoo-measured: only each family's wrap record its report keeps (issue 10's table)")
    args = ap.parse_args()
    lines = [f"# step time: the cost model as of {datetime.date.today()} (torch {torch.__version__}, default "
             "calibration) against the H200 measurements of 2026-11-29 (torch 2.11)",
             f"# python -m bench.step_time_check {' '.join(sys.argv[1:])}".rstrip()]
    if not args.no_measured:
        lines += check_measured(args)
    if args.zoo_measured:
        lines += ["", f"## zoo runs, each re-predicted on the GPU it ran on ({' '.join(args.zoo_measured)}) "
                  "('then': as recorded)" + (", each family's latest wrap record" if args.wrap_latest else "")]
        lines += check_zoo_measured(args.zoo_measured, wrap_latest=args.wrap_latest)
    if args.zoo:
        lines += ["", "## zoo (realistic size, the search's first feasible plan)"]
        lines += check_zoo([n for n in args.zoo.split(",") if n])
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
