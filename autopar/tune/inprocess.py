"""One trial in this process (autopar.autotune's runner): a fresh model wrapped with the plan, timed for a few
autopar.train_step steps, out of memory a failed trial, memory freed after.

    r = measure_in_process(lambda: MyModel(), sample, plan, loss_fn=loss_fn, steps=10, warmup=3)
    r.status, r.step_s, r.tokens_per_s
"""

from __future__ import annotations

import dataclasses
import gc
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .._util.batch import default_loss, map_tensors, sample_batch_size, to_device
from ..api import wrap
from ..planning import resolve_topology
from ..plans import Loop, Plan
from ..step import train_step
from ..topology import Topology


@dataclass(frozen=True)
class InProcessResult:
    """One in-process trial: the fields of a launched trial's TrialResult that the study reads."""

    status: str
    plan: Plan
    step_s: float | None = None
    tokens_per_s: float | None = None
    samples_per_s: float | None = None
    peak_allocated_bytes: tuple[int, ...] = ()
    peak_reserved_bytes: tuple[int, ...] = ()
    wall_s: float = 0.0
    cause: str | None = None
    returncode: int | None = None
    log_tail: str = ""


def single_device(topology: Topology | str | None) -> Topology:
    """The topology of one device of `topology` (autotune runs one process)."""
    topo = resolve_topology(topology)
    if topo.world_size == 1:
        return topo
    if topo.is_gpu:
        return dataclasses.replace(topo, num_nodes=1, devices_per_node=1, nvlink_pairs=None)
    return Topology.cpu(1)


def batch_of(sample: Any, n: int) -> Any:
    """`sample` repeated along dim 0 (and cut) to `n` samples."""
    have = sample_batch_size(sample)
    if have == n:
        return sample

    def grow(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] != have:
            return t
        reps = -(-n // have)
        return t.repeat(reps, *([1] * (t.dim() - 1)))[:n]

    return map_tensors(grow, sample)


def _cause(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500]


def measure_in_process(model_fn: Callable[[], Any], sample: Any, plan: Plan, *, loss_fn: Callable | None = None,
                       topology: Any = None, steps: int = 10, warmup: int = 3,
                       optimizer_fn: Callable[[Any], Any] | None = None, tokens_per_sample: int | None = None,
                       ) -> InProcessResult:
    """Build a fresh model, wrap it with `plan`, and time `steps` autopar.train_step steps after `warmup`
    on `sample` repeated to the plan's batch. Out of memory (torch.cuda.OutOfMemoryError, MemoryError) is
    "oom", any other exception "crash"; memory is freed after (del, gc, torch.cuda.empty_cache)."""
    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    model = optimizer = step = batch = None
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        model = model_fn()
        wrap(model, sample=sample, plan=plan, topology=topology, loss_fn=loss_fn, verbose=False, loop=Loop.TRAIN_STEP,
             global_batch_size=plan.global_batch_size)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = optimizer_fn(params) if optimizer_fn is not None else torch.optim.AdamW(params, lr=1e-4)
        # without loss_fn, the profile's own stand-in (output.loss, else a sum): the trial times the step
        step = train_step(model, optimizer, loss_fn or (lambda output, _batch: default_loss(output)))
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        batch = to_device(batch_of(sample, plan.local_batch_size), device)
        for _ in range(warmup):
            step(batch)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = step(batch)
        if cuda:
            torch.cuda.synchronize()
        if isinstance(loss, torch.Tensor):
            loss.detach().float().mean().item()  # the last step has finished
        step_s = (time.perf_counter() - t0) / steps
        samples = plan.global_batch_size / step_s
        peaks: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        if cuda:
            peaks = ((int(torch.cuda.max_memory_allocated()),), (int(torch.cuda.max_memory_reserved()),))
        return InProcessResult("ok", plan, step_s=step_s, samples_per_s=samples,
                               tokens_per_s=samples * tokens_per_sample if tokens_per_sample else None,
                               peak_allocated_bytes=peaks[0], peak_reserved_bytes=peaks[1],
                               wall_s=time.perf_counter() - started)
    except (torch.cuda.OutOfMemoryError, MemoryError) as exc:
        return InProcessResult("oom", plan, wall_s=time.perf_counter() - started, cause=_cause(exc))
    except Exception as exc:  # noqa: BLE001 - a plan that cannot run is a failed trial; the study goes on
        return InProcessResult("crash", plan, wall_s=time.perf_counter() - started, cause=_cause(exc))
    finally:
        del model, optimizer, step, batch
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
