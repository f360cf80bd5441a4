"""The `autopar` command: `autopar demo | topology | plan | tune | report`."""

from __future__ import annotations

import argparse
import sys


def _topology(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="autopar topology",
                                description="Print the hardware autopar plans for: detected, or a spec.")
    p.add_argument("--cluster", default=None, help="a spec like 4x8xH100-SXM instead of detecting")
    p.add_argument("--yaml", action="store_true", help="print as YAML")
    args = p.parse_args(argv)
    from .topology import Topology

    topo = Topology.from_spec(args.cluster) if args.cluster else Topology.detect()
    if args.yaml:
        import yaml

        print(yaml.safe_dump(topo.to_dict(), sort_keys=False), end="")
    else:
        print(topo.describe())
    return 0


PLAN_DEFAULT_OUT = "autopar-plan.yaml"
#: The share of a GPU's memory a plan may fill (autopar.search's default).
HEADROOM = 0.95


def _plan_parser() -> argparse.ArgumentParser:
    from .named_models import known_specs

    p = argparse.ArgumentParser(
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
                   help="hardware as a spec like 4x8xH100-SXM (default: the hardware detected here)")
    p.add_argument("--plain-loop", action="store_true",
                   help="only plans a plain loop runs: no gradient accumulation, no pipeline (as wrap chooses)")
    p.add_argument("--top", type=int, default=10, metavar="K", help="rows of the table (default 10)")
    p.add_argument("--out", default=PLAN_DEFAULT_OUT, metavar="FILE",
                   help=f"where to write the chosen plan (default {PLAN_DEFAULT_OUT}; '-' prints it instead)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--verify", type=int, default=0, metavar="N",
                   help="check the N best plans with the exact memory check (traces the full model on fake "
                        "tensors: seconds to minutes each, no memory) and drop those it finds too big")
    return p


def _plan(argv: list[str]) -> int:
    import json
    import time

    from .errors import InfeasiblePlanError, PlanError
    from .planning import GiB, _short, calibration_for, describe_candidates, dropped_reasons, resolve_topology
    from .search import data_parallel_degrees, search
    from .named_models import ModelSpecError, model_profiles, model_sample_batch, resolve_model

    args = _plan_parser().parse_args(argv)
    if args.top < 1:
        raise PlanError(f"--top must be at least 1, got {args.top}.")
    if args.verify < 0:
        raise PlanError(f"--verify must be a non-negative number of plans, got {args.verify}.")
    for name in ("seq", "global_batch", "tokens_per_step"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise PlanError(f"--{name.replace('_', '-')} must be a positive integer, got {value}.")
    started = time.perf_counter()
    topo = resolve_topology(args.cluster)
    source = resolve_model(args.model)
    profile, variants = model_profiles(source, topo, seq_len=args.seq)
    profiled = time.perf_counter()
    seq = profile.tokens_per_sample
    world = topo.world_size
    if args.tokens_per_step is not None:
        if seq is None:
            raise ModelSpecError(f"{source.name}'s input has no sequence: give --global-batch (samples) instead of "
                                 "--tokens-per-step.")
        if args.tokens_per_step % seq:
            raise PlanError(f"--tokens-per-step {args.tokens_per_step} is not a whole number of {seq}-token samples: "
                            f"use a multiple of {seq} (e.g. {max(seq, args.tokens_per_step // seq * seq)}).")
        global_batch = args.tokens_per_step // seq
    elif args.global_batch is not None:
        global_batch = args.global_batch
    else:
        global_batch = model_sample_batch(source) * world
    allow_train_step = not args.plain_loop
    degrees = data_parallel_degrees(profile, topo, world_size=world, allow_train_step=allow_train_step)
    if not any(global_batch % d == 0 for d in degrees):
        hint = " (or drop --plain-loop: pipelines and tensor parallelism leave fewer data-parallel ranks)" if args.plain_loop else ""
        raise PlanError(
            f"a global batch of {global_batch} samples splits over none of the data-parallel degrees a plan on "
            f"{world} GPUs can have ({', '.join(map(str, degrees))}): use a global batch divisible by one of them, "
            f"e.g. {_round_up(global_batch, degrees[0])}{hint}.")
    ranked = search(profile, topo, world_size=world, global_batch_size=global_batch, variants=variants,
                    calibration=calibration_for(topo), allow_train_step=allow_train_step, headroom=HEADROOM)
    if args.verify:
        from .planning import verify_candidates

        if source.build is not None:
            model_fn = lambda: source.build(None, seq)  # noqa: E731 - the full-depth model, on meta
            sample = source.make_sample(seq)
        else:
            model_fn, sample = source.model, source.sample if source.sample is not None else source.make_sample(seq)
        ranked = verify_candidates(ranked, model_fn, sample, top=args.verify, topology=topo, loss_fn=source.loss_fn,
                                   headroom=HEADROOM)
    searched = time.perf_counter()
    feasible = [c for c in ranked if c.feasible]
    if not feasible:
        raise InfeasiblePlanError(_infeasible_message(source.name, topo, ranked, global_batch, seq, args.plain_loop))
    best = feasible[0].plan
    if source.extrapolated:  # no model was traced at full depth: the plan fits any model of this shape
        best = best.replace(model_fingerprint=None)
    out = None
    if args.out != "-":
        out = str(best.save(args.out))
    # bf16 variants are traced while searching, when a plan first needs them: count them as profiling
    traced_s = profiled - started + variants.seconds
    timings = {"profile_s": traced_s, "search_s": searched - started - traced_s, "total_s": searched - started}

    if args.json:
        print(json.dumps({
            "model": _model_summary(source, profile, variants),
            "topology": {"spec": args.cluster, "fingerprint": topo.fingerprint(), "world_size": world,
                         "device": topo.device.name, "memory_bytes_per_gpu": topo.device.memory_bytes},
            "global_batch_size": global_batch, "seq_len": seq,
            "tokens_per_step": global_batch * seq if seq else None, "allow_train_step": allow_train_step,
            "candidates": len(ranked), "feasible": len(feasible),
            "ranked": [{"rank": i, "plan": c.plan.strategy(), "prediction": dict(c.plan.prediction or {})}
                       for i, c in enumerate(feasible[:args.top], 1)],
            "dropped": [{"count": n, "reason": why} for n, why in dropped_reasons(ranked)],
            "chosen": best.to_dict(), "out": out, "timings": timings,
        }, indent=2))
        return 0

    m = _model_summary(source, profile, variants)
    print(topo.describe())
    print(f"model {source.name}: {m['description']}")
    print(f"  parameters    {_count(m['params'])}, {m['blocks']} x {m['block_class']}; {m['shape']}")
    tokens = f" x {seq} tokens = {global_batch * seq:,} tokens" if seq else ""
    print(f"  batch         {global_batch} samples{tokens} per step, over {world} "
          f"{'GPUs' if topo.is_gpu else 'processes'}")
    print(f"  profile       {m['profile']}")
    budget = HEADROOM * topo.device.memory_bytes / GiB
    plain = "; plain loop only (--plain-loop)" if args.plain_loop else ""
    print(f"search: {len(ranked)} plans considered, {len(feasible)} fit in {budget:.1f} GiB per GPU and are not "
          f"dominated{plain} ({timings['total_s']:.1f} s: profile {timings['profile_s']:.1f} s, "
          f"search {timings['search_s']:.1f} s)")
    print()
    print(describe_candidates(ranked, limit=args.top))
    verified = [c for c in ranked if c.exact is not None]
    if verified:
        print()
        print("exact memory check (allocated peak traced on fake tensors vs the analytic prediction):")
        for c in verified:
            eager = " (eager step: an upper bound for this compiled plan)" if c.plan.compile else ""
            print(f"  {'fits ' if c.feasible else 'DROPS'} {_size(c.exact.peak_bytes)} traced{eager}, "
                  f"{_size(c.prediction.memory.allocated_bytes)} predicted, in {c.exact.trace_s:.0f} s: "
                  f"{_short(c.plan)}")
    print()
    print("chosen (rank 1):")
    print(best.describe())
    if out is None:
        print()
        print(best.to_yaml(), end="")
    else:
        print(f"wrote {out}; apply it with autopar.wrap(model, sample=batch, plan={out!r})"
              + (" and autopar.train_step" if best.needs_train_step else ""))
    return 0


def _size(n: float) -> str:
    return f"{n / 2**30:7.2f} GiB" if n >= 2**29 else f"{n / 2**20:7.1f} MiB"


def _count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _model_summary(source, profile, variants) -> dict:
    shape = ", ".join(f"{k} {v}" for k, v in (("hidden", profile.hidden_dim), ("heads", profile.num_heads),
                                              ("kv heads", profile.num_kv_heads), ("ffn", profile.ffn_dim),
                                              ("vocab", profile.vocab_size)) if v is not None)
    from .named_models import DEEPER_DEPTH, SHALLOW_DEPTH

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


def _infeasible_message(name, topo, ranked, global_batch, seq, plain_loop) -> str:
    from .planning import GiB, _short

    budget = HEADROOM * topo.device.memory_bytes / GiB
    predicted = [c for c in ranked if (c.plan.prediction or {}).get("memory_bytes") is not None]
    unit = "GPU" if topo.is_gpu else "process"
    lines = [f"no plan for {name} fits {topo.world_size} x {topo.device.name} ({budget:.1f} GiB usable per {unit})."]
    if predicted:
        least = min(predicted, key=lambda c: c.plan.prediction["memory_bytes"])
        need = least.plan.prediction["memory_bytes"] / GiB
        lines[0] += f" The smallest, {_short(least.plan)}, needs {need:.1f} GiB per {unit}."
    elif ranked:
        lines[0] += f" No plan could run: {ranked[0].reason}."
    helps = [f"more {'GPUs' if topo.is_gpu else 'processes'} (--cluster with more nodes)"]
    if plain_loop:
        helps.insert(0, "dropping --plain-loop (gradient accumulation, pipelines and tensor parallelism hold fewer activations)")
    if global_batch > 1:
        helps.append(f"a smaller global batch (--global-batch, now {global_batch})")
    if seq:
        helps.append(f"a shorter sequence (--seq, now {seq})")
    lines.append("What would help: " + "; ".join(helps) + ".")
    return " ".join(lines)


# ---------------------------------------------------------------------------------------------------
# autopar tune and autopar report (docs/tuning.md)
# ---------------------------------------------------------------------------------------------------
TUNE_DEFAULT_STUDY = "autopar-study.db"
TUNE_DEFAULT_TRIALS = 20


def _tune_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
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
    p.add_argument("--plain-loop", action="store_true",
                   help="only plans a plain loop runs (pure data parallelism, no accumulation, no pipeline, no "
                        "tensor parallelism); default: follow the script's wrap(uses_train_step=...)")
    p.add_argument("--compiled-only", action="store_true",
                   help="measure only compiled plans where torch.compile is available (default: eager ones too; "
                        "the cost model ranks compiled plans first, but compilation can fail or lose on a model)")
    p.add_argument("--top-k", type=int, default=5, metavar="K",
                   help="run the K best predicted plans first, in predicted order (default 5)")
    return p


class _ProgressLine:
    """`autopar tune`'s progress on stderr: one line rewritten in place on a terminal (trial i/N, the plan
    in flight, the best so far), a line per event otherwise. Ended trials are printed as lines that stay."""

    def __init__(self, stream, *, tty: bool | None = None) -> None:
        self.stream = stream
        self.tty = stream.isatty() if tty is None else tty
        self.shown = False

    def __call__(self, ev) -> None:
        from .tune.report import _num

        unit = "tok/s" if ev.unit == "tokens/s" else "samples/s"
        best = f"best {_num(ev.best)} {unit} ({ev.best_plan})" if ev.best is not None else "best -"
        budget = ev.budget
        if ev.event == "trial":
            done = ev.measured
            if budget:
                filled = min(20, round(20 * done / budget))
                bar = f"[{'#' * filled}{'.' * (20 - filled)}] {done + 1}/{budget}"
            else:
                bar = f"trial {done + 1}"
            self._line(f"{bar} running {ev.plan} | {best} | {ev.elapsed_s:.0f} s", keep=False)
        elif ev.event == "result":
            what = f"{_num(ev.throughput)} {unit}" if ev.status == "ok" else (ev.message or "").splitlines()[0][:100]
            self._line(f"trial {ev.number}: {ev.status:<7} {ev.plan}: {what}", keep=True)
        elif ev.event == "pruned":
            self._line(f"trial {ev.number}: pruned  {ev.plan}: not run, {ev.message.split(': ', 1)[-1]}", keep=True)
        elif ev.event in ("start", "done"):
            self._line(f"{ev.message}", keep=True)

    def _line(self, text: str, *, keep: bool) -> None:
        text = f"[autopar tune] {text}"
        if not self.tty:
            self.stream.write(text + "\n")
        elif keep:
            self.stream.write("\r\033[K" + text + "\n")
            self.shown = False
        else:
            self.stream.write("\r\033[K" + text)
            self.shown = True
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()


def _tune(argv: list[str]) -> int:
    from .errors import AutoparError

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
    for name in ("time_budget", "trial_timeout"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise AutoparError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {value}.")
    import optuna

    from .tune.study import tune

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the progress line says it instead
    bar = _ProgressLine(sys.stderr)
    try:
        report = tune(command, study_path=args.study, trials=args.trials or None, time_budget_s=args.time_budget,
                      steps=args.steps, warmup=args.warmup, trial_timeout_s=args.trial_timeout,
                      allow_train_step=False if args.plain_loop else None, top_k_enqueue=args.top_k, plan_out=args.plan_out,
                      progress=bar, eager=not args.compiled_only)
    except KeyboardInterrupt:
        bar.close()
        print(f"autopar tune: interrupted. The study is kept in {args.study}: run the same command again to go on "
              "(the trial that was running is tried again).", file=sys.stderr)
        return 130
    finally:
        bar.close()
    print(report.table())
    return 0 if report.best is not None else 1


def _report(argv: list[str]) -> int:
    from pathlib import Path

    p = argparse.ArgumentParser(
        prog="autopar report",
        description="Print the table of a tuning study (autopar tune --study FILE) from its file alone, and draw "
                    "two charts as PNG: measured vs predicted throughput per trial, and the optimisation history.")
    p.add_argument("study", metavar="STUDY", help="the study's SQLite file")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where to write the charts (default: the study file's folder)")
    args = p.parse_args(argv)
    from .tune.report import load_report, write_plots

    report = load_report(args.study)
    print(report.table())
    study = Path(args.study)
    paths = write_plots(report, args.out if args.out is not None else study.parent, prefix=study.stem)
    print()
    for path in paths:
        print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": None, "topology": _topology, "plan": _plan, "tune": _tune, "report": _report}
    asked = not argv or argv[0] in ("-h", "--help")
    if asked or argv[0] not in commands:
        print("usage: autopar {demo,topology,plan,tune,report} [options]\n\n"
              "  demo       train a built-in GPT under the plan autopar chooses (2 CPU processes, or the GPUs here)\n"
              "  topology   print the hardware autopar sees (or --cluster SPEC)\n"
              "  plan       rank the plans for a model (a spec like llama3-8b, a config.json, or module:factory)\n"
              "             on some hardware (--cluster 4x8xH100-SXM), print the table, write the best as YAML\n"
              "  tune       measure the best predicted plans in your own job (autopar tune -- torchrun ... train.py),\n"
              "             in a resumable study; cache the fastest for wrap\n"
              "  report     print a tuning study's table from its file and draw its charts (PNG)\n\n"
              "autopar COMMAND --help describes a command's options.", file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    from .errors import AutoparError

    try:
        if argv[0] == "demo":
            from .demo import main as demo_main

            return demo_main(argv[1:])
        return commands[argv[0]](argv[1:])
    except AutoparError as exc:
        print(f"autopar {argv[0]}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
