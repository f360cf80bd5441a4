"""What the refusal tests share: the plans that manage the parameters with FSDP (sharded, replicated over 2
processes, offloaded in one), and the one-line refusal check_plan gives one of them for a model."""

from __future__ import annotations

from typing import Any

import pytest
import torch.nn as nn

import autopar
from autopar.errors import PlanError
from autopar.strategies.apply import check_plan

FSDP_PLANS = [dict(dp_shard=2), dict(dp_replicate=2), dict(cpu_offload=True)]  # Plan fields, for a batch of 8


def refusal(model: nn.Module, sample: Any, fields: dict, profile: Any = None) -> str:
    """check_plan's refusal of the plan `fields` for `model` (profiled on `sample`, unless `profile` is given): one
    line, whose text is returned for the test to read."""
    profile = profile if profile is not None else autopar.profile_model(model, sample, warn=False)
    plan = autopar.Plan(micro_batch_size=4 if "cpu_offload" not in fields else 8, **fields)
    topology = autopar.Topology.from_spec("2xH200" if plan.dp_size > 1 else "1xH200")
    with pytest.raises(PlanError) as info:
        check_plan(plan, profile, topology, world_size=plan.dp_size, model=model)
    text = str(info.value)
    assert "\n" not in text
    return text
