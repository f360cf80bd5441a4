"""Plan.zero_stage (ZeRO stages 2 and 1 under FSDP2) on one process: what the plan accepts and refuses, that
plans made before it keep their keys, what the cost model charges (gathers and reduce-scatters a step, whole
gradients under stage 1) and what the search enumerates and drops. Parity on gloo ranks is
tests/distributed/test_zero_stages.py."""

from __future__ import annotations

import pytest
import torch

from autopar.cost import Calibration, predict_profile
from autopar.cost.memory import predict_memory
from autopar.errors import PlanError
from autopar.models.gpt import GPT, GPTConfig, lm_loss
from autopar.plans import Loop, Plan
from autopar.profile import profile_model
from autopar.search import DOMINATED, enumerate_plans, search
from autopar.topology import Topology

CFG = GPTConfig(vocab_size=256, seq_len=32, num_layers=4, hidden_dim=64, num_heads=4)
TOPO = Topology.from_spec("2x8xH100-SXM")


@pytest.fixture(scope="module")
def profile():
    torch.manual_seed(0)
    return profile_model(GPT(CFG), torch.randint(0, CFG.vocab_size, (2, CFG.seq_len)), loss_fn=lm_loss)


def _fsdp(stage: int, **kw) -> Plan:
    return Plan(dp_shard=16, micro_batch_size=2, grad_accum=4, reshard_after_forward=stage == 3 and
                kw.pop("reshard", True), zero_stage=stage, **kw)


@pytest.mark.parametrize("fields, message", [
    ({"zero_stage": 2}, "needs dp_shard > 1 and grad_accum > 1"),
    ({"dp_shard": 2, "zero_stage": 1}, "needs dp_shard > 1 and grad_accum > 1"),
    ({"dp_shard": 2, "grad_accum": 2, "zero_stage": 2}, "set reshard_after_forward=False"),
    ({"dp_shard": 2, "grad_accum": 2, "zero_stage": 2, "reshard_after_forward": False, "cpu_offload": True},
     "without cpu_offload"),
    ({"zero_stage": 4}, "must be one of 1, 2, 3"),
    ({"zero_stage": True}, "positive integer"),
])
def test_a_zero_stage_the_plan_cannot_run_is_refused_in_one_line(fields, message):
    with pytest.raises(PlanError, match=message) as info:
        Plan(**fields)
    assert "\n" not in str(info.value)


def test_plans_without_a_zero_stage_keep_their_keys_and_files_read_back():
    assert Plan(dp_shard=2).key() == Plan(dp_shard=2, zero_stage=3).key()
    assert "zero_stage" not in Plan(dp_shard=2).strategy()
    two = Plan(dp_shard=2, grad_accum=2, reshard_after_forward=False, zero_stage=2)
    keys = {two.key(), two.replace(zero_stage=1).key(), two.replace(zero_stage=3).key()}
    assert len(keys) == 3
    assert Plan.from_yaml(two.to_yaml()) == two
    assert Plan.from_yaml("dp_shard: 2\n").zero_stage == 3  # a file from before the field


def test_only_train_step_runs_a_zero_stage():
    plan = Plan(dp_shard=2, grad_accum=2, reshard_after_forward=False, zero_stage=1)
    assert Loop.TRAIN_STEP.refusal(plan) is None
    assert "zero_stage=1 is run across micro-batches by autopar.train_step" in Loop.ACCUMULATES.refusal(plan)


def test_stages_2_and_1_gather_once_a_step_and_stage_1_reduces_once(profile):
    cal = Calibration()
    comm = {stage: predict_profile(profile, _fsdp(stage, reshard=False) if stage == 3 else _fsdp(stage), TOPO,
                                   cal).time.dp_comm_s for stage in (3, 2, 1)}
    resharding = predict_profile(profile, _fsdp(3), TOPO, cal).time.dp_comm_s
    assert resharding > comm[3] > comm[2] > comm[1] > 0


def test_stage_1_holds_the_gradients_whole_during_accumulation(profile):
    cal = Calibration()
    grads = {stage: predict_memory(profile, _fsdp(stage, reshard=False) if stage == 3 else _fsdp(stage),
                                   cal).gradients_bytes for stage in (3, 2, 1)}
    assert grads[3] == grads[2]
    assert grads[1] == pytest.approx(16 * grads[2])  # not sharded over the 16 ranks


def test_the_search_offers_the_stages_under_train_step_and_drops_the_ones_doing_more_work(profile):
    def plans(loop):
        return list(enumerate_plans(profile, TOPO, world_size=16, global_batch_size=128, loop=loop))

    stages = {(p.reshard_after_forward, p.zero_stage) for p in plans(Loop.TRAIN_STEP) if p.dp_shard > 1 and
              p.grad_accum > 1 and p.pp == 1}
    assert stages == {(True, 3), (False, 3), (False, 2), (False, 1)}
    assert {p.zero_stage for p in plans(Loop.ACCUMULATES)} == {3}
    # a tiny model fits every way: stage 1 does the least gathering, and the other FSDP splits of its group
    # are dropped as dominated by it
    ranked = search(profile, TOPO, world_size=16, global_batch_size=128, loop=Loop.TRAIN_STEP)
    feasible = [c.plan for c in ranked if c.feasible and c.plan.dp_shard == 16 and c.plan.grad_accum == 4
                and c.plan.tp == 1 and c.plan.pp == 1]
    assert feasible and all(p.zero_stage == 1 for p in feasible)
    dominated = [c for c in ranked if c.drop is not None and c.reason.startswith(DOMINATED)
                 and c.plan.dp_shard == 16 and c.plan.grad_accum == 4 and c.plan.zero_stage == 2
                 and c.plan.checkpointing == "none"]  # checkpointed ones are dropped for their recomputation
    assert dominated and all("zero_stage=1" in c.reason for c in dominated)
