"""Pipeline parallelism over the plan's "pp" mesh axis, on the user's unmodified model.

The blocks are split into `pp x pp_stages_per_rank` contiguous stages balanced by the profile (each
block weighs its share of the step's FLOPs plus its share of the memory it holds: parameters and
activations; the embeddings count towards the first stage, the final norm, head and loss towards the
last). A rank keeps only the blocks of its own stages: the others become parameter-free pass-throughs
in the same container, so every kept parameter keeps its name. Modules that run before the blocks
(embeddings) are kept on the first stage's rank and replaced by shape-keeping placeholders elsewhere;
modules after the blocks (final norm, head) likewise on the last stage's rank.

A stage runs the model's own `forward` on the micro-batch (so masks, positions and anything else the
model computes around its blocks stay the model's business): its first block takes the activations
received from the previous stage instead of its input, blocks of other stages pass their input
through, and after the stage's last block the forward stops and the activations go to the next stage
(the last stage instead returns the loss). All ranks of a pipeline read the same samples, so every
stage has its micro-batch; the schedule only carries activations. torch.distributed.pipelining's
`PipelineStage` and schedules (GPipe, 1F1B, Interleaved1F1B, and a zero-bubble schedule) drive it.

A weight tied between the first and the last stage (an input embedding shared with the output head)
gets one copy per stage; `sync_tied_grads` sums their gradients over the stages after backward, so the
copies stay equal.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .._util.batch import split_sample, to_fp32_outputs
from ..errors import PlanError
from ..layout import MULTI_STAGE, block_costs, check_pipeline, split_stages, stage_ids  # noqa: F401 (re-exported)
from ..plans import Plan
from ..profile import ModelProfile
from .precision import weights_cast

# ---------------------------------------------------------------------------------------------------
# Running one stage of the user's model
# ---------------------------------------------------------------------------------------------------
class _StageExit(Exception):
    """Ends a stage's forward after its last block, carrying the activations for the next stage."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


class _PassThrough(nn.Module):
    """Stands in for a block of another rank's stage: returns its input (as the block would return it)."""

    def __init__(self, arity: int, block_input: str) -> None:
        super().__init__()
        self.arity = arity
        self.block_input = block_input

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _passthrough(self.block_input, self.arity, args, kwargs)


def _hidden_of(block_input: str, args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if block_input == "arg0" else kwargs[block_input.split(":", 1)[1]]


def _passthrough(block_input: str, arity: int, args: tuple, kwargs: dict) -> Any:
    hidden = _hidden_of(block_input, args, kwargs)
    return hidden if arity == 0 else (hidden,) + (None,) * (arity - 1)


class _StandIn(nn.Module):
    """A module a pipeline stage holds in place of another stage's: an attribute of the module it stands for (a
    weight read outside its call, `h @ self.tok.weight.t()`; a child called directly, `self.embed.patch(x)`) is not
    here, and reading it says so in one line, not "'_Placeholder' object has no attribute 'weight'"."""

    stands_for = "a module"
    where = "on another stage"

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("__"):
                raise
            raise AttributeError(  # (stands_for and where are class attributes: found without __getattr__)
                f"autopar: under pipeline parallelism this rank does not hold {self.stands_for} ({self.where}), and "
                f"the forward reads its {name!r} outside its call: the model is not a chain of blocks a pipeline "
                "splits; pass a plan with pp=1") from None


class _Placeholder(_StandIn):
    """Stands in for a module that runs before the blocks on a rank without the first stage: produces a
    tensor of the right shape and dtype (its values are never used: the stage's first block takes the
    received activations instead)."""

    def __init__(self, kind: str, dim: int | None, dtype: torch.dtype, stands_for: str = "a module") -> None:
        super().__init__()
        self.kind, self.dim, self.dtype = kind, dim, dtype
        self.stands_for, self.where = stands_for, "it runs before the blocks, on the first stage"

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.kind == "embedding":
            return torch.zeros((*x.shape, self.dim), dtype=self.dtype, device=x.device)
        if self.kind == "linear":
            return torch.zeros((*x.shape[:-1], self.dim), dtype=x.dtype, device=x.device)
        return x


def _placeholder_for(module: nn.Module, name: str = "a module") -> nn.Module:
    weight = getattr(module, "weight", None)
    dtype = weight.dtype if isinstance(weight, torch.Tensor) else torch.float32
    if isinstance(module, nn.Embedding):
        return _Placeholder("embedding", module.embedding_dim, dtype, name)
    if isinstance(module, nn.Linear):
        return _Placeholder("linear", module.out_features, dtype, name)
    return _Placeholder("identity", None, dtype, name)


@dataclass
class _Active:
    """The stage running now on this rank."""

    stage: "PipelineStageModule"
    injected: torch.Tensor | None


@dataclass
class PipelineRuntime:
    """Per-rank pipeline state: the model, this rank's stages, the micro-batches of the step in flight."""

    model: nn.Module
    plan: Plan
    profile: ModelProfile
    stage_blocks: dict[int, tuple[int, ...]]  # stage id -> block indices, for this rank's stages
    num_stages: int
    block_names: tuple[str, ...]
    tied_groups: list[tuple[str, ...]] = field(default_factory=list)  # names synced over the pipeline
    tied_group_pg: Any = None
    active: _Active | None = None
    microbatches: list[Any] = field(default_factory=list)
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    stages: list["PipelineStageModule"] = field(default_factory=list)
    schedule: Any = None
    autocast: tuple[str, str] | None = None  # (device type, precision) when stages run under autocast
    bf16_weights: tuple[str, ...] = ()  # under bf16 autocast: the weights it does not reach, read in bf16
    device: torch.device = torch.device("cpu")
    boundary_dtype: torch.dtype = torch.float32  # activations between stages


def _index_of(index: torch.Tensor) -> int:
    """The micro-batch index a stage received; 0 under the exact memory check's fake tensors (which hold no
    values; every micro-batch has the same shapes, so which one runs does not change the memory)."""
    from torch._subclasses.fake_tensor import is_fake

    return 0 if is_fake(index) else int(index.reshape(-1)[0].item())


class PipelineStageModule(nn.Module):
    """The module torch's PipelineStage runs for one stage: the user's model, gated to this stage's blocks."""

    def __init__(self, runtime: PipelineRuntime, stage_id: int, parts: Sequence[nn.Module]) -> None:
        super().__init__()
        object.__setattr__(self, "runtime", runtime)  # not a child: the model's names stay the model's
        self.stage_id = stage_id
        self.blocks = tuple(runtime.stage_blocks[stage_id])
        self.is_first = stage_id == 0
        self.is_last = stage_id == runtime.num_stages - 1
        self.parts = nn.ModuleList(parts)  # this stage's modules, so that parameters() is the stage's

    def forward(self, *inputs: torch.Tensor) -> Any:
        # First stage: (micro-batch index,); later stages: (activations, micro-batch index). The index
        # travels with the activations, so every stage knows which micro-batch it is running.
        hidden, index = (None, inputs[0]) if self.is_first else inputs
        out = self._run(_index_of(index), hidden)
        return out if self.is_last else (out.to(self.runtime.boundary_dtype), index.detach())

    def _run(self, index: int, injected: torch.Tensor | None) -> torch.Tensor:
        rt = self.runtime
        x = injected
        sample = rt.microbatches[index]
        rt.active = _Active(stage=self, injected=x)
        device_type, precision = rt.autocast or ("cpu", "fp32")
        try:
            args, kwargs = split_sample(sample)
            bf16 = precision == "bf16"
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16), \
                    weights_cast(rt.model, rt.bf16_weights if bf16 else (), torch.bfloat16):
                output = rt.model(*args, **kwargs)
        except _StageExit as done:
            return done.hidden
        finally:
            rt.active = None
        output = to_fp32_outputs(output)
        if not self.is_last:
            raise RuntimeError(f"pipeline stage {self.stage_id} ran past its last block")  # invariant
        loss = rt.loss_fn(output, sample)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise PlanError("loss_fn must return a scalar tensor (the mean loss of the micro-batch).")
        # The schedule sums micro-batch losses' gradients; dividing here makes them a mean.
        return (loss / len(rt.microbatches)).reshape(1)


def _gate(rt: PipelineRuntime, index: int, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A kept block's forward: run it in its own stage, pass the input through in another."""
    active = rt.active
    if active is None:
        raise PlanError("this model runs a pipeline-parallel plan: drive it with autopar.train_step, not model(x).")
    if index not in active.stage.blocks:
        return _passthrough(rt.profile.block_input, rt.profile.block_output_arity, args, kwargs)
    return forward(*args, **kwargs)


def _inject_hook(rt: PipelineRuntime, index: int, module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """Before every other pre-forward hook of the stage's first block: take the received activations."""
    active = rt.active
    if active is None or active.injected is None or index != active.stage.blocks[0]:
        return None
    block_input = rt.profile.block_input
    if block_input == "arg0":
        return (active.injected,) + tuple(args[1:]), kwargs
    return args, dict(kwargs, **{block_input.split(":", 1)[1]: active.injected})


def _exit_hook(rt: PipelineRuntime, index: int, module: nn.Module, args: Any, output: Any) -> None:
    """After the stage's last block (and after FSDP's own post-forward hook): hand the activations on."""
    active = rt.active
    if active is not None and not active.stage.is_last and index == active.stage.blocks[-1]:
        hidden = output if isinstance(output, torch.Tensor) else output[0]
        raise _StageExit(hidden)


def apply_pipeline_split(model: nn.Module, plan: Plan, profile: ModelProfile, pp_rank: int) -> PipelineRuntime:
    """Keep only this rank's stages of `model` (step 2 of the order of application); returns the runtime."""
    num_stages = plan.pp * plan.pp_stages_per_rank
    split = split_stages(profile, num_stages)
    mine = stage_ids(plan, pp_rank)
    owned = {i for s in mine for i in split[s]}
    block_names = tuple(b.name for b in profile.blocks)
    for index, name in enumerate(block_names):
        if index not in owned:
            parent, _, attr = name.rpartition(".")
            _set_child(model, parent, attr, _PassThrough(profile.block_output_arity, profile.block_input))
    hosts_first, hosts_last = 0 in mine, num_stages - 1 in mine
    tied = [g for g in profile.tied_params if _spans(g, profile)]
    for name in profile.modules_before_blocks:
        if not hosts_first:
            parent, _, attr = name.rpartition(".")
            _set_child(model, parent, attr, _placeholder_for(model.get_submodule(name), name))
    for name in profile.modules_after_blocks:
        if not hosts_last:
            parent, _, attr = name.rpartition(".")
            _set_child(model, parent, attr, _PlaceholderAfter(name))
    # A weight shared by modules before and after the blocks: one copy per module, kept equal.
    for group in tied:
        present = [n for n in group if _has_param(model, n)]
        for n in present[1:]:
            owner, _, attr = n.rpartition(".")
            module = model.get_submodule(owner)
            param = getattr(module, attr)
            setattr(module, attr, nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad))
    return PipelineRuntime(model=model, plan=plan, profile=profile, num_stages=num_stages,
                           stage_blocks={s: split[s] for s in mine}, block_names=block_names, tied_groups=tied)


class _PlaceholderAfter(_StandIn):
    """Stands in for a module after the blocks on a rank without the last stage (never reached)."""

    def __init__(self, stands_for: str = "a module") -> None:
        super().__init__()
        self.stands_for, self.where = stands_for, "it runs after the blocks, on the last stage"

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - the stage exits before
        raise RuntimeError("a pipeline stage ran past its last block")


def _spans(group: Sequence[str], profile: ModelProfile) -> bool:
    modules = {n.rpartition(".")[0] for n in group}
    return bool(modules & set(profile.modules_before_blocks)) and bool(modules & set(profile.modules_after_blocks))


def _has_param(model: nn.Module, name: str) -> bool:
    try:
        model.get_parameter(name)
        return True
    except AttributeError:
        return False


def _set_child(model: nn.Module, parent: str, attr: str, module: nn.Module) -> None:
    owner = model.get_submodule(parent) if parent else model
    if isinstance(owner, (nn.ModuleList, nn.Sequential)):
        owner[int(attr)] = module
    else:
        setattr(owner, attr, module)


def install_stage_gates(model: nn.Module, rt: PipelineRuntime) -> None:
    """Gate the kept blocks (outermost, after checkpointing and compile) and hook the stages' exits.

    Call after FSDP, so that the exit hook runs after FSDP's post-forward hook."""
    named = dict(model.named_modules())
    owned = sorted({i for blocks in rt.stage_blocks.values() for i in blocks})
    for index in owned:
        block = named[rt.block_names[index]]
        block.forward = functools.partial(_gate, rt, index, block.forward)
        block.register_forward_pre_hook(functools.partial(_inject_hook, rt, index), prepend=True, with_kwargs=True)
        block.register_forward_hook(functools.partial(_exit_hook, rt, index))


def build_schedule(model: nn.Module, rt: PipelineRuntime, pp_mesh: DeviceMesh, device: torch.device) -> None:
    """torch.distributed.pipelining stages and the plan's schedule, kept on the runtime."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules

    named = dict(model.named_modules())
    group = pp_mesh.get_group()
    rt.device = device
    for stage_id in sorted(rt.stage_blocks):
        parts = [named[rt.block_names[i]] for i in rt.stage_blocks[stage_id]]
        if stage_id == 0:
            parts += [named[n] for n in rt.profile.modules_before_blocks if n in named]
        if stage_id == rt.num_stages - 1:
            parts += [named[n] for n in rt.profile.modules_after_blocks if n in named]
        module = PipelineStageModule(rt, stage_id, parts)
        rt.stages.append(module)
    # Static shapes (no inference run): activations (micro-batch, ...) in boundary_dtype, and the index.
    n = rt.plan.grad_accum
    rt.boundary_dtype = torch.bfloat16 if rt.plan.precision == "bf16" and rt.plan.uses_fsdp else torch.float32
    shape = (rt.plan.micro_batch_size, *rt.profile.block_input_shape[1:])
    hidden = torch.empty(shape, dtype=rt.boundary_dtype, device=device)
    index = torch.empty((1, 1), dtype=torch.float32, device=device)
    received = hidden.clone().requires_grad_(True)  # its gradient goes back to the previous stage
    stages = []
    for m in rt.stages:
        inputs = (index,) if m.is_first else (received, index)
        outputs = torch.empty((1,), dtype=torch.float32, device=device) if m.is_last else (received, index)
        stages.append(PipelineStage(m, m.stage_id, rt.num_stages, device, input_args=inputs, output_args=outputs,
                                    group=group))
    loss = _schedule_loss
    name = rt.plan.pp_schedule
    if name == "gpipe":
        rt.schedule = schedules.ScheduleGPipe(stages[0], n, loss_fn=loss, scale_grads=False)
    elif name == "1f1b":
        rt.schedule = schedules.Schedule1F1B(stages[0], n, loss_fn=loss, scale_grads=False)
    elif name == "interleaved_1f1b":
        rt.schedule = schedules.ScheduleInterleaved1F1B(stages, n, loss_fn=loss, scale_grads=False)
    elif name == "zero_bubble":
        if rt.plan.pp_stages_per_rank == 2 and hasattr(schedules, "ScheduleZBVZeroBubble"):
            rt.schedule = schedules.ScheduleZBVZeroBubble(stages, n, loss_fn=loss, scale_grads=False)
        else:
            rt.schedule = schedules.ScheduleInterleavedZeroBubble(stages, n, loss_fn=loss, scale_grads=False)
    else:  # pragma: no cover - Plan validates the name
        raise PlanError(f"unknown pipeline schedule {name!r}")
    if rt.tied_groups:
        rt.tied_group_pg = _tied_group(pp_mesh, rt)


def _schedule_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The last stage already returns the (scaled) loss of its micro-batch."""
    return output.sum()


def _tied_group(pp_mesh: DeviceMesh, rt: PipelineRuntime) -> Any:
    """This rank's process group of the pipeline ranks holding the first and the last stage."""
    ids = _all_stage_ids(rt)
    first_rank = next(i for i, stages in enumerate(ids) if 0 in stages)
    last_rank = next(i for i, stages in enumerate(ids) if rt.num_stages - 1 in stages)
    if first_rank == last_rank:
        return None
    mine = None
    # Every rank creates every group (new_group is collective), in the same order.
    for row in _all_pp_rows(pp_mesh):
        pg = dist.new_group([row[first_rank], row[last_rank]])
        if dist.get_rank() in (row[first_rank], row[last_rank]):
            mine = pg
    return mine


def _all_stage_ids(rt: PipelineRuntime) -> list[tuple[int, ...]]:
    return [stage_ids(rt.plan, r) for r in range(rt.plan.pp)]


def _all_pp_rows(pp_mesh: DeviceMesh) -> list[list[int]]:
    """Global ranks of every pipeline group (one per data/tensor-parallel coordinate), in a fixed order."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # the mesh holds real rank numbers, also under the exact check's fake mode
        return _pp_rows(pp_mesh)


def _pp_rows(pp_mesh: DeviceMesh) -> list[list[int]]:
    root = pp_mesh._get_root_mesh() if hasattr(pp_mesh, "_get_root_mesh") else None
    if root is None or root.mesh_dim_names is None or "pp" not in root.mesh_dim_names:
        return [pp_mesh.mesh.tolist()]
    full = root.mesh
    axis = root.mesh_dim_names.index("pp")
    moved = full.movedim(axis, -1).reshape(-1, full.shape[axis])
    return [row.tolist() for row in moved]


def sync_tied_grads(rt: PipelineRuntime) -> None:
    """Sum the gradients of a weight's copies (first and last stage) and give each copy the sum."""
    model = rt.model
    for group in rt.tied_groups:
        params = list({id(p): p for p in (model.get_parameter(n) for n in group if _has_param(model, n))}.values())
        if not params:
            continue
        for p in params:  # gradients laid out as their parameters (a DTensor's gradient may come replicated)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif hasattr(p.grad, "placements") and tuple(p.grad.placements) != tuple(p.placements):
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params]
        total = torch.stack(local).sum(0) if len(local) > 1 else local[0].clone()
        if rt.tied_group_pg is not None:
            dist.all_reduce(total, group=rt.tied_group_pg)
        for target in local:
            target.copy_(total)


__all__ = ["PipelineRuntime", "PipelineStageModule", "apply_pipeline_split", "build_schedule", "check_pipeline",
           "install_stage_gates", "split_stages", "stage_ids", "sync_tied_grads"]
