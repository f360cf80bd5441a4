"""Worker of tests/test_clear_errors.py (torchrun, gloo, 2 ranks): rank 0's sample has 4 rows, rank 1's 2;
each rank writes what wrap raised. argv: OUT (each rank writes OUT.RANK)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import autopar


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    try:
        autopar.wrap(model, sample=torch.randn(4 if rank == 0 else 2, 8), verbose=False)
        result = "no error"
    except Exception as exc:
        result = f"{type(exc).__name__}: {exc}"
    with open(f"{out}.{rank}", "w") as f:
        f.write(result)
    dist.destroy_process_group()  # gloo's threads end before the interpreter's exit (else: C++ terminate, SIGABRT)


if __name__ == "__main__":
    main(sys.argv[1])
