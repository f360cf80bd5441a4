"""autopar.cost.memory on a tiny traced model: the allocator reserve that follows the largest tensor, and the
copies counted for an upcast largest tensor."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from autopar.cost import Calibration
from autopar.cost.memory import HOST_PROCESS_BYTES, predict_host_memory, predict_memory
from autopar.models.gpt import GPT, GPTConfig, lm_loss
from autopar.plans import Plan
from autopar.profile import profile_model

# The logits (vocabulary 1024 over hidden 32) are the largest tensor and a good share of the peak.
CFG = GPTConfig(vocab_size=1024, seq_len=64, num_layers=2, hidden_dim=32, num_heads=2)


@functools.lru_cache(maxsize=1)
def _profile():
    """Without the allocator's replay (which eager plans take instead: tests/cost/test_memory_any_model.py),
    so that the rule for the other plans is what these tests see."""
    torch.manual_seed(0)
    profile = profile_model(GPT(CFG), torch.randint(0, CFG.vocab_size, (2, CFG.seq_len)), loss_fn=lm_loss)
    return dataclasses.replace(profile, allocator_reserve_bytes=None)


def test_largest_reserve_factor_adds_the_largest_tensor_at_the_micro_batch_to_the_overhead():
    profile = _profile()
    assert profile.largest_transient_bytes >= 4 * CFG.vocab_size * CFG.seq_len * profile.sample_batch_size
    for micro_batch in (4, 8):
        plan = Plan(micro_batch_size=micro_batch)  # one GPU, fp32: no variants needed
        without = predict_memory(profile, plan, Calibration(largest_reserve_factor=0.0, reserve_bytes=0.0))
        with_ = predict_memory(profile, plan, Calibration(largest_reserve_factor=1.0, reserve_bytes=0.0))
        largest = profile.largest_transient_bytes * micro_batch / profile.sample_batch_size
        assert with_.overhead_bytes - without.overhead_bytes == pytest.approx(largest, rel=1e-9)
        assert with_.allocated_bytes == without.allocated_bytes  # a reserve, not an allocation
        half = predict_memory(profile, plan, Calibration(largest_reserve_factor=0.5, reserve_bytes=0.0))
        assert half.overhead_bytes - without.overhead_bytes == pytest.approx(largest / 2, rel=1e-9)
        # reserve_bytes is a floor: below it the largest tensor adds nothing, above it the larger one counts
        floor = predict_memory(profile, plan, Calibration(largest_reserve_factor=1.0, reserve_bytes=2 * largest))
        assert floor.overhead_bytes - without.overhead_bytes == pytest.approx(2 * largest, rel=1e-9)
        low = predict_memory(profile, plan, Calibration(largest_reserve_factor=1.0, reserve_bytes=largest / 2))
        assert low.overhead_bytes == pytest.approx(with_.overhead_bytes, rel=1e-9)


def test_upcast_transient_factor_replaces_transient_factor_when_the_largest_tensor_is_a_to_copy():
    # the moments' rule (a profile without the trace's live replay, which eager plans read when it has one)
    profile = dataclasses.replace(_profile(), live_frontier=())
    plan = Plan(micro_batch_size=8)  # no checkpointing: the peak is as backward starts, the logits alive
    cal = Calibration(transient_factor=1.0, upcast_transient_factor=2.0)
    upcast = predict_memory(dataclasses.replace(profile, largest_transient_op="_to_copy"), plan, cal)
    matmul = predict_memory(dataclasses.replace(profile, largest_transient_op="mm"), plan, cal)
    largest = profile.largest_transient_bytes * plan.micro_batch_size / profile.sample_batch_size
    assert matmul.transient_bytes == pytest.approx(1.0 * largest, rel=1e-9)
    assert upcast.transient_bytes == pytest.approx(2.0 * largest, rel=1e-9)
    assert upcast.activations_bytes == matmul.activations_bytes
    assert upcast.allocated_bytes - matmul.allocated_bytes == pytest.approx(largest, rel=1e-9)


def test_host_memory_of_an_offload_plan_is_each_ranks_fp32_states_shard_plus_the_allowance():
    """Under CPU offload a rank keeps its shard of fp32 weights (4 B), gradients (4 B) and Adam's two moments
    (8 B) per parameter in host memory; a node holds its ranks' shards and each process's allowance."""
    profile = _profile()
    params = profile.num_params  # every parameter trains: 16 bytes each
    offload = predict_host_memory(profile, Plan(dp_shard=4, micro_batch_size=1, cpu_offload=True), ranks_per_node=2)
    assert offload.offloaded_bytes_per_rank == pytest.approx(16 * params / 4, rel=1e-9)
    assert offload.node_bytes == pytest.approx(2 * (16 * params / 4 + HOST_PROCESS_BYTES), rel=1e-9)
    on_gpu = predict_host_memory(profile, Plan(dp_shard=4, micro_batch_size=1), ranks_per_node=2)
    assert on_gpu.offloaded_bytes_per_rank == 0 and on_gpu.node_bytes == 2 * HOST_PROCESS_BYTES
