"""The `autopar` command: `autopar demo | topology | plan | tune | report`.

Each command is a function of its arguments that returns the exit status; `main` prints an AutoparError
as one line (`autopar COMMAND: message`) and returns 2. `autopar plan` runs as short steps: check the
arguments, profile the model (autopar.named_models), choose the global batch, rank the plans
(autopar.planning.candidates, with the exact check for --verify), write the best, print a table or JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch.nn as nn
import yaml

from ._util.args import ArgumentParser, unknown_command, version
from ._util.progress import phase
from .demo import main as demo_main
from .errors import AutoparError, InfeasiblePlanError, ModelSpecError, PlanError, ResultNotSavedError
from .named_models import (DEEPER_DEPTH, SHALLOW_DEPTH, ModelSource, TracedVariants, known_specs, model_profiles,
                           model_sample_batch, resolve_model)
from .plan_cache import CacheEntry, cache_key, entry_source, lookup_entry, write_plan_out
from .planning import (GiB, candidates, describe_candidates, dropped_reasons, resolve_topology, short_name,
                       verify_candidates)
from .plans import Loop, Plan
from .profile import ModelProfile
from .search import Candidate, DropKind, data_parallel_degrees
from .topology import Topology
from .tune.progress_line import ProgressLine as _ProgressLine
from .tune.report import charts_hint, load_report, write_plots
from .tune.study import PRUNE_FACTOR, tune


def _topology(argv: list[str]) -> int:
    p = ArgumentParser(prog="autopar topology",
                                description="Print the hardware autopar plans for: detected, or a spec.")
    p.add_argument("--cluster", default=None,
                   help="a spec like 4x8xH100-SXM, or a topology YAML file (this command's --yaml output), instead of "
                        "detecting")
    p.add_argument("--yaml", action="store_true", help="print as YAML")
    args = p.parse_args(argv)
    topo = resolve_topology(args.cluster)
    if args.yaml:
        print(yaml.safe_dump(topo.to_dict(), sort_keys=False), end="")
    else:
        print(topo.describe())
    return 0


PLAN_DEFAULT_OUT = "autopar-plan.yaml"
#: The share of a GPU's memory a plan may fill (autopar.search's default).
HEADROOM = 0.95


def _plan_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="autopar plan",
        description="Rank every parallelism plan for a model on some hardware by the cost model, print the "
                    "table and write the best plan as YAML (for autopar.wrap(model, sample=..., plan=FILE)).",
        epilog=f"MODEL: a built-in spec ({', '.join(known_specs())}), the path of a Hugging Face config.json "
               "(or its folder; needs transformers), or module:factory (factory() returns an nn.Module or "
               "(model, sample); it is called under torch.device('meta')).")
    p.add_argument("model", metavar="MODEL", help="spec name, config.json path, or module:factory")
    p.add_argument("--seq", type=int, default=None, metavar="N",
                   help="tokens per sample (default: the spec's context; a config's, at most 4096; a factory's sample)")
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--global-batch", type=int, default=None, metavar="N",
                       help="samples per optimizer step over all GPUs (default: the sample's batch per GPU: "
                            "1 for specs and configs)")
    batch.add_argument("--tokens-per-step", type=int, default=None, metavar="N",
                       help="tokens per optimizer step over all GPUs (a multiple of --seq)")
    p.add_argument("--cluster", default=None, metavar="SPEC",
                   help="hardware as a spec like 4x8xH100-SXM, or a topology YAML file (autopar topology --yaml, e.g. "
                        "with host_memory_bytes changed; default: the hardware detected here)")
    p.add_argument("--loop", choices=[m.value for m in Loop], default=None,
                   help="what drives the step, so which plans are ranked: plain (pure data parallelism, as wrap "
                        "chooses by default), accumulates (a framework that accumulates, such as the Hugging Face "
                        "Trainer: no pipeline), train_step (autopar.train_step: every plan; the default)")
    p.add_argument("--plain-loop", action="store_true", help="the same as --loop plain (its older spelling)")
    p.add_argument("--top", type=int, default=10, metavar="K", help="rows of the table (default 10)")
    p.add_argument("--out", default=PLAN_DEFAULT_OUT, metavar="FILE",
                   help=f"where to write the chosen plan (default {PLAN_DEFAULT_OUT}; '-' prints it instead)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--verify", type=int, default=0, metavar="N",
                   help="check the N best plans with the exact memory check (traces the full model on fake "
                        "tensors: seconds to minutes each, no memory) and drop those it finds too big")
    return p


@dataclass(frozen=True)
class _PlanRun:
    """What `autopar plan` found: the model, the hardware, the ranking and the plan chosen (and written)."""

    source: ModelSource
    topology: Topology
    profile: ModelProfile
    variants: TracedVariants
    global_batch: int
    ranked: list[Candidate]
    best: Plan
    out: str | None  # the file written, None with --out -
    timings: dict[str, float]  # profile_s, search_s, total_s

    @property
    def seq(self) -> int | None:
        return self.profile.tokens_per_sample

    @property
    def feasible(self) -> list[Candidate]:
        return [c for c in self.ranked if c.feasible]


def _plan(argv: list[str]) -> int:
    args = _plan_args(argv)
    run = _run_plan(args)
    if args.json:
        print(json.dumps(_plan_json(args, run), indent=2))
    else:
        _print_plan(args, run)
    return 0


def _plan_args(argv: list[str]) -> argparse.Namespace:
    """The arguments of `autopar plan`, checked."""
    args = _plan_parser().parse_args(argv)
    if args.top < 1:
        raise PlanError(f"--top must be at least 1, got {args.top}.")
    if args.verify < 0:
        raise PlanError(f"--verify must be a non-negative number of plans, got {args.verify}.")
    for name in ("seq", "global_batch", "tokens_per_step"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise PlanError(f"--{name.replace('_', '-')} must be a positive integer, got {value}.")
    args.loop = _loop_option(args) or Loop.TRAIN_STEP
    args.plain_loop = args.loop is Loop.PLAIN
    return args


def _loop_option(args: argparse.Namespace) -> Loop | None:
    """--loop, or --plain-loop (its older spelling); None when neither is given. Both, disagreeing: refused."""
    loop = None if args.loop is None else Loop(args.loop)
    if args.plain_loop:
        if loop not in (None, Loop.PLAIN):
            raise AutoparError(f"--plain-loop is --loop plain; it contradicts --loop {loop.value}: give one.")
        return Loop.PLAIN
    return loop


def _run_plan(args: argparse.Namespace) -> _PlanRun:
    """Profile the model, rank the plans (autopar.planning.candidates), write the best one."""
    started = time.perf_counter()
    topo = resolve_topology(args.cluster)
    source = resolve_model(args.model)
    with phase(f"tracing {source.name} on fake tensors (its profile)"):  # a line past 2 s, again every 10 s
        profile, variants = model_profiles(source, topo, seq_len=args.seq)
    profiled = time.perf_counter()
    global_batch = _global_batch(args, source, profile.tokens_per_sample, topo.world_size)
    _check_batch_splits(global_batch, profile, topo, loop=args.loop)
    ranked = _rank(args, source, profile, variants, topo, global_batch)
    searched = time.perf_counter()
    feasible = [c for c in ranked if c.feasible]
    if not feasible:
        raise InfeasiblePlanError(_infeasible_message(source.name, topo, ranked, global_batch,
                                                      profile.tokens_per_sample, args.plain_loop))
    best = feasible[0].plan
    if source.extrapolated:  # no model was traced at full depth: the plan fits any model of this shape
        best = best.replace(model_fingerprint=None)
    # never over a file that is not a plan (a typo must not turn train.py into YAML), nor into a folder
    out = None if args.out == "-" else str(write_plan_out(best, args.out, option="--out"))
    # bf16 variants are traced while searching, when a plan first needs them: count them as profiling
    traced_s = profiled - started + variants.seconds
    timings = {"profile_s": traced_s, "search_s": searched - started - traced_s, "total_s": searched - started}
    return _PlanRun(source=source, topology=topo, profile=profile, variants=variants, global_batch=global_batch,
                    ranked=ranked, best=best, out=out, timings=timings)


def _global_batch(args: argparse.Namespace, source: ModelSource, seq: int | None, world: int) -> int:
    """Samples per optimizer step: --tokens-per-step / seq, --global-batch, or the sample's batch per GPU."""
    if args.tokens_per_step is not None:
        if seq is None:
            raise ModelSpecError(f"{source.name}'s input has no sequence: give --global-batch (samples) instead of "
                                 "--tokens-per-step.")
        if args.tokens_per_step % seq:
            raise PlanError(f"--tokens-per-step {args.tokens_per_step} is not a whole number of {seq}-token samples: "
                            f"use a multiple of {seq} (e.g. {max(seq, args.tokens_per_step // seq * seq)}).")
        return args.tokens_per_step // seq
    if args.global_batch is not None:
        return args.global_batch
    return model_sample_batch(source) * world


def _check_batch_splits(global_batch: int, profile: ModelProfile, topo: Topology, *, loop: Loop) -> None:
    """Refuse a global batch that no data-parallel degree of a plan on this world divides."""
    world = topo.world_size
    degrees = data_parallel_degrees(profile, topo, world_size=world, loop=loop)
    if any(global_batch % d == 0 for d in degrees):
        return
    hint = " (or drop --loop plain: pipelines and tensor parallelism leave fewer data-parallel ranks)" if loop is Loop.PLAIN else ""
    raise PlanError(
        f"a global batch of {global_batch} samples splits over none of the data-parallel degrees a plan on "
        f"{world} GPUs can have ({', '.join(map(str, degrees))}): use a global batch divisible by one of them, "
        f"e.g. {_round_up(global_batch, degrees[0])}{hint}.")


def _rank(args: argparse.Namespace, source: ModelSource, profile: ModelProfile, variants: TracedVariants,
          topo: Topology, global_batch: int) -> list[Candidate]:
    """Every plan, ranked by autopar.candidates, the --verify best checked by the exact memory check; each step
    that runs past 2 s says so on stderr (autopar._util.progress.phase), and again every 10 s."""
    with phase(f"ranking the plans for {topo.world_size} {'GPUs' if topo.is_gpu else 'processes'} (cost model)"):
        ranked = candidates(profile, topology=topo, world_size=topo.world_size, global_batch_size=global_batch,
                            loss_fn=source.loss_fn, variants=variants, loop=args.loop, headroom=HEADROOM)
    if not args.verify:
        return ranked
    model_fn, sample = _exact_check_inputs(source, profile.tokens_per_sample)
    with phase(f"checking the {args.verify} best plan(s) with the exact memory check (a full-model trace each)") as p:
        return verify_candidates(ranked, model_fn, sample, top=args.verify, topology=topo, loss_fn=source.loss_fn,
                                 headroom=HEADROOM, progress=p.count)


def _exact_check_inputs(source: ModelSource, seq: int | None) -> tuple[Callable[[], nn.Module] | nn.Module, Any]:
    """The full-depth model (a builder on meta, or the factory's model) and a sample for the exact check."""
    if source.build is not None:
        assert source.make_sample is not None and seq is not None
        return functools.partial(source.build, None, seq), source.make_sample(seq)
    assert source.model is not None
    if source.sample is not None:
        return source.model, source.sample
    assert source.make_sample is not None and seq is not None
    return source.model, source.make_sample(seq)


def _plan_json(args: argparse.Namespace, run: _PlanRun) -> dict[str, Any]:
    """`autopar plan --json`: the model, the hardware, the ranking, the dropped reasons and the choice."""
    topo, seq, feasible = run.topology, run.seq, run.feasible
    return {
        "model": _model_summary(run.source, run.profile, run.variants),
        "topology": {"spec": args.cluster, "fingerprint": topo.fingerprint(), "world_size": topo.world_size,
                     "device": topo.device.name, "memory_bytes_per_gpu": topo.device.memory_bytes},
        "global_batch_size": run.global_batch, "seq_len": seq,
        "tokens_per_step": run.global_batch * seq if seq else None, "loop": args.loop.value,
        "allow_train_step": args.loop is Loop.TRAIN_STEP,  # the field before --loop, for older readers
        "candidates": len(run.ranked), "feasible": len(feasible),
        "ranked": [{"rank": i, "plan": c.plan.strategy(), "prediction": dict(c.plan.prediction or {})}
                   for i, c in enumerate(feasible[:args.top], 1)],
        "dropped": [{"count": n, "reason": why} for n, why in dropped_reasons(run.ranked)],
        "chosen": run.best.to_dict(), "out": run.out, "timings": run.timings,
        "cached": None if (entry := _cached_entry(args, run)) is None else {
            "path": str(entry.path), "source": entry_source(entry), "stored_at": entry.stored_at,
            "plan": entry.plan.strategy()},
    }


def _print_plan(args: argparse.Namespace, run: _PlanRun) -> None:
    """`autopar plan`'s report: the hardware, the model, the search, the table, the exact checks, the choice."""
    print(run.topology.describe())
    _print_model(run)
    _print_search(args, run)
    print()
    print(describe_candidates(run.ranked, limit=args.top))
    _print_exact_checks(run.ranked)
    print()
    print("chosen (rank 1):")
    print(run.best.describe())
    entry = _cached_entry(args, run)
    if entry is not None:  # what wrap would use for this job instead of planning: said with its source
        print(f"cached for this model and job: {short_name(entry.plan)}, from {entry_source(entry)} "
              f"({entry.stored_at[:10] if entry.stored_at else 'undated'}): {entry.path}")
    if run.out is None:
        print()
        print(run.best.to_yaml(), end="")
    else:
        print(f"wrote {run.out}; apply it with autopar.wrap(model, sample=batch, plan={run.out!r})"
              + (" and autopar.train_step" if run.best.needs_train_step else ""))


def _cached_entry(args: argparse.Namespace, run: _PlanRun) -> CacheEntry | None:
    """The plan cache's entry for this model, hardware, batch and loop (None without one, or for a model that
    was not traced at full depth, whose fingerprint is no real model's)."""
    if run.source.extrapolated or not run.profile.fingerprint:
        return None
    try:
        key = cache_key(run.profile, run.topology, global_batch_size=run.global_batch, loop=args.loop)
        return lookup_entry(key)
    except AutoparError:
        return None


def _print_model(run: _PlanRun) -> None:
    m = _model_summary(run.source, run.profile, run.variants)
    topo, seq, batch = run.topology, run.seq, run.global_batch
    print(f"model {run.source.name}: {m['description']}")
    print(f"  parameters    {_count(m['params'])}, {m['blocks']} x {m['block_class']}; {m['shape']}")
    tokens = f" x {seq} tokens = {batch * seq:,} tokens" if seq else ""
    print(f"  batch         {batch} samples{tokens} per step, over {topo.world_size} "
          f"{'GPUs' if topo.is_gpu else 'processes'}")
    print(f"  profile       {m['profile']}")


def _print_search(args: argparse.Namespace, run: _PlanRun) -> None:
    budget = HEADROOM * run.topology.device.memory_bytes / GiB
    plain = f"; loop {args.loop.value} (--loop)" if args.loop is not Loop.TRAIN_STEP else ""
    t = run.timings
    print(f"search: {len(run.ranked)} plans considered, {len(run.feasible)} fit in {budget:.1f} GiB per GPU and are "
          f"not dominated{plain} ({t['total_s']:.1f} s: profile {t['profile_s']:.1f} s, "
          f"search {t['search_s']:.1f} s)")


def _print_exact_checks(ranked: list[Candidate]) -> None:
    """The candidates the exact memory check traced (--verify): traced vs predicted peak."""
    verified = [c for c in ranked if c.exact is not None]
    if not verified:
        return
    print()
    print("exact memory check (allocated peak traced on fake tensors vs the analytic prediction):")
    for c in verified:
        assert c.exact is not None and c.prediction is not None
        eager = " (eager step: an upper bound for this compiled plan)" if c.plan.compile else ""
        print(f"  {'fits ' if c.feasible else 'DROPS'} {_size(c.exact.peak_bytes)} traced{eager}, "
              f"{_size(c.prediction.memory.allocated_bytes)} predicted, in {c.exact.trace_s:.0f} s: "
              f"{short_name(c.plan)}")


def _size(n: float) -> str:
    return f"{n / 2**30:7.2f} GiB" if n >= 2**29 else f"{n / 2**20:7.1f} MiB"


def _count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _model_summary(source: ModelSource, profile: ModelProfile, variants: TracedVariants) -> dict[str, Any]:
    """The model as `autopar plan` reports it (the JSON's "model", the text's model lines)."""
    shape = ", ".join(f"{k} {v}" for k, v in (("hidden", profile.hidden_dim), ("heads", profile.num_heads),
                                              ("kv heads", profile.num_kv_heads), ("ffn", profile.ffn_dim),
                                              ("vocab", profile.vocab_size)) if v is not None)
    traced = ["fp32"] + list(variants.traced)
    how = (f"traced at depths {SHALLOW_DEPTH} and {DEEPER_DEPTH} ({', '.join(traced)}) and extended to "
           f"{profile.num_blocks} blocks"
           if source.extrapolated and any("extrapolated" in n for n in profile.notes)
           else f"traced at full depth ({', '.join(traced)})")
    return {"name": source.name, "kind": source.kind, "description": source.description or source.model_class,
            "model_class": profile.model_class, "params": profile.num_params,
            "params_billions": profile.num_params / 1e9, "blocks": profile.num_blocks,
            "block_class": profile.block_class or "block", "shape": shape, "hidden_dim": profile.hidden_dim,
            "num_heads": profile.num_heads, "num_kv_heads": profile.num_kv_heads, "ffn_dim": profile.ffn_dim,
            "vocab_size": profile.vocab_size, "seq_len": profile.tokens_per_sample, "profile": how,
            "fingerprint": None if source.extrapolated else profile.fingerprint}


def _infeasible_message(name: str, topo: Topology, ranked: list[Candidate], global_batch: int, seq: int | None,
                        plain_loop: bool) -> str:
    """Why no plan fits, with the smallest need and what would help."""
    budget = HEADROOM * topo.device.memory_bytes / GiB
    host = [c for c in ranked if c.drop is not None and c.drop.kind is DropKind.HOST_MEMORY]
    predicted = [c for c in ranked if (c.plan.prediction or {}).get("memory_bytes") is not None and c not in host]
    unit = "GPU" if topo.is_gpu else "process"
    lines = [f"no plan for {name} fits {topo.world_size} x {topo.device.name} ({budget:.1f} GiB usable per {unit})."]
    if host:
        lines[0] += " " + _host_memory_sentence(topo, host)
    if predicted:
        least = min(predicted, key=lambda c: c.plan.prediction["memory_bytes"])
        need = least.plan.prediction["memory_bytes"] / GiB
        lead = "Of the rest, the" if host else "The"
        lines[0] += f" {lead} smallest, {short_name(least.plan)}, needs {need:.1f} GiB per {unit}."
    elif ranked and not host:
        lines[0] += f" No plan could run: {ranked[0].reason}."
    helps = [f"more {'GPUs' if topo.is_gpu else 'processes'} (--cluster with more nodes)"]
    if host:
        helps.append("nodes with more host memory (a topology file --cluster FILE.yaml with host_memory_bytes)")
    if plain_loop:
        helps.insert(0, "dropping --loop plain (gradient accumulation, pipelines and tensor parallelism hold fewer activations)")
    if global_batch > 1:
        helps.append(f"a smaller global batch (--global-batch, now {global_batch})")
    if seq:
        helps.append(f"a shorter sequence (--seq, now {seq})")
    lines.append("What would help: " + "; ".join(helps) + ".")
    return " ".join(lines)


def _host_memory_sentence(topo: Topology, host: list[Candidate]) -> str:
    """Why the CPU-offload plans, which fit the GPUs, were dropped: the smallest one's host memory per node."""
    least = min(host, key=lambda c: c.drop.needed_bytes)
    assert least.drop is not None and least.drop.needed_bytes is not None and topo.host_memory_bytes is not None
    return (f"CPU offload fits the GPUs, but the smallest offload plan, {short_name(least.plan)}, needs "
            f"{least.drop.needed_bytes / GiB:,.0f} GiB of host memory per node, and a node has "
            f"{topo.host_memory_bytes / GiB:,.0f} GiB ({least.drop.limit_bytes / GiB:,.0f} GiB usable).")


# ---------------------------------------------------------------------------------------------------
# autopar tune and autopar report (docs/tuning.md)
# ---------------------------------------------------------------------------------------------------
TUNE_DEFAULT_STUDY = "autopar-study.db"
TUNE_DEFAULT_TRIALS = 20


def _tune_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="autopar tune",
        usage="autopar tune [options] -- LAUNCH COMMAND...",
        description="Measure the cost model's best plans in your own job, one short run per plan, in an Optuna "
                    "study kept in a SQLite file (run the same command again to resume it). The fastest plan is "
                    "cached, so autopar.wrap in the same job uses it; the table of every trial ends the output.",
        epilog="Everything after -- is your launch command, run once per trial with the plan to measure, e.g. "
               "autopar tune --trials 12 -- torchrun --nproc-per-node 8 train.py. Its script must call autopar.wrap "
               "(the plan is applied there, and the run ends by itself after the timed steps). docs/tuning.md.")
    p.add_argument("--study", default=TUNE_DEFAULT_STUDY, metavar="PATH",
                   help=f"the study's SQLite file, created or resumed (default {TUNE_DEFAULT_STUDY})")
    p.add_argument("--trials", type=int, default=TUNE_DEFAULT_TRIALS, metavar="N",
                   help=f"plans to measure in the study, earlier runs of it included (default {TUNE_DEFAULT_TRIALS}); "
                        "0: no limit but the time budget and the space")
    p.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="start no trial after S seconds (the one running finishes)")
    p.add_argument("--steps", type=int, default=10, metavar="N", help="timed optimizer steps per trial (default 10)")
    p.add_argument("--warmup", type=int, default=3, metavar="N",
                   help="untimed optimizer steps before them: compilation, the allocator (default 3)")
    p.add_argument("--trial-timeout", type=float, default=600.0, metavar="S",
                   help="a trial running longer is ended and recorded as timed out (default 600)")
    p.add_argument("--plan-out", default=None, metavar="FILE", help="also write the best plan to FILE (YAML)")
    p.add_argument("--loop", choices=[m.value for m in Loop], default=None,
                   help="what drives the script's step, so which plans are tried: plain (pure data parallelism), "
                        "accumulates (a framework that accumulates, such as the Hugging Face Trainer: no pipeline), "
                        "train_step (every plan); default: follow the script's wrap(loop=...)")
    p.add_argument("--plain-loop", action="store_true", help="the same as --loop plain (its older spelling)")
    p.add_argument("--compiled-only", action="store_true",
                   help="measure only compiled plans where torch.compile is available (default: eager ones too; "
                        "the cost model ranks compiled plans first, but compilation can fail or lose on a model)")
    p.add_argument("--max-autotune", action="store_true",
                   help="also measure each compiled plan compiled with inductor's max-autotune (kernels chosen by "
                        "timing: minutes more compile a trial; give --trial-timeout room)")
    p.add_argument("--top-k", type=int, default=5, metavar="K",
                   help="run the K best predicted plans first, in predicted order (default 5)")
    p.add_argument("--prune-factor", type=float, default=PRUNE_FACTOR, metavar="F",
                   help=f"skip a plan predicted (corrected by the trials measured so far) to take more than F times "
                        f"the best measured step (default {PRUNE_FACTOR}); 0: skip none, measure up to --trials")
    return p


def _tune(argv: list[str]) -> int:
    if "--" in argv:
        cut = argv.index("--")
        own, command = argv[:cut], argv[cut + 1:]
    else:
        own, command = argv, []
    parser = _tune_parser()
    args = parser.parse_args(own)
    if not command:
        parser.error("give your launch command after --, e.g. autopar tune -- torchrun --nproc-per-node 8 train.py")
    for name in ("trials", "steps", "warmup", "top_k"):
        low = 1 if name == "steps" else 0
        if getattr(args, name) < low:
            raise AutoparError(f"--{name.replace('_', '-')} must be at least {low}, got {getattr(args, name)}.")
    if args.prune_factor != 0 and not args.prune_factor >= 1:  # below 1 it would skip the best plan's own twin
        raise AutoparError(f"--prune-factor must be 0 (skip none) or at least 1, got {args.prune_factor}.")
    for name in ("time_budget", "trial_timeout"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise AutoparError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {value}.")
    import optuna  # on use: a second to import, and only `autopar tune` needs it

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the progress line says it instead
    bar = _ProgressLine(sys.stderr)
    try:
        report = tune(command, study_path=args.study, trials=args.trials or None, time_budget_s=args.time_budget,
                      steps=args.steps, warmup=args.warmup, trial_timeout_s=args.trial_timeout,
                      loop=_loop_option(args), top_k_enqueue=args.top_k, plan_out=args.plan_out,
                      progress=bar, eager=not args.compiled_only, max_autotune=args.max_autotune,
                      prune_factor=args.prune_factor or math.inf)
    except ResultNotSavedError as exc:  # measured, not saved: the table first, then main's one line (exit 2)
        bar.close()
        print(exc.report.table())
        raise
    except KeyboardInterrupt as exc:  # SIGINT or SIGTERM (autopar.tune.interrupt.TuneInterrupted): 128 + its number
        bar.close()
        signum = int(getattr(exc, "signum", signal.SIGINT))
        print(f"autopar tune: interrupted ({signal.Signals(signum).name}). The study is kept in {args.study}: run the "
              "same command again to go on (the trial that was running is tried again).", file=sys.stderr)
        return 128 + signum
    finally:
        bar.close()
    print(report.table())
    return 0 if report.best is not None else 1


def _report(argv: list[str]) -> int:
    p = ArgumentParser(
        prog="autopar report",
        description="Print the table of a tuning study (autopar tune --study FILE) from its file alone, and draw "
                    "two charts as PNG: measured vs predicted throughput per trial, and the optimisation history.")
    p.add_argument("study", metavar="STUDY", help="the study's SQLite file")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where to write the charts (default: the study file's folder)")
    args = p.parse_args(argv)
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        p.error(f"--out {args.out} is a file; --out takes the folder to write the charts into (made if missing).")
    report = load_report(args.study)
    print(report.table())
    hint = charts_hint()  # no matplotlib: the tables alone, and how to get the charts
    if hint is not None:
        print(f"\n{hint}")
        return 0
    study = Path(args.study)
    paths = write_plots(report, args.out if args.out is not None else study.parent, prefix=study.stem)
    print()
    for path in paths:
        print(f"wrote {path}")
    return 0


USAGE = ("usage: autopar {demo,topology,plan,tune,report} [options]\n\n"
         "  demo       train a built-in GPT under the plan autopar chooses (2 CPU processes, or the GPUs here)\n"
         "  topology   print the hardware autopar sees (or --cluster SPEC)\n"
         "  plan       rank the plans for a model (a spec like llama3-8b, a config.json, or module:factory)\n"
         "             on some hardware (--cluster 4x8xH100-SXM), print the table, write the best as YAML\n"
         "  tune       measure the best predicted plans in your own job (autopar tune -- torchrun ... train.py),\n"
         "             in a resumable study; cache the fastest for wrap\n"
         "  report     print a tuning study's table from its file and draw its charts (PNG)\n\n"
         "  --version  print autopar's version\n\n"
         "autopar COMMAND --help describes a command's options.")


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status: 0, 1 when a command found nothing, 2 for a usage error or an
    AutoparError (printed as one line), 130 when interrupted (Ctrl-C: one line, no traceback)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands: dict[str, Callable[[list[str]], int]] = {
        "demo": demo_main, "topology": _topology, "plan": _plan, "tune": _tune, "report": _report}
    if argv and argv[0] in ("-V", "--version"):
        try:
            print(f"autopar {version()}")
        except AutoparError as exc:
            print(f"autopar: {exc}", file=sys.stderr)
            return 1
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] not in commands:
        print(unknown_command(argv[0], tuple(commands)), file=sys.stderr)
        return 2
    try:
        return commands[argv[0]](argv[1:])
    except AutoparError as exc:
        print(f"autopar {argv[0]}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nautopar {argv[0]}: interrupted (Ctrl-C).", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
