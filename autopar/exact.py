"""The exact memory check: one rank's training steps under a plan, traced in one process without memory.

    from autopar.exact import exact_memory
    m = exact_memory(lambda: MyModel(cfg), sample, plan)       # any world size, on this machine
    m.peak_bytes, m.by_category                                # the traced rank's allocated peak

How: a fake process group of the plan's world size stands in for the job (collectives do nothing and
every rank's shapes are this rank's), the model is built on the meta device and the plan applied to it
by autopar's own strategies (the same code as `wrap`), then inside FakeTensorMode its weights are
materialised, the optimizer built, and `steps` optimizer steps run through `autopar.train_step` under
torch's MemTracker, which counts every tensor the step allocates on the device: parameters, gradients,
optimizer state, activations, temporaries. No real memory is used: a 70B plan traces on a laptop.

What it measures is the allocated peak (`torch.cuda.max_memory_allocated()`); what it leaves out is what
the caching allocator reserves beyond it and the CUDA context (the analytic model's `overhead_bytes`),
and torch.compile's changes to what is saved (the check traces the eager step). On a CPU the check
replaces scaled_dot_product_attention by its flash-like stand-in (autopar.profile), since a GPU would
not keep the attention matrix; on a GPU machine it traces on a fake CUDA device.

These are private torch APIs (`torch.distributed._tools.mem_tracker`, `torch.testing._internal`'s fake
process group); they are imported behind a guard, and the analytic model works without them.
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from ._util.batch import default_loss, map_tensors
from .errors import ExactCheckUnavailable, PlanError
from .plans import Plan
from .profile import flash_like_attention, profile_model
from .step import train_step
from .strategies.apply import apply_plan, check_plan
from .strategies.mesh import build_mesh
from .strategies.state import attach
from .topology import Topology, resolve_topology

GiB = 2**30

# MemTracker's categories, renamed to the analytic model's parts.
_CATEGORIES = {"PARAM": "parameters", "BUFFER": "buffers", "GRAD": "gradients", "ACT": "activations",
               "TEMP": "temporaries", "OPT": "optimizer", "OTH": "other"}


@dataclass(frozen=True)
class ExactMemory:
    """The traced allocated peak of one rank, by what held the memory at that moment."""

    plan: Plan
    rank: int  # the traced rank (0: the first pipeline stage, the first of every group)
    peak_bytes: float  # allocated bytes at the peak; what torch.cuda.max_memory_allocated() reports
    by_category: Mapping[str, float] = field(default_factory=dict)  # bytes per category at the peak
    trace_s: float = 0.0  # seconds the check took

    def __post_init__(self) -> None:
        assert self.peak_bytes >= 0, "negative traced peak"

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in self.by_category.items() if v)
        return (f"exact check (rank {self.rank} of {self.plan.world_size}): peak {self.peak_bytes / GiB:.2f} GiB "
                f"allocated ({parts}; GiB), traced in {self.trace_s:.1f} s")


def _stand_in_loss(output: Any, _batch: Any) -> torch.Tensor:
    return default_loss(output)


def _imports() -> tuple[Any, Any, Any]:
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.distributed._tools.mem_tracker import MemTracker
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except Exception as exc:  # pragma: no cover - depends on the torch build
        raise ExactCheckUnavailable(
            f"the exact memory check needs torch's MemTracker and fake process group, missing here ({exc}); "
            "use the analytic prediction (autopar.predict) instead.") from exc
    return FakeTensorMode, MemTracker, FakeStore


def _fake_batch(sample: Any, batch_size: int, device: torch.device) -> Any:
    """`sample` with `batch_size` rows, as zeros on `device` (valid token ids, fake under FakeTensorMode)."""
    def grow(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return torch.zeros((), dtype=t.dtype, device=device)
        return torch.zeros((batch_size, *t.shape[1:]), dtype=t.dtype, device=device)

    return map_tensors(grow, sample)


def _build(model_fn: Callable[[], nn.Module] | nn.Module) -> nn.Module:
    if isinstance(model_fn, nn.Module):
        if any(not t.is_meta for t in list(model_fn.parameters()) + list(model_fn.buffers())):
            raise PlanError("exact_memory needs a model on the meta device (build it under torch.device('meta')), "
                            "or a function that builds it; a real model would be copied into memory.")
        return copy.deepcopy(model_fn)
    if not callable(model_fn):
        raise TypeError(f"model_fn must build the model (a callable) or be a meta-device nn.Module, got "
                        f"{type(model_fn).__name__}.")
    with torch.device("meta"):
        model = model_fn()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_fn must return an nn.Module, got {type(model).__name__}.")
    return model


def exact_memory(
    model_fn: Callable[[], nn.Module] | nn.Module,
    sample: Any,
    plan: Plan,
    *,
    topology: Topology | str | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    blocks: Any = None,
    rank: int = 0,
    steps: int = 2,
    optimizer_fn: Callable[[Any], torch.optim.Optimizer] | None = None,
    device: str | None = None,
) -> ExactMemory:
    """Trace `steps` training steps of `plan`'s rank `rank` and return its allocated peak, by category.

    `model_fn()` builds the model (called under the meta device; or pass a meta-device model). `sample` is
    one data-parallel rank's batch in its shape (any batch size: it is resized to the plan's local batch).
    `optimizer_fn(params)` builds the optimizer (default: AdamW, fused on a GPU, as autopar's cost model
    assumes). `device`: "cuda" or "cpu" (default: cuda when this machine has one). torch.compile is not
    traced (the check runs the eager step). Must run where no process group is initialised: it makes a
    fake one of the plan's world size, and removes it after.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    FakeTensorMode, MemTracker, FakeStore = _imports()
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be an autopar.Plan, got {type(plan).__name__}.")
    if not 0 <= rank < plan.world_size:
        raise ValueError(f"rank must be in [0, {plan.world_size}) for a plan of {plan.world_size} processes, got {rank}.")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}.")
    if dist.is_available() and dist.is_initialized():
        raise PlanError("exact_memory makes its own (fake) process group: call it before init_process_group, or in "
                        "a separate process (e.g. `autopar plan --verify N`, or a subprocess).")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    topo = resolve_topology(topology) if topology is not None else (
        Topology.from_spec(f"{plan.world_size}xH200") if dev.type == "cuda" else Topology.cpu(plan.world_size))
    exact_plan = plan.replace(compile=False, cuda_graphs=False, max_autotune=False,
                              cpu_offload=plan.cpu_offload)
    started = time.perf_counter()
    model = _build(model_fn)
    # graphs=False: dynamo's graph count only matters to a compiled plan's prediction, and this plan runs eager
    profile = profile_model(model, sample, loss_fn=loss_fn, blocks=blocks, warn=False, graphs=False)
    check_plan(exact_plan, profile, topo, world_size=plan.world_size, model=model)

    dist.init_process_group("fake", rank=rank, world_size=plan.world_size, store=FakeStore())
    flash = contextlib.ExitStack()
    if dev.type != "cuda":
        flash.enter_context(_patched_sdpa(flash_like_attention))
    if plan.pp > 1:
        flash.enter_context(_static_pipeline_warmup())
    try:
        mesh = build_mesh(exact_plan, dev.type)
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        applied = apply_plan(model, exact_plan, profile, topo, mesh=mesh, device=dev, fake_mode=fake)
        attach(model, applied)
        with fake, flash:
            params = [p for p in model.parameters() if p.requires_grad]
            if optimizer_fn is not None:
                optimizer = optimizer_fn(params)
            elif any(isinstance(p, DTensor) for p in params):  # sharded: AdamW's for-loop (one tensor at a time)
                optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=False)
            else:  # one process's tensors: fused AdamW, as autopar's cost model and most users run it
                optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
            # without loss_fn, the profile's own stand-in (output.loss, else a sum): a memory check, not training
            step = train_step(model, optimizer, loss_fn or _stand_in_loss)
            batch = _fake_batch(sample, plan.local_batch_size, dev)
            tracker = _tracker_class(MemTracker)()
            tracker.track_external(model, optimizer)
            with tracker:
                for i in range(steps):
                    step(batch)
                    if i == 0 and steps > 1:
                        tracker.reset_mod_stats()
                        _forget_peak(tracker)
            snapshot = tracker.get_tracker_snapshot("peak")
    finally:
        dist.destroy_process_group()
    per_device = [v for k, v in snapshot.items() if torch.device(k).type == dev.type]
    assert per_device, f"MemTracker saw no {dev.type} memory"
    parts = per_device[0]
    by_category: dict[str, float] = {}
    total = 0.0
    for key, value in parts.items():
        name = str(key)
        if name == "Total":
            total = float(value)
            continue
        short = name.rsplit(".", 1)[-1]
        by_category[_CATEGORIES.get(short, short.lower())] = float(value)
    return ExactMemory(plan=plan, rank=rank, peak_bytes=total, by_category=by_category,
                       trace_s=time.perf_counter() - started)


def _forget_peak(tracker: Any) -> None:
    """Forget the first step's peak; the next steps make it again. DTensor's sharding propagation runs its
    global-shape meta-ops under the check's own FakeTensorMode, and MemTracker counts them as allocations no
    GPU makes (about 85 MiB for a vocab-parallel head at micro-batch 4, at the forward's peak: 16 x TP 4 read
    20% high). Their results are cached, so only the first step has them, and every later step holds what
    the first holds plus the optimizer state. (MemTracker's private peak records, torch 2.11-2.14.)"""
    for name in ("_peak_mem", "_peak_mem_snap"):
        if isinstance(getattr(tracker, name, None), dict):
            setattr(tracker, name, {})


def _tracker_class(MemTracker: Any) -> Any:
    """MemTracker that lets the top module run several times in one step (micro-batches: accumulation and
    pipeline schedules call it once per micro-batch). MemTracker refuses that, as it keeps statistics per
    module call; the check needs only the global peak, so each new top-level call starts fresh statistics."""

    class _MicroBatchTracker(MemTracker):  # type: ignore[misc, valid-type]
        def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
            tracker = getattr(self, "_mod_tracker", None)
            if tracker is not None and module in self.memory_tracking and not tracker.is_bw:
                name = tracker.get_known_fqn(module)
                if set(tracker.parents) - {name} == {"Global"}:
                    del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

    return _MicroBatchTracker


@contextlib.contextmanager
def _static_pipeline_warmup():
    """Skip the pipeline schedule's first-step vote between neighbours (a real exchange whose answer is
    read with .item(), which fake tensors cannot give); the stages run with static shapes, as autopar
    builds them."""
    from torch.distributed.pipelining import schedules  # imported on use: alpha, and only pipeline plans need it

    base = getattr(schedules, "PipelineScheduleSingle", None)
    if base is None or not hasattr(schedules._PipelineSchedule, "_warmup_p2p"):
        yield  # older torch: the warm-up is the plain neighbour exchange, which the fake group answers
        return
    mode = getattr(getattr(schedules, "InferenceMode", None), "STATIC", None)

    def warmup(self: Any, stages: Any, has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            if mode is not None and hasattr(stage, "_inference_mode"):
                stage._inference_mode = mode

    with _replaced(schedules._PipelineSchedule, "_warmup_p2p", warmup):
        yield


@contextlib.contextmanager
def _replaced(owner: Any, name: str, value: Any):
    """`owner.name` is `value` inside the block, and what it was after it."""
    previous = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, previous)


@contextlib.contextmanager
def _patched_sdpa(replacement: Callable[..., torch.Tensor]):
    with _replaced(torch.nn.functional, "scaled_dot_product_attention", replacement):
        yield
