"""Faults a test's training script raises on purpose, so the tests see how the tuner handles a failing run.

The test sets `AUTOPAR_TEST_FAULT` ("oom:RANK", "crash:RANK" or "hang:RANK") in the run's environment; the
script calls `install()` before its loop. On that rank, at the first timed optimizer step (the step after the
tuner's warm-up, AUTOPAR_TRIAL_WARMUP), the fault happens: `torch.cuda.OutOfMemoryError("injected out of
memory")`, `RuntimeError("injected crash")`, or a sleep that never ends. autopar itself knows nothing of it.
"""

from __future__ import annotations

import os
import re
import sys
import time

ENV_FAULT = "AUTOPAR_TEST_FAULT"
FAULTS = ("oom", "crash", "hang")


def parse(spec: str | None) -> tuple[str, int] | None:
    """("oom" | "crash" | "hang", rank) from "KIND:RANK", or None."""
    if spec is None or spec == "":
        return None
    m = re.fullmatch(rf"({'|'.join(FAULTS)}):(\d+)", spec.strip())
    if not m:
        raise ValueError(f"fault {spec!r}: expected 'oom:RANK', 'crash:RANK' or 'hang:RANK' ({ENV_FAULT}).")
    return m.group(1), int(m.group(2))


def _raise(kind: str, rank: int) -> None:
    import torch

    print(f"[test] injecting a fault on rank {rank}: {kind} ({ENV_FAULT})", file=sys.stderr, flush=True)
    if kind == "oom":
        raise torch.cuda.OutOfMemoryError("injected out of memory")
    if kind == "crash":
        raise RuntimeError("injected crash")
    while True:  # "hang"
        time.sleep(1.0)


class _AtFirstTimedStep:
    """A global optimizer-step hook: the fault on its rank, at the first timed step of the first optimizer."""

    def __init__(self, kind: str, at_step: int) -> None:
        self.kind, self.at_step = kind, at_step
        self.count = 0

    def __call__(self, optimizer, args, kwargs) -> None:
        self.count += 1
        if self.count == self.at_step:
            _raise(self.kind, int(os.environ.get("RANK", "0")))


def install() -> None:
    """The fault `AUTOPAR_TEST_FAULT` asks for on this rank (nothing when it names another rank or is unset)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    fault = parse(os.environ.get(ENV_FAULT))
    if fault is None or fault[1] != int(os.environ.get("RANK", "0")):
        return
    warmup = int(os.environ.get("AUTOPAR_TRIAL_WARMUP", "3"))
    register_optimizer_step_post_hook(_AtFirstTimedStep(fault[0], warmup + 1))
