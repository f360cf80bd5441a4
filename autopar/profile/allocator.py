"""A model of PyTorch's CUDA caching allocator, replayed over the traced step: the bytes it reserves beyond
the allocated peak (the reserve the cost model adds to what must fit on the GPU).

Why a model and not a factor: the reserve is the allocator's fragmentation, which depends on the order and
sizes of the step's allocations (measured on the H200 with the same recipe: 0.2 GiB for BART, 2.0 GiB for
BERT, 10.8 GiB for a Qwen2 shape; bench/results/zoo_h200_2026-12-01.jsonl). No ratio of one tensor fits
them; the allocator's own rules replayed over the trace's allocations can.

The rules, as c10/cuda/CUDACachingAllocator.cpp applies them with its default settings (no
PYTORCH_CUDA_ALLOC_CONF: no max_split_size, no expandable segments, no garbage collection threshold):
- a request is rounded up to a multiple of 512 bytes (kMinBlockSize);
- requests of at most 1 MiB (kSmallSize) use the small pool, the others the large pool;
- a request takes the smallest free cached block of its pool that is large enough (best fit, ties by
  address); the block is split when what remains is at least 512 bytes (small pool) or more than 1 MiB
  (large pool), the remainder staying cached;
- with no such block a segment is reserved (cudaMalloc): 2 MiB (kSmallBuffer) for a small request, 20 MiB
  (kLargeBuffer) for a request under 10 MiB (kMinLargeAlloc), else the request rounded up to 2 MiB
  (kRoundLarge);
- a freed block merges with free neighbours of its segment and stays cached: segments are never returned
  to the device (without memory pressure, which this model does not have).
Addresses are stood in for by (segment serial, offset in segment), which orders blocks as the allocator's
(size, address) sets do where segments are reserved at rising addresses.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable, Sequence

MIN_BLOCK_BYTES = 512  # kMinBlockSize: allocation granularity
SMALL_REQUEST_BYTES = 1 << 20  # kSmallSize: the largest request of the small pool
SMALL_SEGMENT_BYTES = 2 << 20  # kSmallBuffer: a small pool's segment
LARGE_SEGMENT_BYTES = 20 << 20  # kLargeBuffer: the segment of a large request under MIN_LARGE_ALLOC_BYTES
MIN_LARGE_ALLOC_BYTES = 10 << 20  # kMinLargeAlloc: large requests from here get segments of their own size
ROUND_LARGE_BYTES = 2 << 20  # kRoundLarge: the rounding of those segments


@dataclass
class _Block:
    segment: int
    offset: int
    size: int
    free: bool
    prev: "_Block | None" = None
    next: "_Block | None" = None

    def key(self) -> tuple[int, int, int]:
        return (self.size, self.segment, self.offset)


class CachingAllocator:
    """The caching allocator's bookkeeping without memory: `malloc` returns a handle for `free`; the
    allocated and reserved bytes and their peaks are kept as the allocator's statistics keep them."""

    def __init__(self) -> None:
        self._pools: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}  # small? -> sorted keys
        self._free_blocks: dict[tuple[int, int, int], _Block] = {}
        self._small_segment: dict[int, bool] = {}  # segment serial -> whether it belongs to the small pool
        self._handles: dict[int, _Block | None] = {}
        self._next_handle = 0
        self.allocated_bytes = self.reserved_bytes = 0
        self.peak_allocated_bytes = self.peak_reserved_bytes = 0
        self.requested_bytes = self.peak_requested_bytes = 0  # the bytes asked for, before rounding
        self._requested: dict[int, int] = {}

    def malloc(self, nbytes: int) -> int:
        """A handle for `nbytes`; an empty request (a 0-byte storage) holds no block, as in torch."""
        handle = self._next_handle
        self._next_handle += 1
        if nbytes == 0:
            self._handles[handle] = None
            return handle
        size = _rounded(nbytes)
        small = size <= SMALL_REQUEST_BYTES
        block = self._take_free(size, small) or self._new_segment(size, small)
        self._split(block, size, small)
        block.free = False
        self.allocated_bytes += block.size
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
        self.requested_bytes += nbytes
        self.peak_requested_bytes = max(self.peak_requested_bytes, self.requested_bytes)
        self._requested[handle] = nbytes
        self._handles[handle] = block
        return handle

    def free(self, handle: int) -> None:
        block = self._handles.pop(handle)
        if block is None:
            return
        self.requested_bytes -= self._requested.pop(handle)
        self.allocated_bytes -= block.size
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._unpool(neighbour)
                block = _merge(block, neighbour)
        self._pool(block)

    def _take_free(self, size: int, small: bool) -> _Block | None:
        pool = self._pools[small]
        at = bisect.bisect_left(pool, (size, -1, -1))
        if at == len(pool):
            return None
        block = self._free_blocks[pool[at]]
        self._unpool(block)
        return block

    def _new_segment(self, size: int, small: bool) -> _Block:
        if small:
            nbytes = SMALL_SEGMENT_BYTES
        elif size < MIN_LARGE_ALLOC_BYTES:
            nbytes = LARGE_SEGMENT_BYTES
        else:
            nbytes = -(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES
        segment = len(self._small_segment)
        self._small_segment[segment] = small
        self.reserved_bytes += nbytes
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        return _Block(segment, 0, nbytes, free=True)

    def _split(self, block: _Block, size: int, small: bool) -> None:
        remaining = block.size - size
        if (remaining < MIN_BLOCK_BYTES) if small else (remaining <= SMALL_REQUEST_BYTES):
            return
        rest = _Block(block.segment, block.offset + size, remaining, free=True, prev=block, next=block.next)
        if block.next is not None:
            block.next.prev = rest
        block.next, block.size = rest, size
        self._pool(rest)

    def _pool(self, block: _Block) -> None:
        key = block.key()
        self._free_blocks[key] = block
        bisect.insort(self._pools[self._small_segment[block.segment]], key)

    def _unpool(self, block: _Block) -> None:
        key = block.key()
        pool = self._pools[self._small_segment[block.segment]]
        del pool[bisect.bisect_left(pool, key)]
        del self._free_blocks[key]


def _rounded(nbytes: int) -> int:
    """A request's size in the allocator: at least 512 bytes, a multiple of 512 (round_size)."""
    return max(MIN_BLOCK_BYTES, -(-nbytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES)


def _merge(block: _Block, neighbour: _Block) -> _Block:
    """`block` and the free neighbour next to it in their segment, as one free block."""
    first, second = (neighbour, block) if neighbour.offset < block.offset else (block, neighbour)
    first.size += second.size
    first.next = second.next
    if second.next is not None:
        second.next.prev = first
    return first


@dataclass(frozen=True)
class ReplayedSteps:
    """The caching allocator over training steps replayed from a trace: peaks of allocated and reserved
    bytes, and of the bytes requested (before the allocator's rounding). `reserve_bytes`, what it holds beyond the
    requested peak, is what the cost model adds to its own (exact, unrounded) allocated bytes."""

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    peak_requested_bytes: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.peak_allocated_bytes <= self.peak_reserved_bytes:
            raise ValueError(f"the reserved peak ({self.peak_reserved_bytes} B) is below the allocated peak "
                             f"({self.peak_allocated_bytes} B)")

    @property
    def reserve_bytes(self) -> int:
        return self.peak_reserved_bytes - (self.peak_requested_bytes or self.peak_allocated_bytes)


@dataclass(frozen=True)
class StepEvents:
    """One traced step's allocations, for the replay: `sizes_bytes[serial]`, the events (serial, +1 allocated /
    -1 freed) in order, and the serials of the storages that end as gradients (kept until the next step's
    zero_grad; every other storage still alive at the end is freed with the step)."""

    sizes_bytes: Sequence[int]
    events: Sequence[tuple[int, int]]
    gradient_serials: frozenset[int]


def replay_steps(step: StepEvents, *, weight_bytes: Iterable[int], state_bytes: Iterable[int],
                 batch_bytes: Iterable[int], num_steps: int = 3) -> ReplayedSteps:
    """A training loop's steps through the allocator: the weights (and buffers) allocated first, one by one;
    then `num_steps` times: the previous gradients freed (zero_grad(set_to_none=True)), the batch allocated,
    the traced step, the batch and the step's leftovers freed, and after the first step the optimizer's state
    allocated (`state_bytes`, in order: AdamW's exp_avg and exp_avg_sq per trainable parameter)."""
    allocator = CachingAllocator()
    for nbytes in weight_bytes:
        allocator.malloc(nbytes)
    state = list(state_bytes)
    batch = list(batch_bytes)
    gradients: list[int] = []
    for index in range(num_steps):
        for handle in gradients:
            allocator.free(handle)
        batch_handles = [allocator.malloc(n) for n in batch]
        alive = _replay_one(allocator, step)
        gradients = [alive.pop(s) for s in step.gradient_serials if s in alive]
        for handle in [*alive.values(), *batch_handles]:
            allocator.free(handle)
        if index == 0:
            for nbytes in state:
                allocator.malloc(nbytes)
    return ReplayedSteps(allocator.peak_allocated_bytes, allocator.peak_reserved_bytes, allocator.peak_requested_bytes)


def _replay_one(allocator: CachingAllocator, step: StepEvents) -> dict[int, int]:
    """The step's events; returns serial -> handle of the storages still alive at its end."""
    alive: dict[int, int] = {}
    for serial, sign in step.events:
        if sign > 0:
            alive[serial] = allocator.malloc(step.sizes_bytes[serial])
        elif serial in alive:
            allocator.free(alive.pop(serial))
    return alive
