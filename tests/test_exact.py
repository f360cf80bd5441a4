"""The exact memory check (autopar.exact) and the analytic memory model against it.

The exact check traces a rank's training steps under a plan in one process (fake process group of the
plan's world size, FakeTensorMode, torch's MemTracker): no memory, any world size. The analytic model
(autopar.cost.memory) must land within 10% of it for FSDP, HSDP, TP (+SP), PP (1F1B, GPipe) and
checkpointing, alone and combined, at world sizes 1 to 64. A GPT of hidden 512, 8 blocks, sequence 512
keeps the activations, the model states and the logits in the proportions of a real model. Each check
traces two steps (about 10 s on 2 cores), so the cases are few and their results shared.
"""

from __future__ import annotations

import functools

import pytest
import torch

import autopar
from autopar.cost import Calibration, predict_profile
from autopar.exact import ExactMemory, exact_memory
from autopar.models.gpt import GPT, GPTConfig
from autopar.profile import profile_model

CFG = GPTConfig(vocab_size=8192, seq_len=512, num_layers=8, hidden_dim=512, num_heads=8)
SAMPLE = torch.zeros(1, 512, dtype=torch.long)
P = autopar.Plan


def _model() -> GPT:
    return GPT(CFG)


@functools.lru_cache(maxsize=1)
def _profile():
    with torch.device("meta"):
        return profile_model(_model(), SAMPLE, warn=False)


PLANS = {
    "one GPU": P(micro_batch_size=4),
    "one GPU, full checkpointing": P(micro_batch_size=4, checkpointing="full"),
    "one GPU, selective checkpointing": P(micro_batch_size=4, checkpointing="selective"),
    "one GPU, alternate checkpointing": P(micro_batch_size=4, checkpointing="alternate"),
    "one GPU, gemms checkpointing": P(micro_batch_size=4, checkpointing="gemms"),
    "one GPU, selective checkpointing of every other block": P(micro_batch_size=4, checkpointing="selective",
                                                               checkpoint_every=2),
    "one GPU, full checkpointing of every 3rd block": P(micro_batch_size=4, checkpointing="full", checkpoint_every=3),
    "accumulation x2": P(micro_batch_size=2, grad_accum=2),
    "FSDP 8": P(dp_shard=8, micro_batch_size=4),
    "FSDP 8 + full checkpointing": P(dp_shard=8, micro_batch_size=4, checkpointing="full"),
    "TP 2 + SP": P(tp=2, micro_batch_size=4, sequence_parallel=True),
    "FSDP 4 x TP 2 + SP": P(dp_shard=4, tp=2, micro_batch_size=4, sequence_parallel=True),
    "HSDP 8 x 8 + selective checkpointing (64 ranks)": P(dp_replicate=8, dp_shard=8, micro_batch_size=4,
                                                          checkpointing="selective"),
    "FSDP 2 x TP 4 without SP": P(dp_shard=2, tp=4, micro_batch_size=4),
    "FSDP 16 x TP 4 + SP (64 ranks)": P(dp_shard=16, tp=4, micro_batch_size=4, sequence_parallel=True),
    "FSDP 8 x TP 8 + SP (64 ranks)": P(dp_shard=8, tp=8, micro_batch_size=4, sequence_parallel=True),
    "PP 2, 1F1B": P(pp=2, micro_batch_size=2, grad_accum=4, pp_schedule="1f1b"),
    "PP 2, GPipe": P(pp=2, micro_batch_size=2, grad_accum=4, pp_schedule="gpipe"),
    "PP 2 x FSDP 2 + full checkpointing": P(pp=2, dp_shard=2, micro_batch_size=2, grad_accum=4,
                                            pp_schedule="1f1b", checkpointing="full"),
}


@functools.lru_cache(maxsize=None)
def _exact(name: str) -> ExactMemory:
    return exact_memory(_model, SAMPLE, PLANS[name])


@pytest.mark.parametrize("name", list(PLANS))
def test_analytic_memory_is_within_10_percent_of_the_exact_check(name):
    plan = PLANS[name]
    exact = _exact(name)
    assert isinstance(exact, ExactMemory) and exact.peak_bytes > 0
    predicted = predict_profile(_profile(), plan, autopar.Topology.cpu(plan.world_size), Calibration()).memory
    error = predicted.allocated_bytes / exact.peak_bytes - 1
    assert abs(error) <= 0.10, (
        f"{name}: analytic {predicted.allocated_bytes / 2**20:.1f} MiB vs exact {exact.peak_bytes / 2**20:.1f} MiB "
        f"({error:+.1%}); exact parts {exact.by_category}, analytic parts {predicted.parts()}")


def test_the_exact_check_sees_sharding_and_checkpointing():
    """The check measures what each technique changes: FSDP shards the optimizer state 8 ways, full
    checkpointing cuts the activations, and the model's parameters are counted whole on one GPU."""
    one, fsdp, ckpt = _exact("one GPU"), _exact("FSDP 8"), _exact("one GPU, full checkpointing")
    num_params = _profile().num_params
    assert one.by_category["parameters"] == pytest.approx(4 * num_params, rel=1e-6)
    assert one.by_category["optimizer"] == pytest.approx(8 * num_params, rel=1e-4)  # + Adam's step counters
    assert fsdp.by_category["optimizer"] == pytest.approx(8 * num_params / 8, rel=0.01)
    assert ckpt.by_category.get("activations", 0) < 0.2 * one.by_category["activations"]
    assert "peak" in one.describe() and "rank 0 of 1" in one.describe()


def test_the_exact_check_leaves_no_process_group_behind():
    import torch.distributed as dist

    tiny = GPTConfig(vocab_size=64, seq_len=16, num_layers=2, hidden_dim=16, num_heads=2)
    exact_memory(functools.partial(GPT, tiny), torch.zeros(1, 16, dtype=torch.long), P(dp_shard=2, micro_batch_size=1))
    assert not dist.is_initialized()


def test_the_exact_check_refuses_bad_input():
    with pytest.raises(ValueError, match="rank must be in"):
        exact_memory(_model, SAMPLE, P(dp_shard=2, micro_batch_size=1), rank=2)
    with pytest.raises(autopar.PlanError, match="meta device"):
        exact_memory(GPT(GPTConfig(vocab_size=64, seq_len=8, num_layers=2, hidden_dim=16, num_heads=2)),
                     torch.zeros(1, 8, dtype=torch.long), P(micro_batch_size=1))
    with pytest.raises(TypeError, match="must build the model"):
        exact_memory(42, SAMPLE, P(micro_batch_size=1))


def test_candidates_verify_checks_the_best_plans_exactly_and_drops_what_does_not_fit():
    from autopar.planning import verify_candidates

    small = GPTConfig(vocab_size=512, seq_len=64, num_layers=2, hidden_dim=64, num_heads=4)
    build = functools.partial(GPT, small)
    x = torch.zeros(2, 64, dtype=torch.long)
    topo = autopar.Topology.cpu(2)
    ranked = autopar.candidates(build(), sample=x, topology=topo, verify=2, model_fn=build)
    checked = [c for c in ranked if c.exact is not None]
    assert len(checked) == 2 and all(c.feasible for c in checked)
    assert ranked[0].exact is not None  # the best plan was among those checked
    for c in checked:
        assert c.plan.prediction["exact_allocated_bytes"] == c.exact.peak_bytes > 0
    # With a budget just under what the first needs, the exact check drops it and re-ranks.
    first = checked[0]
    need = first.exact.peak_bytes + first.prediction.memory.overhead_bytes
    tight = verify_candidates(ranked, build, x, top=1, topology=topo,
                              headroom=need * 0.999 / topo.device.memory_bytes)
    dropped = next(c for c in tight if c.plan == first.plan)
    assert not dropped.feasible and dropped.reason.startswith("exact check: needs")
    assert tight[0].plan != first.plan


def test_candidates_verify_needs_a_way_to_build_the_model():
    small = GPTConfig(vocab_size=512, seq_len=64, num_layers=2, hidden_dim=64, num_heads=4)
    with pytest.raises(autopar.PlanError, match="verify= needs model_fn="):
        autopar.candidates(GPT(small), sample=torch.zeros(2, 64, dtype=torch.long), topology=autopar.Topology.cpu(1),
                           verify=1)
