"""Apply a Plan to a model, in the one valid order (as torchtitan's parallelize does it):

  0. check the plan against the model and the hardware (every refusal says what to change), before
     anything is changed
  1. float8 swap (Plan.float8): the blocks' large nn.Linear layers become torchao's Float8Linear, before
     anything wraps or shards them (FSDP2 then shards their weights like any other)
  2. pipeline split: keep this rank's stages; other blocks become pass-throughs (before everything
     else, so that later steps only touch what this rank keeps)
  3. tensor parallel (+ sequence parallel) over the "tp" axis: shards the kept blocks' weights as
     DTensors, which FSDP then shards further over the data-parallel axes
  4. activation checkpointing, per block: wraps the block's forward, so it must come before compile
     (the checkpoint becomes part of the compiled graph) and before FSDP (whose hooks wrap the call)
  5. torch.compile of each block's forward under FSDP or PP (module hooks stay outside the graphs),
     of the whole model otherwise
  6. FSDP2 `fully_shard` per block, then the root (under PP: the modules around the blocks, each its
     own unit, since a stage's forward stops early), with the MixedPrecisionPolicy; this also moves
     the parameters to the mesh's device
  7. materialise a meta-device model (`to_empty` + its own init; tied weights tied again), then broadcast
     every data-parallel replica's values from the first (`replicas.py`)
  8. without FSDP: move to the device, compile the whole forward (step 5's other case), and bf16 through
     autocast around the (compiled) forward
  9. pipeline: gate the kept blocks (outermost, after FSDP's hooks) and build the schedule
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .._util.dist import backend as _backend
from .._util.dist import ensure_single_process_group, world
from .._util.kv_cache import kv_cache_off_in_training
from .._util.own_checkpointing import turn_own_checkpointing_off
from ..errors import PlanError
from ..layout import float8_layers, gradient_hook_refusal, plan_refusal, sequence_parallel_refusal
from ..plans import Plan
from ..profile import ModelProfile, hooked_parameters, iter_block_modules
from ..topology import Topology
from .checkpointing import apply_checkpointing
from .compile import apply_compile, cuda_graphs_refusal, default_backend, max_autotune_refusal
from .float8 import apply_float8, float8_all_gather_refusal, float8_refusal
from .fsdp import apply_fsdp, contiguous_weights, give_no_sync
from .full_load import apply_full_load
from .materialize import materialize
from .mesh import data_shard, dp_mesh
from .pipeline import _PassThrough, apply_pipeline_split, build_schedule, check_pipeline, install_stage_gates
from .precision import apply_autocast, present_weights
from .replicas import broadcast_replicas
from .state import Applied
from .tensor_parallel import apply_tensor_parallel, check_tensor_parallel
from .unused import Unused, apply_unused, find_unused


def check_plan(plan: Plan, profile: ModelProfile, topology: Topology, *, world_size: int,
               model: nn.Module | None = None) -> None:
    """Raise a PlanError if `plan` cannot run on this model and hardware, saying what to change."""
    plan.check_world(world_size)
    if plan.checkpointing != "none" and not profile.blocks:
        raise PlanError(
            f"checkpointing={plan.checkpointing!r} needs blocks to checkpoint, and {profile.model_class} has none "
            "(no repeated layers, no top-level children with parameters): set checkpointing='none', or pass "
            "blocks= naming the layers."
        )
    if plan.tp > 1:
        if topology.devices_per_node and plan.tp > topology.devices_per_node:
            raise PlanError(
                f"tp={plan.tp} spans more than one node ({topology.devices_per_node} "
                f"device{'s' if topology.devices_per_node != 1 else ''} per node): tensor "
                "parallelism communicates in every layer and stays within a node; lower tp."
            )
        why = sequence_parallel_refusal(profile) if plan.sequence_parallel else None
        if why is not None:
            raise PlanError(why + ".")
        if model is not None:
            check_tensor_parallel(model, profile, plan.tp)
    why = plan_refusal(plan, profile) or (gradient_hook_refusal(plan, hooked_parameters(model), profile.model_class)
                                          if model is not None else None)  # (hooks added since a cached profile)
    if why is not None:  # (before the pipeline's refusals, as the search asks them)
        raise PlanError(why + ".")
    if plan.pp > 1:
        check_pipeline(plan, profile)
    if not topology.is_gpu:
        if plan.cpu_offload:
            raise PlanError(
                "cpu_offload moves parameters from GPU memory to host memory, and this job has no GPU "
                f"({topology.describe().splitlines()[0]}): set cpu_offload=False."
            )
    elif not topology.device.supports(plan.precision):
        raise PlanError(
            f"precision={plan.precision!r} is not supported by {topology.device.name}: use precision='fp32'."
        )
    elif plan.precision == "bf16" and profile.bf16_refusal is not None:
        raise PlanError(f"precision='bf16' cannot run {profile.model_class} on a GPU: {profile.bf16_refusal}. Use "
                        "precision='fp32', or cast that op's input to float32 in the model.")


def apply_plan(
    model: nn.Module,
    plan: Plan,
    profile: ModelProfile,
    topology: Topology,
    *,
    mesh: DeviceMesh | None,
    device: torch.device,
    init_fn: Callable[[nn.Module], None] | None = None,
    compile_backend: str | None = None,
    fake_mode: Any = None,
) -> Applied:
    """Apply `plan` to `model` in place (see the module docstring for the order) and describe what was done.

    `fake_mode`: a FakeTensorMode in which a meta-device model is materialised and everything after runs
    (the exact memory check, autopar.exact); the sharding steps run outside it, as the mesh needs.
    """
    import contextlib

    later = fake_mode if fake_mode is not None else contextlib.nullcontext()
    notes: list[str] = []
    if plan.cuda_graphs and (why := cuda_graphs_refusal(device, compile_backend or default_backend())) is not None:
        raise PlanError(why)  # before anything changes
    if plan.max_autotune and (why := max_autotune_refusal(compile_backend or default_backend())) is not None:
        raise PlanError(why)
    # 1. float8 linears (refused, before anything changes, where they cannot run).
    if plan.float8:
        if (why := float8_refusal(device)) is not None:
            raise PlanError(why)
        linears = ((n, m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, nn.Linear))
        # FSDP gathers the float8 weights in float8 where the plan says so and the process group can send it
        not_gathered = float8_all_gather_refusal(_backend()) if plan.float8_all_gather else None
        gathers = plan.float8_all_gather and not_gathered is None
        converted = apply_float8(model, float8_layers(linears, [b.name for b in profile.blocks]),
                                 recipe=plan.float8_recipe, all_gather=gathers)
        notes.append(f"float8: {len(converted)} linear layer(s) of the blocks train in float8 (torchao's Float8Linear, "
                     f"{plan.float8_recipe} scaling{', weights all-gathered in float8' if gathers else ''}); "
                     + (f"{converted[0]}, ..." if converted else
                        "none is large enough for it to pay (autopar.layout.float8_converts)"))
        if not_gathered is not None and converted:
            notes.append(f"float8: {not_gathered}")
    # Parameters some ranks' forwards use and others' do not (strategies/unused.py), found on the whole model before
    # the split (one collective): a container of blocks the data calls is no unit in step 6, and their units reduce
    # zeros where a rank has no gradient.
    unused = find_unused(model, profile, list(iter_block_modules(model, profile))) \
        if plan.uses_fsdp and plan.dp_size > 1 else Unused()
    if unused.conditional and plan.pp > 1:  # a stage has no unit around its blocks to gather them instead
        raise PlanError(f"the blocks of {unused.conditional[0].rpartition('.')[0] or type(model).__name__} are run "
                        "by some ranks' samples and not others' (the data chooses), which pipeline stages cannot "
                        "shard: use a plan with pp=1.")
    # 2. Pipeline split.
    runtime = None
    if plan.pp > 1:
        assert mesh is not None, "a pipeline plan runs on several processes"
        runtime = apply_pipeline_split(model, plan, profile, mesh.get_local_rank("pp"))
    blocks = [(name, module) for name, module in iter_block_modules(model, profile) if _kept(module)]
    # 3. Tensor parallel (+ sequence parallel).
    layout = None
    if plan.tp > 1:
        assert mesh is not None, "a tensor-parallel plan runs on several processes"
        ends = [profile.blocks[s[-1]].name for s in runtime.stage_blocks.values()] if runtime else last_blocks(blocks)
        layout = apply_tensor_parallel(model, mesh["tp"], profile=profile, blocks=blocks,
                                       sequence_parallel=plan.sequence_parallel, stage_ends=ends)
        notes += [f"tensor parallel: {n}" for n in layout.notes]
        if profile.vocab_size and profile.vocab_size % plan.tp:
            notes.append(f"tensor parallel: the vocabulary ({profile.vocab_size}) does not divide by tp={plan.tp}: "
                         "the embedding and the head stay whole on every rank")
    if plan.dp_size > 1 and (norms := _per_rank_batchnorms(model)):
        notes.append(f"data parallel: {len(norms)} BatchNorm layer(s) ({_first(norms)}) "
                     f"keep their statistics per rank: each normalises over its own {plan.micro_batch_size} "
                     "samples, not the global batch as one process would; for one process's statistics convert "
                     "them before wrap: model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)")
        _warn_once(notes[-1])
    if plan.dp_size > 1 and (written := _per_rank_buffers(model, profile)):
        notes.append(f"data parallel: the forward writes {len(written)} buffer(s) ({', '.join(written[:3])}"
                     f"{', ...' if len(written) > 3 else ''}): each rank updates its own copy from its own "
                     f"{plan.micro_batch_size} samples, so the copies drift apart (one process would update them from "
                     "the whole batch), and a checkpoint keeps one rank's; to keep them equal, average them over the "
                     "ranks after each step (torch.distributed.all_reduce(buffer, op=ReduceOp.AVG))")
        _warn_once(notes[-1])
    # 4. Activation checkpointing, the key/value cache off in training forwards first (a checkpointed layer's
    #    replay and a layer compiled on its own in step 5 both go wrong with it; _util/kv_cache.py).
    if kv_cache_off_in_training(model):
        notes.append("training forwards run without the model's key/value cache (use_cache=False where the call "
                     "leaves it unset; eval forwards, generate and config.use_cache unchanged): in training it is "
                     "only written, a checkpointed layer's replay would append to it, and a layer compiled on its "
                     "own would be compiled again for every layer")
    if own := turn_own_checkpointing_off(model):  # (_util/own_checkpointing.py)
        notes.append(f"checkpointing: the model's own ({_first(own)}: "
                     "gradient_checkpointing_enable) is turned off; the plan's checkpointing "
                     f"('{plan.checkpointing}') replaces it, as the plan's memory was predicted")
        _warn_once(notes[-1])
    checkpointed = apply_checkpointing(blocks, mode=plan.checkpointing, every=plan.checkpoint_every)
    # 5. torch.compile: per block when FSDP or the pipeline wraps the blocks, else the whole model's forward
    #    (in step 8, after the move and before autocast, which then wraps the compiled forward from outside).
    use_fsdp = plan.uses_fsdp
    compiled: list[str] = []
    if plan.compile and not plan.compiles_whole_model:  # FSDP's or the pipeline's hooks wrap the blocks
        compiled = apply_compile(model, blocks, per_block=True, backend=compile_backend,
                                 max_autotune=plan.max_autotune)
    # 6. FSDP2 (over a one-process mesh when CPU offload is asked for on a single process).
    reduced: list[str] = []  # parameters some ranks' forwards use and others' do not
    if use_fsdp:
        fsdp_mesh = dp_mesh(mesh, plan)
        if fsdp_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            ensure_single_process_group()
            fsdp_mesh = init_device_mesh(device.type, (1,))
        outer = None
        if runtime is not None:  # the stage's forward stops early: no unit may wrap the whole model
            outer = _outer_units(model, profile)
        if made := contiguous_weights(model):
            notes.append(f"data parallel: {len(made)} weight(s) stored in another memory format ({_first(made)}"
                         ": channels_last) are made contiguous, as FSDP2 shards "
                         "them; the inputs' format still sets the activations'")
        conditional = set(unused.conditional)
        beside = apply_fsdp(model, fsdp_mesh, blocks=[(n, b) for n, b in blocks if n not in conditional],
                            precision=plan.precision, reshard_after_forward=plan.reshard_after_forward,
                            cpu_offload=plan.cpu_offload, outer_units=outer)
        reduced = apply_unused(model, unused)
        if reduced:
            notes.append(f"data parallel: {len(reduced)} parameter(s) ({_first(reduced)})"
                         " may go without a gradient on some ranks (a task head, a branch or an expert the data "
                         "chooses): a rank whose backward gives one none reduces a zero gradient for it, as DDP's "
                         "find_unused_parameters=True does, and one no rank used keeps none"
                         + (f"; the blocks of {unused.conditional[0].rpartition('.')[0] or 'the model'} are gathered "
                            "together, as one unit" if unused.conditional else ""))
            _warn_once(notes[-1])
        if nowhere := unused.nowhere:
            notes.append(f"data parallel: {len(nowhere)} trainable parameter(s) ({_first(nowhere)}"
                         ") got no gradient in any rank's traced step: if later "
                         "batches use them on some ranks and not others, FSDP2 reduces different tensors on the ranks "
                         "(wrong, silently, where their shapes agree); give each rank's wrap a sample that uses them, "
                         "or freeze them (requires_grad=False) if no batch does")
            _warn_once(notes[-1])
        if beside:
            notes.append(f"data parallel: {len(beside)} parameter(s) ({_first(beside)}"
                         ", which FSDP2 cannot shard) stay replicated beside its shards, which "
                         "torch.nn.utils.clip_grad_norm_ refuses to mix: clip with autopar.clip_grad_norm_(model, "
                         "max_norm) or autopar.train_step(..., max_grad_norm=)")
            _warn_once(notes[-1])
        # A full (unsharded) state dict then loads into the shards: model.load_state_dict takes each rank's own.
        apply_full_load(model)
    elif runtime is not None and not _has_meta(model):  # (tensor-parallel plans always take FSDP's branch)
        model.to(device)
    # (under FSDP its bf16 param_dtype casts every weight; a pipeline rank casts those of its stages)
    cast = tuple(present_weights(model, profile.bf16_weights)) if plan.precision == "bf16" and not use_fsdp else ()
    if cast:
        notes.append(f"precision: {len(cast)} weight(s) that autocast does not reach ({_first(cast)}"
                     ": a matmul on no autocast list reads them) are given to the "
                     "forward in bf16, as autocast gives a Linear's; their parameters stay fp32")
    with later:
        _finish(model, plan, blocks, runtime, mesh, device, init_fn, compile_backend, use_fsdp, compiled, cast)
    if runtime is None:  # (a pipeline's step is autopar.train_step's)
        give_no_sync(model)
    return Applied(plan=plan, profile=profile, topology=topology, mesh=mesh, device=device,
                   data_shard=data_shard(mesh, plan), checkpointed=tuple(checkpointed), compiled=tuple(compiled),
                   notes=tuple(notes), pipeline=runtime, tensor_parallel=layout,
                   used_on_some_ranks=tuple(reduced))


def last_blocks(blocks: list[tuple[str, nn.Module]]) -> list[str]:
    """The last block of each container (an encoder's and a decoder's, each tower's): where the hidden states
    leave a stack of blocks, so sequence parallelism gathers them again there."""
    last: dict[str, str] = {}
    for name, _ in blocks:
        last[name.rpartition(".")[0]] = name
    return list(last.values())


def _per_rank_batchnorms(model: nn.Module) -> list[str]:
    """BatchNorm layers whose statistics each rank keeps for itself (all but SyncBatchNorm)."""
    return [name for name, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm)]


def _per_rank_buffers(model: nn.Module, profile: ModelProfile) -> list[str]:
    """Floating buffers the traced forward writes (ModelProfile.buffers_written: an EMA codebook, a running mean of
    one's own), but not a BatchNorm's (its note above): under data parallelism each rank keeps its own."""
    norms = {f"{name}.{key}" if name else key for name, m in model.named_modules()
             if isinstance(m, nn.modules.batchnorm._BatchNorm) for key, _ in m.named_buffers(recurse=False)}
    buffers = dict(model.named_buffers())
    return [n for n in profile.buffers_written
            if n in buffers and buffers[n].is_floating_point() and n not in norms]


def _first(names: list[str] | tuple[str, ...]) -> str:
    """The first of `names`, and ", ..." where there are more (a note's list)."""
    return names[0] + (", ..." if len(names) > 1 else "")


def _warn_once(note: str) -> None:
    """A note of the plan's that the user must see: warned on rank 0 (the others have the same)."""
    if world().rank == 0:
        warnings.warn("autopar: " + note, stacklevel=4)


def _has_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def _finish(model: nn.Module, plan: Plan, blocks: list, runtime: Any, mesh: DeviceMesh | None, device: torch.device,
            init_fn: Callable[[nn.Module], None] | None, compile_backend: str | None, use_fsdp: bool,
            compiled: list[str], bf16_weights: tuple[str, ...] = ()) -> None:
    """Steps 7 to 9 (under the exact check's FakeTensorMode, when there is one). `bf16_weights`: the weights autocast
    does not reach, which the autocast forward gives the model in bf16 (ModelProfile.bf16_weights)."""
    # 7. Materialise a meta-device model; then every data-parallel replica takes the first one's values (FSDP2
    #    does not synchronise them: ranks seeded differently would keep different replicas forever).
    materialize(model, torch.device("cpu") if plan.cpu_offload else device, init_fn)
    if mesh is not None and plan.dp_size > 1:
        broadcast_replicas(model, mesh)
    # 8. Without FSDP: move to the device, autocast for bf16, compile the whole model.
    if not use_fsdp:
        if any(t.device.type != device.type or (device.index is not None and t.device.index != device.index)
               for t in list(model.parameters()) + list(model.buffers())):
            model.to(device)
        # compile before autocast: the autocast context (and the fp32 outputs) then wrap the compiled forward
        # from outside, as `with torch.autocast(...): compiled(x)` does (on an H200, torch 2.11, compiled BERT with
        # autocast entered inside the compiled call held 6.3 GiB more and ran 25% slower than this order:
        # bench/results/zoo_h200_2026-12-01.jsonl, wrap against hand_compile)
        if plan.compiles_whole_model:
            compiled[:] = apply_compile(model, blocks, per_block=False, backend=compile_backend,
                                        cuda_graphs=plan.cuda_graphs, max_autotune=plan.max_autotune)
        if runtime is None:
            apply_autocast(model, precision=plan.precision, device_type=device.type, weights=bf16_weights)
        else:  # each pipeline stage's forward runs under autocast
            runtime.autocast, runtime.bf16_weights = (device.type, plan.precision), bf16_weights
    # 9. Pipeline: gates and schedule.
    if runtime is not None:
        install_stage_gates(model, runtime)
        build_schedule(model, runtime, mesh["pp"], device)


def _kept(module: nn.Module) -> bool:
    """False for the pass-through standing in for a block of another pipeline rank."""
    return not isinstance(module, _PassThrough)


def _outer_units(model: nn.Module, profile: ModelProfile) -> list[nn.Module]:
    """The modules around the blocks that this stage kept, each its own FSDP unit."""
    named = dict(model.named_modules())
    out = []
    for name in (*profile.modules_before_blocks, *profile.modules_after_blocks):
        module = named.get(name)
        if module is not None and any(True for _ in module.parameters()):
            out.append(module)
    return out
