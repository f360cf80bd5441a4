"""Until autopar.tune.study imports autopar.tune.launcher: the launcher's names under their old module."""

from .launcher import ProbeError, ProbeResult, TrialResult, probe, run_trial  # noqa: F401
