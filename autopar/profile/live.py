"""Bytes alive during the traced step (LiveMemory): the eager step's memory peak, read from the fake trace.

Fake tensors live and die as real ones do: autograd frees a saved tensor once its node has run, Python frees
a temporary when its last reference goes. A finalizer on each storage the step creates (never the weights)
therefore replays the caching allocator's allocated bytes op by op. The weights' casts (autocast's bf16
copies) are recorded too, in a sum of their own; the allocator's replay (autopar.profile.allocator) takes every
storage. The replay keeps three sums, everything but weights and gradients (activations, transients, the loss's
buffers), the gradients (the storages that end as a parameter's `.grad`) and the weights' casts, and the step's
peak is reported as their Pareto frontier: each point is (other bytes, gradient bytes, cast bytes) at one
moment, and no kept point is below another in all three. The cost model scales the first sum with the
micro-batch, the second with the plan's sharding, takes the third as it is where the plan casts as autocast does
(a bf16 copy of a weight lives from its first use in forward until its GEMMs' backward has run, so under
autocast the copies and the gradients are never all alive at once), and takes the largest point
(autopar.cost.memory).
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch

from .allocator import StepEvents

Frontier = tuple[tuple[int, int, int | None], ...]  # (other, gradient, weight-cast) bytes at moments that can peak;
# a cast figure of None only in a profile read back from before casts were summed apart (ModelProfile.from_dict)


class LiveMemory:
    """The storages the traced step allocates, when each is freed, and which of them end as gradients."""

    def __init__(self) -> None:
        self._serial_of: dict[int, int] = {}  # storage cdata -> serial, while alive (cdata can be reused later)
        self._bytes: list[int] = []  # serial -> bytes
        self._events: list[tuple[int, int]] = []  # (serial, +1 allocated / -1 freed), in order
        self._labels: list[tuple[str, tuple[int, ...], str]] = []  # serial -> (op, shape, dtype): what it was
        self._casts: set[int] = set()  # serials of the weights' casts (autocast's bf16 copies): a sum of their own

    @property
    def num_allocations(self) -> int:
        return len(self._bytes)

    def allocated(self, t: torch.Tensor, op: str, *, counted: bool = True) -> None:
        """`t` is the output of `op` (its name): records its storage once, and arranges to see it freed.
        `counted=False`: a cast of the weights, which the frontier sums apart (the cost model counts casts only
        where the plan casts as the trace did) and the allocator's replay takes in."""
        storage = t.untyped_storage()
        cdata = storage._cdata
        if cdata in self._serial_of:
            return
        serial = len(self._bytes)
        if not counted:
            self._casts.add(serial)
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
        """The Pareto frontier of (other, gradient, weight-cast) live bytes over the step; `gradients`: the
        parameters' `.grad` after backward (alive, so their storages are known by their serials now)."""
        grads = self._serials(gradients)
        sums = [0, 0, 0]  # other, gradients, casts
        points: list[tuple[int, int, int]] = []
        rising = False  # within a run of allocations every sum only grows: its last moment covers the others
        for serial, sign in self._events:
            if sign < 0 and rising:
                points.append((sums[0], sums[1], sums[2]))
            rising = sign > 0
            which = 2 if serial in self._casts else 1 if serial in grads else 0
            sums[which] += sign * self._bytes[serial]
        if rising:
            points.append((sums[0], sums[1], sums[2]))
        return _pareto(points)

    def step_events(self, gradients: Iterable[torch.Tensor]) -> StepEvents:
        """Every storage of the step, the weights' casts included, for the caching allocator's replay
        (autopar.profile.allocator); `gradients` as for `frontier`."""
        return StepEvents(tuple(self._bytes), tuple(self._events), frozenset(self._serials(gradients)))

    def _serials(self, tensors: Iterable[torch.Tensor]) -> set[int]:
        """The serials of these tensors' storages, where alive and recorded."""
        cdatas = (t.untyped_storage()._cdata for t in tensors if t.layout == torch.strided)  # (not a sparse one)
        return {self._serial_of[c] for c in cdatas if c in self._serial_of}

    def peak_contents(self) -> list[tuple[tuple[str, tuple[int, ...], str], int, int]]:
        """What is alive at the step's peak of all live bytes: (op, shape, dtype), count, bytes; largest first
        (for reading a prediction, bench/memory_peak.py)."""
        alive: dict[int, int] = {}
        peak, at_peak, total = 0, {}, 0
        for serial, sign in self._events:
            if serial in self._casts:
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


def _pareto(points: list[tuple[int, int, int]]) -> Frontier:
    """The points no other point matches or exceeds in every coordinate, by decreasing first coordinate. Taken
    in that order a point can only be covered by one kept before it, so each is checked against the kept ones
    (the frontier is far smaller than the points: frontier() keeps only each run of allocations' last moment)."""
    kept: list[tuple[int, int, int]] = []
    for point in sorted(set(points), reverse=True):
        if not any(k[1] >= point[1] and k[2] >= point[2] for k in kept):
            kept.append(point)
    return tuple(kept)
