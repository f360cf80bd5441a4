"""Launch a multi-process test on CPU with torchrun and gloo, as a user's job would be launched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def torchrun(script: str, world_size: int, args: list[str], *, timeout_s: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
           str(ROOT / script), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def run_scenarios(scenarios: list[dict], world_size: int, tmp_path: Path) -> dict:
    spec = tmp_path / f"spec{world_size}.json"
    out = tmp_path / f"out{world_size}.pt"
    spec.write_text(json.dumps(scenarios))
    torchrun("tests/distributed/_worker.py", world_size, [str(spec), str(out)])
    return torch.load(out, weights_only=False)  # our own test output; plain types only
