"""autopar's tuner: measured trials of plans in the user's own launch command.

    from autopar.tune import run_trial, probe
    p = probe(["torchrun", "--nproc-per-node", "8", "train.py"])          # the profile wrap() makes there
    r = run_trial(["torchrun", "--nproc-per-node", "8", "train.py"], plan)  # one plan, measured

`launcher` is the tuner's side (start, watch, end, classify), `worker` the run's side (the wrap hook the
launched run installs); `study` drives trials through Optuna (docs/tuning.md).
"""

from __future__ import annotations

from ..errors import ProbeError
from .launcher import ProbeResult, TrialResult, probe, run_trial
from .worker import ENV_DIR, ENV_MODE, ENV_STEPS, ENV_WARMUP

__all__ = [
    "ENV_DIR",
    "ENV_MODE",
    "ENV_STEPS",
    "ENV_WARMUP",
    "ProbeError",
    "ProbeResult",
    "TrialResult",
    "probe",
    "run_trial",
]
