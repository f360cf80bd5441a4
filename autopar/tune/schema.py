"""What autopar stores in an Optuna study: the attribute names, the format version, and a trial's plan key.

The study engine (autopar.tune.engine) writes these; the report (autopar.tune.report) reads them back, so
`autopar report` needs nothing but the study file. docs/tuning.md ("Storage, resuming and the study's
contents") lists every attribute.
"""

from __future__ import annotations

from typing import Any, Mapping

STUDY_NAME = "autopar"
#: Version of what autopar stores in a study. 1: the one parameter `plan` was the plan's key (a hash);
#: 2: `plan` is the plan's readable name and every strategy field of the plan is a parameter too.
#: The engine refuses to resume a study of another version; the report reads both.
STUDY_FORMAT = 2

#: The study's user attributes (JSON).
STUDY_META = "autopar"
STUDY_SPACE = "autopar.space"
STUDY_CAL_BEFORE = "autopar.calibration_before"
STUDY_FIT = "autopar.fit"
STUDY_WALL = "autopar.wall_s"
STUDY_BEST = "autopar.best"
STUDY_QUEUE = "autopar.queue"

#: The Optuna parameter that names the plan (its readable name; its key in format 1). The plan's strategy
#: fields (Plan.strategy(): pp, dp_replicate, dp_shard, tp, micro_batch_size, ...) are parameters beside it.
PARAM = "plan"

#: Trial statuses of a plan that ran and failed (the trial runner's); "ok", "pruned", "stale" and "running"
#: are the others (autopar.tune.report.TuneRow.status).
FAILED = ("oom", "crash", "exit", "timeout")


def trial_key(params: Mapping[str, Any], user_attrs: Mapping[str, Any], keys_by_name: Mapping[str, str]) -> str | None:
    """The plan key (Plan.key()) of a trial: its user attribute `key`, else the plan named by its parameter
    (format 2), else the parameter itself (format 1, where the parameter was the key)."""
    key = user_attrs.get("key")
    if key:
        return str(key)
    value = params.get(PARAM)
    if value is None:
        return None
    return keys_by_name.get(value, value)
