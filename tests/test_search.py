"""Tests of autopar.search's enumeration and search: which plans are considered (tensor parallelism divides
the heads and stays in a node, pipelines leave every stage a block, plain-loop plans (pure data parallelism) only when asked),
CPU offload only when nothing else fits, dominated plans dropped, the ranking order, and that the work
follows the candidates, not the number of GPUs."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from autopar.models.gpt import GPT, GPTConfig, lm_loss
from autopar.planning import dropped_reasons
from autopar.plans import Loop, Plan
from autopar.profile import profile_model
from autopar.search import (DOMINATED, Drop, DropKind, _divisors, data_parallel_degrees, enumerate_plans, search,
                            tensor_parallel_degrees)
from autopar.topology import Topology

SIX_HEADS = GPTConfig(vocab_size=256, seq_len=32, num_layers=4, hidden_dim=96, num_heads=6)
EIGHT_HEADS = GPTConfig(vocab_size=256, seq_len=32, num_layers=6, hidden_dim=64, num_heads=8)


def _profile(cfg: GPTConfig, batch: int = 2):
    torch.manual_seed(0)
    return profile_model(GPT(cfg), torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len)), loss_fn=lm_loss)


@pytest.fixture(scope="module")
def six():
    return _profile(SIX_HEADS)


@pytest.fixture(scope="module")
def eight():
    return _profile(EIGHT_HEADS)


def _plans(profile, spec: str, global_batch: int, **kw) -> list[Plan]:
    topo = Topology.from_spec(spec)
    return list(enumerate_plans(profile, topo, world_size=topo.world_size, global_batch_size=global_batch, **kw))


def test_divisors_in_sqrt_steps():
    for n in list(range(1, 200)) + [1024, 4096, 3 * 5 * 7 * 11 * 13]:
        assert _divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    assert _divisors(2**40)[-1] == 2**40 and len(_divisors(2**40)) == 41  # a million steps, not 10^12


def test_tensor_parallel_divides_the_heads_and_stays_in_a_node(six, eight):
    assert tensor_parallel_degrees(six, Topology.from_spec("2x8xH100-SXM"), 16) == [1, 2]  # 6 heads: not 4, 8
    assert tensor_parallel_degrees(eight, Topology.from_spec("2x8xH100-SXM"), 16) == [1, 2, 4, 8]
    assert tensor_parallel_degrees(eight, Topology.from_spec("4x4xH100-SXM"), 16) == [1, 2, 4]  # 4 GPUs a node
    for spec in ("2x8xH100-SXM", "4x4xH100-SXM"):
        topo = Topology.from_spec(spec)
        plans = _plans(eight, spec, 32, loop=Loop.TRAIN_STEP)
        assert {p.tp for p in plans} == set(tensor_parallel_degrees(eight, topo, 16))
        for p in plans:
            assert p.tp <= topo.devices_per_node and EIGHT_HEADS.num_heads % p.tp == 0
            assert p.sequence_parallel == (p.tp > 1)  # TP without SP is dominated


def test_every_plan_has_the_world_and_the_global_batch(eight):
    topo = Topology.from_spec("2x8xH100-SXM")
    plans = _plans(eight, "2x8xH100-SXM", 48, loop=Loop.TRAIN_STEP)
    assert plans
    for p in plans:
        assert p.world_size == 16 and p.global_batch_size == 48
        assert p.model_fingerprint == eight.fingerprint and p.topology_fingerprint == topo.fingerprint()
        assert p.precision == "bf16" and not p.cpu_offload
    # every compiled plan has its eager twin (compile is chosen by the prediction, never assumed to pay)
    assert sorted(p.key() for p in plans if not p.compile) == sorted(p.replace(compile=False).key()
                                                                      for p in plans if p.compile)
    # HSDP (replicated across nodes, sharded within) only where there are several nodes
    assert any(p.dp_replicate > 1 and p.dp_shard > 1 for p in plans)
    assert not any(p.dp_replicate > 1 and p.dp_shard > 1 for p in _plans(eight, "8xH100-SXM", 48))


def test_pipelines_leave_every_stage_a_block_and_need_train_step(eight):
    plans = _plans(eight, "2x8xH100-SXM", 64, loop=Loop.TRAIN_STEP)
    piped = [p for p in plans if p.pp > 1]
    assert {p.pp for p in piped} == {2, 4}  # 8 and 16 stages would exceed the 6 blocks
    for p in piped:
        assert p.pp * p.pp_stages_per_rank <= EIGHT_HEADS.num_layers
        if p.pp_schedule == "gpipe":
            assert p.grad_accum < p.pp
        else:
            assert p.grad_accum >= p.pp
        if p.pp_stages_per_rank > 1:
            assert p.grad_accum % p.pp == 0 and p.pp_schedule in ("interleaved_1f1b", "zero_bubble")


def test_plain_loop_plans_only_without_train_step(eight):
    plans = _plans(eight, "2x8xH100-SXM", 64)
    assert plans and all(p.pp == 1 and p.grad_accum == 1 and not p.needs_train_step for p in plans)
    assert all(p.tp == 1 and p.dp_size == 16 for p in plans)  # every process reads its own batch
    ranked = search(eight, Topology.from_spec("2x8xH100-SXM"), global_batch_size=64)
    assert all(c.plan.pp == 1 and c.plan.grad_accum == 1 and c.plan.tp == 1 for c in ranked)


def test_a_global_batch_splits_only_over_degrees_that_divide_it(six):
    topo = Topology.from_spec("8xH100-SXM")
    assert data_parallel_degrees(six, topo, world_size=8) == [8]  # a plain loop: pure data parallelism
    assert data_parallel_degrees(six, topo, world_size=8, loop=Loop.TRAIN_STEP) == [1, 2, 4, 8]
    assert _plans(six, "8xH100-SXM", 6) == []  # 6 samples do not split over 8 ranks
    assert _plans(six, "8xH100-SXM", 12) == []
    assert {p.dp_size for p in _plans(six, "8xH100-SXM", 16)} == {8}
    # with train_step, tensor parallelism (tp 2 divides the 6 heads) and pipelines leave 4, 2 or 1 ranks
    assert {p.dp_size for p in _plans(six, "8xH100-SXM", 12, loop=Loop.TRAIN_STEP)} == {1, 2, 4}


def test_cost_follows_the_candidates_not_the_gpus(eight):
    # 2^20 GPUs: the loops run over divisors, so this is as quick as a small cluster
    topo = Topology.from_spec(f"{2**17}x8xH100-SXM")
    plans = list(enumerate_plans(eight, topo, world_size=topo.world_size, global_batch_size=2**20))
    assert 0 < len(plans) < 200


def test_a_profile_is_hashed_once_and_like_an_equal_copy(six):
    """The search's caches key on the profile: its hash is computed once, kept off pickles (string hashes
    differ between processes), and equal to an equal copy's."""
    copy = dataclasses.replace(six)
    assert copy == six and copy is not six
    assert hash(copy) == hash(six) == hash(six) == six.__dict__["_hash"]
    assert "_hash" not in pickle.loads(pickle.dumps(six)).__dict__
    assert pickle.loads(pickle.dumps(six)) == six


def test_ranking_feasible_first_fastest_first_then_dropped_with_reasons(eight):
    topo = Topology.from_spec("2x8xH100-SXM")
    ranked = search(eight, topo, global_batch_size=64, loop=Loop.TRAIN_STEP)
    flags = [c.feasible for c in ranked]
    assert flags == sorted(flags, reverse=True) and any(flags)
    feasible = [c for c in ranked if c.feasible]
    steps = [c.prediction.step_s for c in feasible]
    assert steps == sorted(steps)
    budget = 0.95 * topo.device.memory_bytes
    for c in feasible:
        assert c.reason is None and c.prediction.memory_bytes <= budget
        assert c.plan.prediction["step_s"] == c.prediction.step_s
    for c in ranked:
        if not c.feasible:
            assert c.prediction is None and c.reason


def test_dominated_plans_are_dropped_for_one_that_redoes_less(eight):
    """A tiny model fits everywhere: of each group that differs only in checkpointing and resharding, the
    plan with neither is kept; the others are dropped, and really are no faster (checked here)."""
    from autopar.cost import predict_profile

    topo = Topology.from_spec("8xH100-SXM")
    ranked = search(eight, topo, global_batch_size=16)
    feasible = [c.plan for c in ranked if c.feasible]
    assert feasible and all(p.checkpointing == "none" for p in feasible)
    assert all(not p.reshard_after_forward for p in feasible if p.dp_shard > 1)
    dominated = [c for c in ranked if c.reason and c.reason.startswith(DOMINATED)]
    assert dominated and len(feasible) + len(dominated) == len(ranked)
    for c in dominated[:20]:
        better = c.plan.replace(checkpointing="none", reshard_after_forward=False if c.plan.dp_shard > 1 else True,
                                prediction=None)
        assert predict_profile(eight, better, topo).step_s <= predict_profile(eight, c.plan, topo).step_s


def test_a_dropped_candidate_says_why_in_typed_fields(eight):
    """Planning groups the dropped plans by the fields of their Drop, never by parsing its text."""
    topo = Topology.from_spec("8xH100-SXM")
    needs = sorted(c.plan.prediction["memory_bytes"] for c in search(eight, topo, global_batch_size=16))
    memory = int(needs[len(needs) // 2] / 0.95)  # about half the plans fit
    tight = dataclasses.replace(topo, device=dataclasses.replace(topo.device, memory_bytes=memory))
    ranked = search(eight, tight, global_batch_size=16)
    over = [c for c in ranked if c.drop is not None and c.drop.kind is DropKind.MEMORY]
    assert over and any(c.feasible for c in ranked)
    for c in over[:20]:
        assert c.drop.needed_bytes > c.drop.limit_bytes == 0.95 * tight.device.memory_bytes
        assert c.drop.needed_bytes == c.plan.prediction["memory_bytes"]
        assert c.reason == c.drop.describe() and c.reason.startswith("needs ")
    smallest = min(c.drop.needed_bytes for c in over) / 2**30
    budget = 0.95 * memory / 2**30
    assert (len(over), f"need more memory than {budget:.1f} GiB per GPU (the smallest needs {smallest:.2f} GiB)") in \
        dropped_reasons(ranked)
    dominated = [c for c in ranked if c.drop is not None and c.drop.kind is DropKind.DOMINATED]
    assert all(c.drop.checkpointing is not None and c.reason.startswith(DOMINATED) for c in dominated)
    assert Drop.memory(3 * 2**30, 2 * 2**30, exact=True).describe() == \
        "exact check: needs 3.0 GiB per GPU, more than 2.0 GiB"
    assert pickle.loads(pickle.dumps(over[0])) == over[0]


def _offload_topology(profile, global_batch: int) -> Topology | None:
    """One GPU whose memory fits a CPU-offload plan but no other (None if the cost model never makes
    offload smaller for this model)."""
    from autopar.cost import Calibration
    from autopar.cost.memory import predict_memory

    topo = Topology.from_spec("1xH100-SXM")
    cal = Calibration()
    need = {off: min(predict_memory(profile, p, cal).peak_bytes
                     for p in enumerate_plans(profile, topo, world_size=1, global_batch_size=global_batch,
                                              offload=off))
            for off in (False, True)}
    if not need[True] < need[False]:
        return None
    memory = int((need[True] + need[False]) / 2 / 0.95)
    return dataclasses.replace(topo, device=dataclasses.replace(topo.device, memory_bytes=memory))


def test_cpu_offload_only_when_nothing_else_fits():
    # parameters dominate (a wide model, a short sequence): offloading them is what makes it fit
    profile = _profile(GPTConfig(vocab_size=4096, seq_len=8, num_layers=4, hidden_dim=512, num_heads=8), batch=1)
    roomy = search(profile, Topology.from_spec("1xH100-SXM"), global_batch_size=1)
    assert roomy[0].feasible and not any(c.plan.cpu_offload for c in roomy)
    tight = _offload_topology(profile, 1)
    if tight is None:
        pytest.skip("the cost model predicts no memory saving from CPU offload for this model")
    ranked = search(profile, tight, global_batch_size=1)
    feasible = [c for c in ranked if c.feasible]
    assert feasible and all(c.plan.cpu_offload for c in feasible)
    assert any(not c.plan.cpu_offload and c.reason.startswith("needs") for c in ranked)
    # on CPU processes there is no offload at all
    assert not any(p.cpu_offload for p in _plans(profile, "1xcpu", 1))


def _without_compile(plan: Plan) -> tuple:
    return tuple(sorted((k, v) for k, v in plan.strategy().items() if k != "compile"))


def test_eager_twins_are_ranked_beside_compiled_plans_by_default(six):
    """On GPUs where compile is enumerated, the default space holds each compiled plan's compile=False twin,
    ranked against it by the prediction (compile only where the cost model predicts it pays; eager first on
    a tie); `eager=False` (the tuner's --compiled-only) keeps compiled plans only. `autopar.candidates`
    searches the default space."""
    import autopar

    topo = Topology.from_spec("1xH200")
    compiled = _plans(six, "1xH200", 4, loop=Loop.TRAIN_STEP, eager=False)
    assert compiled and all(p.compile for p in compiled)
    both = _plans(six, "1xH200", 4, loop=Loop.TRAIN_STEP)
    assert sorted(p.key() for p in both) == sorted([p.key() for p in compiled]
                                                   + [p.replace(compile=False).key() for p in compiled])

    assert all(c.plan.compile for c in search(six, topo, global_batch_size=4, loop=Loop.TRAIN_STEP, eager=False))
    for ranked in (search(six, topo, global_batch_size=4, loop=Loop.TRAIN_STEP),
                   autopar.candidates(six, topology=topo, global_batch_size=4)):
        feasible = [c for c in ranked if c.feasible]
        eager = [c for c in feasible if not c.plan.compile]
        compiled_by_key = {_without_compile(c.plan): (i, c) for i, c in enumerate(feasible) if c.plan.compile}
        assert eager and len(eager) == len(compiled_by_key)  # every feasible compiled plan has its eager twin
        for c in eager:  # ranked by their predictions; eager first where they tie
            i, twin = compiled_by_key[_without_compile(c.plan)]
            assert (feasible.index(c) > i) == (c.prediction.step_s > twin.prediction.step_s)
    assert all(c.plan.compile for c in autopar.candidates(six, topology=topo, global_batch_size=4, eager=False))


def _scaled_compile(real, factor: float):
    """predict_profile with every time term of a compiled plan scaled by `factor` (eager plans as predicted)."""
    def predict(profile, plan, *args, **kwargs):
        pred = real(profile, plan, *args, **kwargs)
        if not plan.compile:
            return pred
        time = pred.time
        scaled = {f.name: getattr(time, f.name) * factor for f in dataclasses.fields(time)}
        return dataclasses.replace(pred, time=dataclasses.replace(time, **scaled))
    return predict


def test_the_first_plan_is_eager_where_compile_is_predicted_not_to_pay(six, monkeypatch):
    """The plan is the fastest predicted, eager or compiled: where the cost model predicts every compiled
    step slower than its eager twin's, the first plan is eager; where faster, compiled."""
    import autopar.search as search_module

    topo = Topology.from_spec("1xH200")
    real = search_module.predict_profile
    for factor, want_compile in ((4.0, False), (0.25, True)):
        monkeypatch.setattr(search_module, "predict_profile", _scaled_compile(real, factor))
        best = search(six, topo, global_batch_size=4, loop=Loop.TRAIN_STEP)[0]
        assert best.feasible and best.plan.compile is want_compile


@pytest.fixture(scope="module")
def llama3_405b():
    """Llama 3 405B as `autopar plan llama3-405b` profiles it (traced at depths 2 and 3 on fake tensors)."""
    from autopar.named_models import model_profiles, resolve_model

    return model_profiles(resolve_model("llama3-405b"), Topology.from_spec("8xH100-SXM"))


def test_llama3_405b_on_one_node_of_8_h100s_plans_no_offload_beyond_the_nodes_host_memory(llama3_405b):
    """TP 8 with CPU offload fits the GPUs but needs ~6.5 TB of host RAM (16 bytes a parameter); a DGX H100 has
    2 TiB. Every such plan is dropped with a typed host-memory reason; with 8 TiB of host memory offload fits."""
    profile, variants = llama3_405b
    topo = Topology.from_spec("8xH100-SXM")
    ranked = search(profile, topo, global_batch_size=8, variants=variants, loop=Loop.TRAIN_STEP)
    host = [c for c in ranked if c.drop is not None and c.drop.kind is DropKind.HOST_MEMORY]
    assert not any(c.feasible for c in ranked) and host and all(c.plan.cpu_offload for c in host)
    limit = 0.95 * 2 * 2**40
    for c in host:
        assert c.drop.limit_bytes == limit and c.drop.needed_bytes > 16 * profile.num_params > 6.4e12
        assert c.plan.prediction["memory_bytes"] <= 0.95 * topo.device.memory_bytes  # it fits the GPUs
        assert c.reason.startswith("CPU offload needs") and "host memory per node" in c.reason
    assert any(why.startswith("CPU offload: need more host memory than 1945.6 GiB per node") and n == len(host)
               for n, why in dropped_reasons(ranked))
    roomy = Topology.from_spec("8xH100-SXM", host_memory_bytes=8 * 2**40)
    best = search(profile, roomy, global_batch_size=8, variants=variants, loop=Loop.TRAIN_STEP)[0]
    assert best.feasible and best.plan.cpu_offload


def test_a_small_models_offload_plan_fits_host_memory_until_the_node_has_less_than_it_needs():
    from autopar.cost.memory import predict_host_memory

    profile = _profile(GPTConfig(vocab_size=4096, seq_len=8, num_layers=4, hidden_dim=512, num_heads=8), batch=1)
    tight = _offload_topology(profile, 1)  # a GPU only an offload plan fits, on a node of 2 TiB (DGX H100)
    if tight is None:
        pytest.skip("the cost model predicts no memory saving from CPU offload for this model")
    ranked = search(profile, tight, global_batch_size=1)
    feasible = [c for c in ranked if c.feasible]
    assert feasible and all(c.plan.cpu_offload for c in feasible)
    need = predict_host_memory(profile, feasible[0].plan, ranks_per_node=1).node_bytes
    assert need < 0.95 * tight.host_memory_bytes
    small = dataclasses.replace(tight, host_memory_bytes=int(need / 0.95 * 0.99))  # 1% short of it
    starved = search(profile, small, global_batch_size=1)
    assert not any(c.feasible and c.plan.key() == feasible[0].plan.key() for c in starved)
    assert any(c.drop is not None and c.drop.kind is DropKind.HOST_MEMORY and c.drop.needed_bytes == need
               for c in starved)


def test_checkpointing_every_few_blocks_is_chosen_where_memory_allows_it_but_not_every_block_uncheckpointed():
    """Where a plan fits only with checkpointing (not without it, with the same resharding), the search tries the
    same checkpointing of every 2nd, 3rd and 4th block (Plan.checkpoint_every) while it fits, and takes the fastest:
    here, with the budget between selective-of-every-other-block and no checkpointing, a partial plan that
    recomputes less than any plan checkpointing every block."""
    from autopar.cost import Calibration, predict_memory

    cfg = GPTConfig(vocab_size=512, seq_len=256, num_layers=8, hidden_dim=256, num_heads=8)
    profile = _profile(cfg, batch=8)
    topo = Topology.from_spec("1xH100-SXM")

    def peak(**kw) -> float:  # the larger of eager's and compiled's (the search has both)
        return max(predict_memory(profile, Plan(micro_batch_size=64, precision="bf16", compile=c, **kw),
                                  Calibration()).peak_bytes for c in (False, True))

    def least(**kw) -> float:
        return min(predict_memory(profile, Plan(micro_batch_size=64, precision="bf16", compile=c, **kw),
                                  Calibration()).peak_bytes for c in (False, True))

    every_other, none = peak(checkpointing="selective", checkpoint_every=2), least()
    assert peak(checkpointing="selective") < every_other < none
    headroom = (every_other + none) / 2 / topo.device.memory_bytes  # selective of every other block fits, none not
    ranked = search(profile, topo, world_size=1, global_batch_size=64, headroom=headroom)
    feasible = [c for c in ranked if c.feasible]
    assert feasible and all(c.plan.checkpointing != "none" for c in feasible)
    best = feasible[0]
    assert best.plan.checkpoint_every > 1
    whole = [c for c in feasible if c.plan.checkpoint_every == 1]
    assert not whole or best.prediction.step_s < min(c.prediction.step_s for c in whole)
    # each partial plan tried stops at the first period that does not fit: none tried beyond it
    tried = [c.plan for c in ranked if c.plan.checkpoint_every > 1]
    assert tried and all(p.checkpoint_every in (2, 3, 4) for p in tried)
