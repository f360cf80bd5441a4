"""autopar.profile.allocator: the caching allocator's rules (segment sizes, best fit, splitting, merging) and
the replay of a training loop over a traced step. That the model reserves what CUDA reserves, request by
request, is tests/gpu/test_allocator.py (on the GPU)."""

from __future__ import annotations

import dataclasses

import pytest

from autopar.profile.allocator import CachingAllocator, ReplayedSteps, StepEvents, replay_steps

MiB = 1 << 20


def test_small_requests_share_a_2_mib_segment_in_512_byte_blocks():
    a = CachingAllocator()
    handles = [a.malloc(100) for _ in range(4096)]  # 4096 x 512 B = 2 MiB: one segment
    assert (a.reserved_bytes, a.allocated_bytes) == (2 * MiB, 2 * MiB)
    a.malloc(1)
    assert a.reserved_bytes == 4 * MiB
    for h in handles:
        a.free(h)
    assert a.allocated_bytes == 512 and a.reserved_bytes == 4 * MiB  # cached, never returned


def test_large_requests_under_10_mib_take_20_mib_segments_larger_ones_their_own_size():
    a = CachingAllocator()
    a.malloc(3 * MiB)
    assert a.reserved_bytes == 20 * MiB
    a.malloc(5 * MiB)  # from the first segment's 17 MiB remainder
    assert a.reserved_bytes == 20 * MiB
    a.malloc(11 * MiB)  # fits the 12 MiB left in that segment
    assert a.reserved_bytes == 20 * MiB
    a.malloc(13 * MiB + 1)  # a segment of its own, rounded up to 2 MiB
    assert a.reserved_bytes == 20 * MiB + 14 * MiB


def test_a_freed_block_is_reused_by_best_fit_and_split():
    a = CachingAllocator()
    big, other = a.malloc(100 * MiB), a.malloc(60 * MiB)
    a.free(big)
    a.free(other)
    a.malloc(50 * MiB)  # the 60 MiB block fits best: 10 MiB stay cached beside it
    assert a.reserved_bytes == 160 * MiB
    a.malloc(100 * MiB)  # the 100 MiB block, whole
    assert a.reserved_bytes == 160 * MiB
    a.malloc(10 * MiB)  # the 60 MiB segment's 10 MiB remainder
    assert a.reserved_bytes == 160 * MiB and a.allocated_bytes == 160 * MiB


def test_a_remainder_of_at_most_1_mib_is_not_split_off_a_large_block():
    a = CachingAllocator()
    h = a.malloc(20 * MiB)
    a.free(h)
    a.malloc(19 * MiB + 1)  # remainder under 1 MiB: the whole 20 MiB block is handed out
    assert a.allocated_bytes == 20 * MiB


def test_neighbouring_free_blocks_merge_so_a_larger_request_fits_again():
    a = CachingAllocator()
    first, second, third = a.malloc(30 * MiB), a.malloc(30 * MiB), a.malloc(30 * MiB)
    a.free(third)
    a.free(first)
    a.free(second)  # merges with both neighbours, but they are separate segments: no merge across them
    a.malloc(60 * MiB)
    assert a.reserved_bytes == 150 * MiB
    b = CachingAllocator()
    whole = b.malloc(90 * MiB)
    b.free(whole)
    parts = [b.malloc(30 * MiB) for _ in range(3)]  # one segment split in three
    for p in parts:
        b.free(p)
    b.malloc(90 * MiB)  # merged back into the one block
    assert b.reserved_bytes == 90 * MiB


def test_the_optimizer_state_made_after_the_first_step_fragments_the_cached_activations():
    # one 100 MiB activation freed in the step; two 30 MiB states then carve it; the next step's activation no
    # longer fits the remainder and a new segment is reserved: the reserve is the allocator's, not a factor
    step = StepEvents(sizes_bytes=(100 * MiB, 30 * MiB), events=((0, 1), (1, 1), (0, -1)), gradient_serials=frozenset({1}))
    replay = replay_steps(step, weight_bytes=[30 * MiB], state_bytes=[30 * MiB, 30 * MiB], batch_bytes=[])
    assert replay.peak_allocated_bytes == (30 + 30 + 60 + 100) * MiB  # weight, gradient, states, activation
    assert replay.peak_reserved_bytes == (30 + 30 + 100 + 100) * MiB  # the first activation's block held by states
    assert replay.reserve_bytes == 40 * MiB
    no_state = replay_steps(step, weight_bytes=[30 * MiB], state_bytes=[], batch_bytes=[])
    assert no_state.reserve_bytes == 0


def test_replayed_steps_validate_themselves():
    with pytest.raises(ValueError, match="below the allocated peak"):
        ReplayedSteps(peak_allocated_bytes=2, peak_reserved_bytes=1)


def test_an_empty_storage_holds_no_block():
    a = CachingAllocator()
    h = a.malloc(0)
    assert (a.allocated_bytes, a.reserved_bytes) == (0, 0)
    a.free(h)
    assert a.allocated_bytes == 0


def test_gradients_live_until_the_next_steps_zero_grad():
    # after the first step the 30 MiB gradient is still alive when the optimizer makes its 30 MiB state, so the
    # state carves the cached 100 MiB activation block, and the next step's activation needs a new segment;
    # had the gradient been freed with its step, the state would have taken the gradient's block exactly
    step = StepEvents(sizes_bytes=(100 * MiB, 30 * MiB), events=((0, 1), (1, 1), (0, -1)),
                      gradient_serials=frozenset({1}))
    kept = replay_steps(step, weight_bytes=[30 * MiB], state_bytes=[30 * MiB], batch_bytes=[])
    assert (kept.peak_allocated_bytes, kept.peak_reserved_bytes) == (190 * MiB, 260 * MiB)
    freed_with_step = dataclasses.replace(step, gradient_serials=frozenset())
    early = replay_steps(freed_with_step, weight_bytes=[30 * MiB], state_bytes=[30 * MiB], batch_bytes=[])
    assert early.reserve_bytes == 0 < kept.reserve_bytes
