"""Bytes alive during the traced step (LiveMemory): the eager step's memory peak, read from the fake trace.

Fake tensors live and die as real ones do: autograd frees a saved tensor once its node has run, Python frees
a temporary when its last reference goes. A finalizer on each storage the step creates (never the weights)
therefore replays the caching allocator's allocated bytes op by op. The weights' casts (autocast's bf16
copies) are recorded too, but left out of the sums below (the cost model counts them with the weights); the
allocator's replay (autopar.profile.allocator) takes every storage. The replay keeps two sums, the gradients (the
storages that end as a parameter's `.grad`) and everything else (activations, transients, the loss's
buffers), and the step's peak is reported as their Pareto frontier: each point is (other bytes, gradient
bytes) at one moment, and no kept point is below another in both. The cost model scales the first sum with
the micro-batch and the second with the plan's sharding, and takes the largest point (autopar.cost.memory).
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch

from .allocator import StepEvents

Frontier = tuple[tuple[int, int], ...]  # (non-gradient bytes, gradient bytes) at the moments that can peak


class LiveMemory:
    """The storages the traced step allocates, when each is freed, and which of them end as gradients."""

    def __init__(self) -> None:
        self._serial_of: dict[int, int] = {}  # storage cdata -> serial, while alive (cdata can be reused later)
        self._bytes: list[int] = []  # serial -> bytes
        self._events: list[tuple[int, int]] = []  # (serial, +1 allocated / -1 freed), in order
        self._labels: list[tuple[str, tuple[int, ...], str]] = []  # serial -> (op, shape, dtype): what it was
        self._uncounted: set[int] = set()  # serials of the weights' casts: allocated, but counted with the weights

    @property
    def num_allocations(self) -> int:
        return len(self._bytes)

    def allocated(self, t: torch.Tensor, op: str, *, counted: bool = True) -> None:
        """`t` is the output of `op` (its name): records its storage once, and arranges to see it freed.
        `counted=False`: a cast of the weights, which the frontier leaves out (the cost model counts it with the
        weights) and the allocator's replay takes in."""
        storage = t.untyped_storage()
        cdata = storage._cdata
        if cdata in self._serial_of:
            return
        serial = len(self._bytes)
        if not counted:
            self._uncounted.add(serial)
        self._serial_of[cdata] = serial
        self._bytes.append(int(storage.nbytes()))
        self._labels.append((op, tuple(t.shape), str(t.dtype).replace("torch.", "")))
        self._events.append((serial, 1))
        weakref.finalize(storage, self._freed, cdata, serial).atexit = False  # nothing to count at exit

    def _freed(self, cdata: int, serial: int) -> None:
        if self._serial_of.get(cdata) == serial:
            del self._serial_of[cdata]
        self._events.append((serial, -1))

    def frontier(self, gradients: Iterable[torch.Tensor]) -> Frontier:
        """The Pareto frontier of (non-gradient, gradient) live bytes over the step; `gradients`: the
        parameters' `.grad` after backward (alive, so their storages are known by their serials now)."""
        grads = self._serials(gradients)
        other = grad = 0
        points: list[tuple[int, int]] = []
        for serial, sign in self._events:
            if serial in self._uncounted:
                continue
            if serial in grads:
                grad += sign * self._bytes[serial]
            else:
                other += sign * self._bytes[serial]
            if sign > 0:
                points.append((other, grad))
        return _pareto(points)

    def step_events(self, gradients: Iterable[torch.Tensor]) -> StepEvents:
        """Every storage of the step, the weights' casts included, for the caching allocator's replay
        (autopar.profile.allocator); `gradients` as for `frontier`."""
        return StepEvents(tuple(self._bytes), tuple(self._events), frozenset(self._serials(gradients)))

    def _serials(self, tensors: Iterable[torch.Tensor]) -> set[int]:
        """The serials of these tensors' storages, where alive and recorded."""
        cdatas = (t.untyped_storage()._cdata for t in tensors)
        return {self._serial_of[c] for c in cdatas if c in self._serial_of}

    def peak_contents(self) -> list[tuple[tuple[str, tuple[int, ...], str], int, int]]:
        """What is alive at the step's peak of all live bytes: (op, shape, dtype), count, bytes; largest first
        (for reading a prediction, bench/memory_peak.py)."""
        alive: dict[int, int] = {}
        peak, at_peak, total = 0, {}, 0
        for serial, sign in self._events:
            if serial in self._uncounted:
                continue
            if sign > 0:
                alive[serial] = self._bytes[serial]
                total += self._bytes[serial]
                if total > peak:
                    peak, at_peak = total, dict(alive)
            else:
                total -= alive.pop(serial, 0)
        groups: dict[tuple[str, tuple[int, ...], str], list[int]] = {}
        for serial, nbytes in at_peak.items():
            entry = groups.setdefault(self._labels[serial], [0, 0])
            entry[0] += 1
            entry[1] += nbytes
        return sorted(((k, n, b) for k, (n, b) in groups.items()), key=lambda item: -item[2])


def _pareto(points: list[tuple[int, int]]) -> Frontier:
    """The points no other point matches or exceeds in both coordinates, by decreasing first coordinate."""
    kept: list[tuple[int, int]] = []
    best_second = -1
    for first, second in sorted(set(points), key=lambda p: (-p[0], -p[1])):
        if second > best_second:
            kept.append((first, second))
            best_second = second
    return tuple(kept)
