"""Whether this process is a run autopar's tuner launched (a trial or its probe): the tuner's worker marks it when
it installs its hooks. Such a run is the user's script, run for a few steps under another plan; `autopar.save`
writes nothing there, so a trial never replaces the user's checkpoint (a helper's trial resumed from the user's
`ckpt/`, trained 3 steps under the trial's plan and saved over it)."""

from __future__ import annotations

_MARK: list[str] = []


def mark_trial_run(kind: str) -> None:
    """This process is the tuner's `kind` run ("trial" or "probe")."""
    _MARK[:] = [kind]


def trial_run() -> str | None:
    """"trial" or "probe" in a run the tuner launched, else None."""
    return _MARK[0] if _MARK else None
