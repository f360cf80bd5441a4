"""One entry point for the benchmarks: `python -m bench SUITE [ARGS...]` runs the suite's module with ARGS, as
`python -m bench.<module> ARGS...` would (the same flags, the same outputs); `python -m bench --list` lists the
suites; `python -m bench SUITE --help` prints the suite's own help.

Before a suite runs, one line goes to stderr: `# bench stamp {...}`, the JSON of bench._common.stamp() (date,
device, torch, transformers, the command, the commit, the code's digest), so that a run's log says what made it. Results are kept
in bench/results/ (bench/README.md lists the current ones).

    python -m bench --list
    python -m bench zoo --families gpt2,vit --time-budget-s 480      # = python -m bench.zoo_h200 ...
    python -m bench race --report bench/results/zoo_race_2026-12-01.jsonl
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import runpy
import shlex
import sys

# suite -> the module it runs (every module of bench/ with a command line). The names are the suites'; the
# modules keep their own `python -m bench.<module>` entry points, unchanged.
SUITES: dict[str, str] = {
    # on one GPU (most have a CPU smoke test: see each suite's --help)
    "zoo": "bench.zoo_h200",
    "suite": "bench.suite",
    "race": "bench.zoo_race",
    "ops": "bench.microbench_ops",
    "graph-breaks": "bench.graph_breaks",
    "integrations": "bench.integrations_h200",
    "memory-peak": "bench.memory_peak",
    "sdpa-calls": "bench.sdpa_calls",
    "sdpa-choice": "bench.sdpa_choice",
    "validate": "bench.validate_h200",
    "grid": "bench.grid_single_gpu",
    "kernels": "bench.profile_kernels",
    "tune": "bench.tune_h200",
    # on a host of several GPUs, one process a GPU (torchrun --nproc_per_node N -m bench.multigpu ...; --report here)
    "multigpu": "bench.multigpu",
    # on a CPU
    "paper": "bench.paper",
    "megatron": "bench.megatron_table1",
    "plan-speed": "bench.plan_speed",
    "zoo-plan-speed": "bench.zoo_plan_speed",
    "hf-sweep": "bench.hf_sweep",
    "hf-sweep-dist": "bench.hf_sweep_dist",
    "memory-check": "bench.memory_check",
    "remat-check": "bench.remat_check",
    "step-check": "bench.step_time_check",
    "roofline": "bench.zoo_roofline",
    "exact": "bench.exact_vs_analytic",
    "anchors": "bench.calibrate_anchors",
    "report": "bench.report_h200",
    # not measurements: the zoo's table, and the user's script that `tune` tunes
    "families": "bench.zoo",
    "train-hf": "bench.train_hf",
}

PROG = "python -m bench"


def summary(module: str, width: int = 120) -> str:
    """What `module` does: its docstring's first sentence (of the first paragraph), cut to `width` characters,
    read from its source (nothing imported: most suites import torch and transformers)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        return "(module not found)"
    with open(spec.origin, encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    if not doc.strip():
        return "(no docstring)"
    text = " ".join(doc.strip().split("\n\n")[0].split())
    end = re.search(r"\.\s+(?=[A-Z])", text)  # a sentence's end ("et al. 2021" is not one)
    text = text[: end.start() + 1] if end else text
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."


def listing() -> str:
    width = max(map(len, SUITES))
    return "\n".join(f"{name:<{width}}  {SUITES[name]:<24}  {summary(SUITES[name])}" for name in SUITES)


def usage() -> str:
    return (f"usage: {PROG} SUITE [ARGS...]    ({PROG} --list: the suites; {PROG} SUITE --help: a suite's flags)")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip() if args else usage())
        if args:
            print("\nsuites:\n" + listing())
        return 0 if args else 2
    if args[0] == "--list":
        print(listing())
        return 0
    suite, rest = args[0], args[1:]
    if suite not in SUITES:
        print(f"{PROG}: unknown suite {suite!r}; choose one of: {', '.join(SUITES)}", file=sys.stderr)
        return 2
    module = SUITES[suite]
    if not any(a in ("-h", "--help") for a in rest):
        from bench._common import stamp

        line = stamp(command=shlex.join([*PROG.split(), suite, *rest]))
        line["suite"] = f"{suite} ({module})"
        print("# bench stamp " + json.dumps(line), file=sys.stderr, flush=True)
    # as `python -m <module> rest...`: the module runs as __main__ with sys.argv[0] its file, so its flags,
    # defaults and the command it records are what they are when it is run on its own
    saved = sys.argv
    sys.argv = [module, *rest]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)  # its SystemExit (code, message) passes
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
