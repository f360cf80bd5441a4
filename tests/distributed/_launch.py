"""Launch a multi-process test on CPU with torchrun and gloo, as a user's job would be launched.

Launches may run side by side (`pytest -n 4`): torchrun takes its ports from the OS (tests/_ports.py) and
every launch is given its own autopar cache directory, in the test's temporary folder.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import torch

from tests._ports import torchrun_argv
from tests._training import TORCHRUN_VARS

ROOT = Path(__file__).resolve().parents[2]


def process_env(cache_dir: Path) -> dict[str, str]:
    """The environment of a process a test starts: this checkout importable, no GPU, no torchrun variables
    inherited, and `cache_dir` as its autopar cache (no plan or calibration of another test or of the user)."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               CUDA_VISIBLE_DEVICES="", AUTOPAR_CACHE_DIR=str(cache_dir))
    for name in TORCHRUN_VARS:
        env.pop(name, None)
    return env


def torchrun(script: str, world_size: int, args: list[str], *, cache_dir: Path,
             timeout_s: float = 300) -> subprocess.CompletedProcess:
    env = dict(process_env(cache_dir), OMP_NUM_THREADS="1")
    cmd = [*torchrun_argv(world_size), str(ROOT / script), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def run_scenarios(scenarios: list[dict], world_size: int, tmp_path: Path) -> dict:
    spec = tmp_path / f"spec{world_size}.json"
    out = tmp_path / f"out{world_size}.pt"
    spec.write_text(json.dumps(scenarios))
    torchrun("tests/distributed/_worker.py", world_size, [str(spec), str(out)], cache_dir=tmp_path / "autopar-cache")
    return torch.load(out, weights_only=False)  # our own test output; plain types only


def worker_main(run_ranks, names: list[str], out: str) -> None:
    """A worker's main (under torchrun, gloo): `run_ranks(name)` for each scenario on every rank, an error recorded
    in its place (the test fails on it, with its traceback); rank 0 saves the results to `out`."""
    import traceback

    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = {}
    for name in names:
        try:
            results[name] = run_ranks(name)
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
            results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.destroy_process_group()
