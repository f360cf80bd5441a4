"""How long `autopar plan` takes, end to end, on this machine's CPU (a benchmark, not a test).

Each case runs the real command in a fresh process (`python -m autopar.cli plan ... --json`), so the time
includes starting Python and importing torch. The target (issue: "autopar plan CLI"): the 80-layer 70B
Llama on 1,024 GPUs in under 10 s on 2 CPU cores.

    python -m bench.plan_speed [--repeat 3] [--out bench/results]

Writes bench/results/plan_speed_<date>.txt: date, machine (CPU model, cores, load), torch and Python
versions, the git commit, and per case the command, the wall and CPU seconds of each run, the time the
command itself reports for profiling and searching, and the number of plans considered and kept.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from bench._common import RESULTS, ROOT

CASES = [  # (name, MODEL and options)
    ("70B on 1,024 GPUs (target: < 10 s)",
     ["llama3-70b", "--cluster", "128x8xH100-SXM", "--seq", "4096", "--global-batch", "1024"]),
    ("8B on 8 GPUs", ["llama3-8b", "--cluster", "8xH100-SXM", "--seq", "8192", "--global-batch", "128"]),
    ("8B on 64 GPUs", ["llama3-8b", "--cluster", "8x8xH100-SXM", "--seq", "8192", "--global-batch", "512"]),
    ("GPT-2 XL on 1 GPU", ["gpt2-xl", "--cluster", "1xH100-SXM", "--global-batch", "8"]),
]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.strip()
        return head + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _seconds(values) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def run_case(args: list[str], out_dir: str) -> dict:
    """One run of the command in a fresh process: wall and CPU seconds, and what it reported."""
    cmd = [sys.executable, "-m", "autopar.cli", "plan", *args, "--json", "--out", os.path.join(out_dir, "plan.yaml")]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=out_dir, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    data = json.loads(proc.stdout)
    return {"wall_s": wall, "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "profile_s": data["timings"]["profile_s"], "search_s": data["timings"]["search_s"],
            "candidates": data["candidates"], "feasible": data["feasible"], "chosen": data["ranked"][0],
            "model": data["model"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per case (default 3)")
    parser.add_argument("--out", default=str(RESULTS), help="folder for the results file")
    args = parser.parse_args()
    import torch

    today = datetime.date.today().isoformat()
    lines = [
        "autopar plan: end-to-end time of the command (python -m bench.plan_speed)",
        f"date          {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"machine       {_cpu_model()}, {os.cpu_count()} CPU cores visible, {platform.system()} {platform.release()}",
        f"load average  {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min) at the start; other "
        "users share this machine, so wall times vary",
        f"software      torch {torch.__version__}, Python {platform.python_version()}, autopar at {_git_commit()}",
        f"runs          {args.repeat} per case, each a fresh process: python -m autopar.cli plan MODEL ... --json "
        "--out plan.yaml (wall and CPU include starting Python and importing torch; profile and search are the "
        "times the command reports for itself)",
        "",
    ]
    print("\n".join(lines), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, case in CASES:
            runs = [run_case(case, tmp) for _ in range(args.repeat)]
            walls = [r["wall_s"] for r in runs]
            first = runs[0]
            chosen = first["chosen"]["plan"]
            mesh = " x ".join(f"{k}={chosen[k]}" for k in ("pp", "dp_replicate", "dp_shard", "tp"))
            block = [
                f"{name}",
                f"  command     autopar plan {' '.join(case)}",
                f"  model       {first['model']['params'] / 1e9:.2f}B parameters, {first['model']['blocks']} blocks "
                f"({first['model']['profile']})",
                f"  wall        {_seconds(walls)} s (median {statistics.median(walls):.2f} s, "
                f"best {min(walls):.2f} s)",
                f"  cpu         {_seconds(r['cpu_s'] for r in runs)} s (user + system)",
                f"  in-process  profile {_seconds(r['profile_s'] for r in runs)} s; search "
                f"{_seconds(r['search_s'] for r in runs)} s",
                f"  plans       {first['candidates']} considered, {first['feasible']} kept (fit and not dominated)",
                f"  chosen      {mesh}, micro-batch {chosen['micro_batch_size']} x {chosen['grad_accum']}, "
                f"checkpointing {chosen['checkpointing']}; predicted "
                f"{first['chosen']['prediction']['step_s'] * 1e3:.0f} ms/step, "
                f"{first['chosen']['prediction']['memory_bytes'] / 2**30:.1f} GiB per GPU",
                "",
            ]
            print("\n".join(block), flush=True)
            lines += block
    lines.append(f"load average  {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min) at the end")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"plan_speed_{today}.txt")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
