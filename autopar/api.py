"""wrap / plan / applied / data_shard: orchestration only; each step lives in its own module."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from ._util import dist as _dist
from ._util.batch import check_peers_on_first_forward
from ._util.log import get_logger
from ._util.progress import phase, recording
from ._util.stale_params import forget_replaced
from .errors import InfeasiblePlanError, PlanError, TraceError, UntracedWarning
from .hooks import Profiled, WrapHook, wrap_hook
from .decision import Decision as _Decision
from .decision import check_same_batch as _check_same_batch
from .decision import from_wrap_cache as _from_wrap_cache
from .decision import global_batch_of as _global_batch
from .decision import store_wrap_choice as _store_wrap_choice
from .decision import wrap_key_of as _wrap_key
from .plan_cache import cached_plan_for
from .planning import (base_profile, bf16_variants, calibration_for, check_traced_for, has_bf16, profile_variants,
                       resolve_topology, short_name, with_graphs_prediction)
from .plans import Loop, Plan
from .profile import ModelProfile, profile_model
from .race import measured_prediction, race_compile, races_graphs
from .safe_plan import safe_plan, untraced_message
from .search import DropKind, compile_unpriced, compiles_here, largest_tensor_hint, search
from .strategies.apply import apply_plan, check_plan
from .strategies.mesh import build_mesh
from .strategies.state import applied, attach, data_shard, is_wrapped, plan_of
from .strategies.tensor_parallel import tensor_parallel_refusal
from .strategies.tensor_parallel_trial import (tensor_parallel_trial, tp_does_not_run,
                                                   trial_in_fake_group)
from .topology import Topology

__all__ = ["wrap", "plan", "applied", "plan_of", "data_shard"]


def _load_plan(plan: Plan | str | os.PathLike[str], profile: ModelProfile, world_size: int, force: bool) -> Plan:
    if isinstance(plan, Plan):
        plan.check_model(profile.fingerprint, force=force)
        return plan
    if isinstance(plan, (str, os.PathLike)):
        return Plan.load(Path(plan), model_fingerprint=profile.fingerprint,
                         world_size=None if force else world_size, force=force)
    raise TypeError(f"plan must be an autopar.Plan, a path to a plan YAML file, or None; got {type(plan).__name__}.")


def plan(
    model: nn.Module,
    *,
    sample: Any,
    topology: Topology | str | None = None,
    world_size: int | None = None,
    global_batch_size: int | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    blocks: Any = None,
    loop: Loop | str | None = None,
    uses_train_step: bool | None = None,
) -> Plan:
    """Choose a plan for `model` without touching it (profiled on fake tensors: no memory, no gradients).

    `sample` is one batch as one rank's loop feeds it today; the global batch defaults to that batch times
    the world size. `topology` defaults to the hardware here; pass a spec ("4x8xH100-SXM") to plan for
    hardware that is not here, and then `world_size` defaults to its GPU count. `loop` says what drives the
    step (autopar.plans.Loop): "plain" (the default: every process reads its own batch, pure data
    parallelism), "accumulates" (a framework that accumulates: accumulation and tensor parallelism too) or
    "train_step" (autopar.train_step and autopar.dataloader: pipelines too). `uses_train_step=True` is the
    deprecated spelling of loop="train_step".
    The plan is the search's first (autopar.candidates ranks them all). A model that cannot be traced on
    fake tensors gets a safe plan from its structure instead, with a warning saying why (as `wrap` applies).
    """
    started = time.perf_counter()
    chosen_loop = Loop.resolve(loop, uses_train_step) or Loop.PLAIN
    topo = resolve_topology(topology)
    if world_size is None:
        world_size = topo.world_size if topology is not None else _dist.world().size
    global_batch = _global_batch(sample, global_batch_size, world_size)
    try:
        with phase(f"tracing a training step of {type(model).__name__} on fake tensors"):
            profile, variants = profile_variants(model, sample, topo, loss_fn=loss_fn, blocks=blocks, lazy=True)
    except TraceError as exc:
        structure = profile_model(model, sample, blocks=blocks, warn=False, trace=False)
        safe = safe_plan(structure, topo, world_size=world_size, global_batch_size=global_batch)
        warnings.warn("autopar: " + untraced_message(structure, safe, exc), UntracedWarning, stacklevel=2)
        return safe
    refusal = tensor_parallel_refusal(model, profile)
    with phase(f"choosing among the plans for {world_size} process(es) (cost model)"):
        chosen = _choose(profile, topo, world_size=world_size, global_batch_size=global_batch,
                         variants=variants, loop=chosen_loop, tp_refusal=refusal)
    if chosen.tp > 1 and refusal is None:  # tried as wrap tries it, in a fake process group of the plan's size
        why = trial_in_fake_group(model, sample, chosen, profile, loss_fn=loss_fn)
        if why is not None:
            why = tp_does_not_run(chosen, profile, why)
            warnings.warn(f"autopar: {why}; choosing again without tensor parallelism.", stacklevel=2)
            chosen = _choose(profile, topo, world_size=world_size, global_batch_size=global_batch,
                             variants=variants, loop=chosen_loop, tp_refusal=why)
    return chosen.replace(prediction={**(chosen.prediction or {}),
                                      "planning_s": round(time.perf_counter() - started, 2)})


def _choose(profile: ModelProfile, topology: Topology, *, world_size: int, global_batch_size: int,
            variants: Any = None, loop: Loop = Loop.PLAIN, tp_refusal: str | None = None) -> Plan:
    """The fastest plan the cost model predicts to fit (autopar.search), or a clear error."""
    if not profile.traced:
        raise PlanError("choosing a plan needs a traced profile (FLOPs and activation bytes); pass a plan instead.")
    if topology.is_gpu and topology.world_size != world_size:
        # A detected topology describes this job; a spec for other hardware must match the world asked for.
        raise PlanError(
            f"the topology has {topology.world_size} GPUs but the job has {world_size} processes: "
            "give a topology for this job (Topology.detect() under torchrun, or a spec with that many GPUs)."
        )
    calibration = calibration_for(topology, profile=profile)
    ranked = search(profile, topology, world_size=world_size, global_batch_size=global_batch_size,
                    variants=variants, calibration=calibration, loop=loop, tp_refusal=tp_refusal)
    if not ranked:
        raise PlanError(
            f"the global batch of {global_batch_size} samples does not split over {world_size} data-parallel ranks: "
            f"use a global batch divisible by {world_size} (e.g. {max(world_size, global_batch_size - global_batch_size % world_size)}), "
            "or pass a plan with fewer data-parallel ranks.")
    best = ranked[0]
    if not best.feasible and all(c.drop is not None and c.drop.kind is DropKind.UNRUNNABLE for c in ranked):
        raise InfeasiblePlanError(f"no plan can train {profile.model_class} on {world_size} process"
                                  f"{'es' if world_size > 1 else ''}: {best.reason}.")
    if not best.feasible:
        sized = [c for c in ranked if c.prediction is not None]
        smallest = min(sized, key=lambda c: c.prediction.memory_bytes) if sized else None
        need = f" (the smallest needs {smallest.prediction.memory_bytes / 2**30:.1f} GiB per device, with " \
               f"{smallest.plan.checkpointing} checkpointing{' and CPU offload' if smallest.plan.cpu_offload else ''})" \
            if smallest is not None else (f" ({best.reason})" if best.reason else "")
        hint = "" if loop is Loop.TRAIN_STEP else " or let autopar split the step (loop='train_step' with autopar.train_step),"
        if any(c.drop is not None and c.drop.kind is DropKind.HOST_MEMORY for c in ranked):
            hint += " nodes with more host memory for CPU offload (Topology host_memory_bytes),"
        raise InfeasiblePlanError(
            f"no plan for {profile.model_class} with a global batch of {global_batch_size} fits in "
            f"{topology.device.memory_bytes / 2**30:.0f} GiB per device{need}: use more devices, a smaller batch,"
            f"{hint} or a shorter sequence.{largest_tensor_hint(profile, best.plan, topology)}")
    # The prediction says which calibration it was made with (a cached file's path, or the defaults), and the step
    # replayed as CUDA graphs where they could run (wrap races them where they are predicted to pay).
    chosen = best.plan.replace(prediction={**(best.plan.prediction or {}), "calibration": calibration.source})
    return with_graphs_prediction(chosen, profile, topology, calibration, variants)


def wrap(
    model: nn.Module,
    *,
    sample: Any,
    plan: Plan | str | os.PathLike[str] | None = None,
    topology: Topology | str | None = None,
    global_batch_size: int | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    blocks: Any = None,
    force: bool = False,
    init_fn: Callable[[nn.Module], None] | None = None,
    verbose: bool = True,
    loop: Loop | str | None = None,
    uses_train_step: bool | None = None,
    measure: bool | None = None,
) -> nn.Module:
    """Choose (or take) a plan for `model` and apply it in place; returns the same module, ready to train.

    Build the optimizer after `wrap`. The user's loop is unchanged:
    `loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()`.

    - `sample`: one batch as this rank's loop feeds it (tensor, tuple or dict; meta tensors are fine).
    - `plan`: a Plan or the path of a plan YAML file; a plan made for another model or world size is
      refused unless `force=True`. Without one, autopar chooses (see autopar.search) and every rank
      applies rank 0's choice.
    - `global_batch_size`: samples per optimizer step over all ranks; default: the sample's batch times
      the number of processes (each reads its own batch today), or, with a given plan, times the plan's
      data-parallel degree (tensor- and pipeline-parallel peers read the same samples). autopar never
      changes it.
    - `blocks`: the model's repeated layers, when autopar cannot find them (a path like "model.layers").
    - `loss_fn(output, sample)`: the loss, used when profiling the step (default: `output.loss` or a sum
      of the output); called on fake tensors, so it must take its targets from `sample`.
    - `init_fn(model)`: initialises a meta-device model after sharding (default: the model's own
      `reset_parameters` / `init_weights`).
    - `loop`: what drives each step (autopar.plans.Loop). "plain" (the default): your own loop, every
      process reading its own batch, so autopar chooses pure data parallelism. "accumulates": a framework
      that accumulates gradients and is told the plan's degrees (the Hugging Face Trainer through
      autopar.integrations.hf, Lightning): accumulation and tensor parallelism may be chosen, pipelines not.
      "train_step": `autopar.train_step` with `autopar.dataloader` (or `autopar.data_shard`): every plan.
      Passed explicitly, it also refuses a given plan that loop cannot run (a pipeline outside train_step,
      accumulation in a plain loop); left out, a given plan is applied as it is. `uses_train_step=True` is
      the deprecated spelling of loop="train_step" (False: left out); passing both is refused.
    - `measure`: when autopar chose the plan (no `plan` given, no pipeline), time the model's forward and
      backward on the sample on this device, eager and, where the plan compiles (or the cost model could not
      price its compiled step: a forward that reads tensor values), compiled, keep the faster, and
      predict the step from the measurement (autopar.race). The default, None, measures on a GPU only; False
      never; True also on a CPU.
    """
    declared = Loop.resolve(loop, uses_train_step)
    chosen_loop = declared or Loop.PLAIN
    if is_wrapped(model):
        raise PlanError("this model is already wrapped by autopar: wrap the original model once.")
    inner = next((name for name, m in model.named_modules() if name and is_wrapped(m)), None)
    if inner is not None:
        raise PlanError(f"{type(model).__name__} holds a model autopar already wrapped (at {inner!r}): wrap the "
                        "whole model once, before its parts are wrapped (build the container around the unwrapped "
                        "model, then wrap the container).")
    started = time.perf_counter()
    hook = wrap_hook()  # a no-op outside a tuner's trial (autopar/hooks.py)
    override = hook.plan_override()
    chosen_here = plan is None and override is None
    if override is not None:  # a trial applies its plan, as if it were given
        plan, force = override, False
    world = _dist.ensure_process_group()
    say = verbose and world.rank == 0
    # 0. A plan wrap chose (and measured) before for this model and job: taken from wrap's cache without tracing
    #    (autopar/wrap_cache.py); the tuner's cached plan still wins (step 2 finds it).
    #    Rank 0 makes the cache's key once: it looks the plan up with it, and stores its choice under it (step 6).
    # The seconds of the keyed phases of steps 0-2 (cache_key, topology, tracing, bf16_tracing, choosing) are
    # recorded: they go in the plan's prediction.
    with recording() as phases:
        cache_key = _wrap_key(model, sample, topology=topology, loss_fn=loss_fn, blocks=blocks,
                              global_batch_size=global_batch_size, world=world, loop=chosen_loop) \
            if chosen_here and world.rank == 0 else None
        cached = _from_wrap_cache(model, sample, cache_key, topology=topology, blocks=blocks,
                                  global_batch_size=global_batch_size, world=world, started=started,
                                  warn=world.rank == 0 and not say) \
            if chosen_here and type(hook) is WrapHook else None
        if cached is not None:
            topo, profile, global_batch, decision = cached
            return _apply_chosen(model, sample, decision, profile, topo, world=world, global_batch=global_batch,
                                 loop=declared, chosen_loop=chosen_loop, init_fn=init_fn, force=force, say=say,
                                 race=False, loss_fn=loss_fn, hook=hook, cache_key=None)
        # Step 5 measures the chosen plan's step (eager and compiled) on a GPU: then dynamo's graph count (seconds of
        # the trace, for the cost model's compiled price) is not asked for, since the measurement decides compile.
        # A pipeline is not measured: under autopar.train_step on several processes the count is kept.
        races = chosen_here and (measure or (measure is None and _dist.local_device().type == "cuda"))
        graphs = not (races and (chosen_loop is not Loop.TRAIN_STEP or world.size == 1))
        # 1. Every rank profiles (the same model, so the same result); if any rank fails, all stop together.
        topo, profile, global_batch, untraced = _profile_everywhere(
            model, sample, topology=topology, plan=plan, loss_fn=loss_fn, blocks=blocks,
            global_batch_size=global_batch_size, world=world, say=say, graphs=graphs)
        if world.rank == 0 and topo.is_gpu and _dist.device_type() == "cpu":
            warnings.warn(f"autopar: wrap applies its plan on this machine, which has no GPU, but "
                          f"topology={topology!r} names GPUs: the plan chosen for them (bf16, compile, their memory) "
                          "runs here on the CPU. To plan for hardware that is not here use autopar.plan(model, "
                          "sample=..., topology=...); to train here, leave topology out.", stacklevel=2)
        hook.profiled(Profiled(model=model, sample=sample, profile=profile, topology=topo, world_size=world.size,
                               global_batch_size=global_batch, loss_fn=loss_fn, blocks=blocks, loop=chosen_loop))
        # 2. Rank 0 decides (the plan cache, the cost model, or the given plan); every rank applies its plan,
        #    sent as YAML text (nothing is unpickled).
        decision = _decide(model, sample, profile, topo, plan=plan, force=force, loss_fn=loss_fn, blocks=blocks,
                           world_size=world.size, global_batch_size=global_batch,
                           loop=chosen_loop, untraced=untraced, say=say) if world.rank == 0 else None
    if decision is not None and decision.plan is not None and decision.plan.prediction and chosen_here:
        # the time before the first step, in the plan's summary (issue 33): rank 0's, sent with the plan; where it
        # went by phase (cache_key, topology, tracing, bf16_tracing, choosing; the rest: cache lookups, checks)
        decision = dataclasses.replace(decision, plan=decision.plan.replace(prediction={
            **decision.plan.prediction, "planning_s": round(time.perf_counter() - started, 2),
            "planning_phases_s": dict(phases)}))
    if races and decision is not None:
        decision = _race_unpriced_compile(decision, profile, topo)
    return _apply_chosen(model, sample, decision, profile, topo, world=world, global_batch=global_batch,
                         loop=declared, chosen_loop=chosen_loop, init_fn=init_fn, force=force, say=say,
                         race=races,
                         loss_fn=loss_fn, hook=hook, given=plan is not None and global_batch_size is None,
                         cache_key=cache_key if chosen_here else None,
                         redecide=functools.partial(_decide, model, sample, profile, topo, plan=None, force=force,
                                                    loss_fn=loss_fn, blocks=blocks, world_size=world.size,
                                                    global_batch_size=global_batch, loop=chosen_loop,
                                                    untraced=untraced, say=say) if chosen_here else None)


def _race_unpriced_compile(decision: _Decision, profile: ModelProfile, topo: Topology) -> _Decision:
    """Rank 0, where wrap measures (step 6): an eager plan the cost model chose because it cannot price the
    compiled step (a forward that reads tensor values, graph breaks that may cut the blocks: search.compile_unpriced)
    is applied compiled, so that the race times compiled against eager and keeps the faster, not left eager
    unmeasured: compiled wav2vec2 ran 0.81-0.86x of eager on an H200 (2026-12-01) and 1.08x on an H100 (2026-12-08,
    bench/results/zoo_h100_wrap_2026-12-08.md), where wrap had kept it eager. Not for a pipeline (not raced)."""
    plan = decision.plan
    if plan is None or decision.source != COST_MODEL_SOURCE or plan.compile or plan.pp > 1 \
            or not compiles_here(topo) or not compile_unpriced(profile):
        return decision
    return dataclasses.replace(decision, plan=plan.replace(compile=True))


def _tp_trial_everywhere(model: nn.Module, sample: Any, plan: Plan, profile: ModelProfile, mesh: Any, *,
                         loss_fn: Callable | None) -> str | None:
    """Collective: why `plan`'s tensor parallelism does not run `model` (tensor_parallel_trial, on every rank:
    rank 0's reason, or the rank that failed), or None where it runs on every rank."""
    why = tensor_parallel_trial(model, sample, plan, profile, mesh["tp"], device=_dist.local_device(),
                                loss_fn=loss_fn)
    _, failed = _dist.min_max(1 if why is not None else 0)
    if not failed:
        return None
    if why is not None and _dist.world().rank != 0:
        get_logger().warning("autopar: rank %d: %s", _dist.world().rank, why)
    return tp_does_not_run(plan, profile,
                           why if why is not None else "its trial step raised on another rank (that rank logs why)")


def _apply_chosen(model: nn.Module, sample: Any, decision: _Decision | None, profile: ModelProfile, topo: Topology, *,
                  world: _dist.World, global_batch: int, loop: Loop | None, chosen_loop: Loop,
                  init_fn: Callable | None, force: bool, say: bool, race: bool, loss_fn: Callable | None,
                  hook: WrapHook, given: bool = False, cache_key: Any = None,
                  redecide: Callable[..., _Decision] | None = None) -> nn.Module:
    """wrap's steps 3-7 on every rank: check rank 0's plan, try its tensor parallelism, apply it, measure it where
    asked, cache wrap's choice. `redecide(tp_failed=why)` (rank 0; wrap's own choice only): the plan chosen again where its
    tensor parallelism does not run the model."""
    chosen = _broadcast(decision)
    # 3. Checks before anything is changed: processes, batch, model, hardware.
    if given:  # the sample is one data-parallel rank's batch
        global_batch = _global_batch(sample, None, chosen.dp_size)
    _check(chosen, profile, topo, model=model, world_size=world.size, global_batch_size=global_batch, force=force,
           loop=loop)
    if decision is not None and decision.warning:  # rank 0, also when not verbose
        get_logger().warning("%s", decision.warning)
    # 4. Tensor parallelism tried on a meta copy over the job's own mesh, on fake tensors, before the model is
    #    touched (autopar.strategies.tensor_parallel_trial): a split the model's code does not run is refused where
    #    the plan was given, and chosen again without tensor parallelism where wrap chose it.
    mesh = build_mesh(chosen, _dist.device_type())
    if chosen.tp > 1:
        why = _tp_trial_everywhere(model, sample, chosen, profile, mesh, loss_fn=loss_fn)
        if why is not None:
            if redecide is None:
                raise PlanError(f"{why}: pass a plan with tp=1 (data parallelism runs the model as it is).")
            if world.rank == 0:
                get_logger().warning("autopar: %s; choosing again without tensor parallelism.", why)
            decision = redecide(tp_failed=why) if world.rank == 0 else None
            chosen = _broadcast(decision)
            if chosen.tp > 1:  # (the search drops every tensor-parallel plan it is told does not run)
                raise PlanError(f"{why}, and the plan chosen again has tp={chosen.tp}: pass a plan with tp=1.")
            _check(chosen, profile, topo, model=model, world_size=world.size, global_batch_size=global_batch,
                   force=force, loop=loop)
            mesh = build_mesh(chosen, _dist.device_type())
    if say:
        _log_choice(chosen, profile, topo, decision, chosen_loop)
    # 5. Apply, and keep what was applied on the model.
    before = list(model.parameters())  # as the user built it
    state = apply_plan(model, chosen, profile, topo, mesh=mesh, device=_dist.local_device(), init_fn=init_fn)
    # An optimizer built before wrap holds the parameters the plan replaced (FSDP, TP, a meta model's): its first
    # step is refused with the remedy, not left to train nothing (autopar/_util/stale_params.py).
    forget_replaced(before, model)
    del before
    if say:
        for note in state.notes:
            get_logger().info("%s", note)
    attach(model, state)
    # 6. Measure what the formulas miss, and compile only where it pays: a plan autopar chose has its step timed
    #    on this device (one that compiles, eager and compiled, the faster kept).
    if race and chosen.pp == 1:
        state = _race(model, sample, state, loss_fn=loss_fn, say=say)
        chosen = state.plan
    if chosen.tp > 1 and chosen.pp == 1:  # TP peers must read one batch: checked at the first forward (PP: train_step)
        check_peers_on_first_forward(model, data_rank=state.data_shard.rank, device=state.device,
                                     degrees="tensor-parallel")
    # 7. The cost model's choice, as measured, goes to wrap's cache (rank 0), for the next wrap of this model and job.
    #    Not where some ranks' samples use parameters others' do not: a cached plan is applied without the trace
    #    that finds them (wrap plans afresh each time for such a model).
    if cache_key is not None and decision is not None and decision.source == COST_MODEL_SOURCE and \
            not state.used_on_some_ranks:
        _store_wrap_choice(chosen, cache_key, profile, topo, global_batch=global_batch, loop=chosen_loop)
    hook.applied(model, chosen, profile)
    return model


def _race(model: nn.Module, sample: Any, state: Any, *, loss_fn: Callable | None, say: bool) -> Any:
    """Race the applied plan's compiled forward against eager (autopar.race) and keep the faster: the plan, its
    prediction and the applied state say which, and what was measured."""
    what = "eager and compiled (compiling first)" if state.plan.compile else "eager"
    with phase(f"measuring the step on {state.device} ({what})", say=say):
        race = race_compile(model, sample, device=state.device, loss_fn=loss_fn, rows=state.plan.micro_batch_size,
                            graphs=races_graphs(state.plan, state.device))
    if not race.ran:  # the plan runs no step here: refused now, with why, not left to the loop's first step
        raise PlanError(f"wrap's plan ({short_name(state.plan)}) ran no training step on {state.device}: {race.why}. "
                        "Build the model again (this one has the plan applied) and pass a plan that runs: "
                        "wrap(model, sample=..., plan=autopar.Plan(...)), with precision='fp32' where an op has no "
                        "bf16 kernel on this device, a smaller micro_batch_size or checkpointing where it ran out of "
                        "memory.")
    prediction = measured_prediction(state.plan, race)
    plan = state.plan.replace(compile=race.kept_compiled, prediction=prediction,
                              cuda_graphs=(state.plan.cuda_graphs or race.kept_graphs) and race.kept_compiled,
                              max_autotune=state.plan.max_autotune and race.kept_compiled)
    state = dataclasses.replace(state, plan=plan, compiled=state.compiled if race.kept_compiled else (),
                                notes=(*state.notes, race.describe()))
    attach(model, state)
    if say:
        get_logger().info("%s", race.describe())
    return state


def _profile_everywhere(model: nn.Module, sample: Any, *, topology: Topology | str | None, plan: Any,
                        loss_fn: Callable | None, blocks: Any, global_batch_size: int | None, world: _dist.World,
                        say: bool, graphs: bool = True) -> tuple[Topology, ModelProfile, int, TraceError | None]:
    """(topology, profile, global batch, why the step could not be traced or None) on every rank; if one rank
    fails here, every rank raises. A model that cannot be traced gets a profile of its structure alone (its
    blocks): enough to apply a given plan, or the safe plan `_decide` makes. On GPUs with bf16 the profile is the
    bf16 (autocast) trace, the one the search's plans read there (it offers no other), as every planner path makes
    it (autopar.planning.base_profile): one trace, and the same plan-cache key as the tuner's and autopar.plan's."""
    error: BaseException | None = None
    result: tuple[Topology, ModelProfile, int, TraceError | None] | None = None
    try:
        with phase("finding the hardware", say=False, key="topology"):
            topo = resolve_topology(topology)
        untraced = None
        try:
            with phase(f"tracing a training step of {type(model).__name__} on fake tensors", say=say, key="tracing"):
                # the profile's notes warned on rank 0 where no summary prints them (`say`: its "note" lines do)
                profile = base_profile(model, sample, loss_fn=loss_fn, blocks=blocks, warn=world.rank == 0 and not say,
                                       bf16=has_bf16(topo), graphs=graphs)
            check_traced_for(profile, topo)
        except TraceError as exc:
            untraced = exc
            profile = profile_model(model, sample, blocks=blocks, warn=False, trace=False)
            if say and plan is not None:
                get_logger().warning("the model could not be traced on fake tensors (%s); applying the given plan "
                                     "from the model's structure alone.", exc.__cause__)
        result = topo, profile, _global_batch(sample, global_batch_size, world.size), untraced
    except Exception as exc:
        error = exc
    _dist.first_failure(error)
    assert result is not None
    _check_same_batch(sample)
    return result


#: Where a plan came from when the cost model chose it (`_Decision.source`): only its plans are raced and cached.
COST_MODEL_SOURCE = "chosen by the cost model"
#: Where a plan came from when the model could not be traced (`_Decision.source`).
SAFE_SOURCE = "a safe plan from the model's structure, not chosen by the cost model"


def _decide(model: nn.Module, sample: Any, profile: ModelProfile, topo: Topology, *, plan: Any, force: bool,
            loss_fn: Callable | None, blocks: Any, world_size: int, global_batch_size: int,
            loop: Loop, untraced: TraceError | None = None, say: bool = False,
            tp_failed: str | None = None) -> _Decision:
    """Rank 0: the given plan (loaded and checked against the model), else a plan tuned for this model,
    hardware, batch and torch (autopar tune's cache), else the cost model's choice; for a model whose step
    could not be traced (`untraced`), a safe plan from its structure, with the warning that says why.
    `tp_failed`: why a tensor-parallel plan did not run the model (the trial of `_apply_chosen`): the cost model
    chooses again without tensor parallelism (the plan cache, which gave that plan or none, is not asked again)."""
    try:
        if plan is not None:
            return _Decision(_load_plan(plan, profile, world_size, force), "given")
        if untraced is not None:
            safe = safe_plan(profile, topo, world_size=world_size, global_batch_size=global_batch_size)
            return _Decision(safe, SAFE_SOURCE, warning=untraced_message(profile, safe, untraced))
        # A tampered cache file raises (CacheError, with the remedy); a stale one is ignored, logged.
        hit, note = cached_plan_for(profile, topo, world_size=world_size, global_batch_size=global_batch_size,
                                    loop=loop) if tp_failed is None else (None, None)
        if hit is not None:
            return _Decision(hit, "from the plan cache", note)
        # One process runs FSDP's bf16 weights only when it offloads: that trace is made when such a plan wins.
        precisions = ("bf16", "bf16-pure") if world_size > 1 else ("bf16",)
        with phase("tracing the bf16 steps on fake tensors", say=say, key="bf16_tracing"):
            variants = bf16_variants(model, sample, topo, loss_fn=loss_fn, blocks=blocks, profile=profile,
                                     precisions=precisions)
        tp_refusal = tp_failed or tensor_parallel_refusal(model, profile)

        def choose() -> Plan:  # reads `variants` as it is now
            return _choose(profile, topo, world_size=world_size, global_batch_size=global_batch_size,
                           variants=variants, loop=loop, tp_refusal=tp_refusal)

        with phase(f"choosing among the plans for {world_size} process(es) (cost model)", say=say, key="choosing"):
            chosen = choose()
        if "bf16-pure" not in precisions and variants and chosen.uses_fsdp and chosen.precision == "bf16":
            with phase("tracing the bf16-weights step on fake tensors (the plan offloads)", say=say,
                       key="bf16_tracing"):
                variants.update(bf16_variants(model, sample, topo, loss_fn=loss_fn, blocks=blocks, profile=profile,
                                              precisions=("bf16-pure",)))
            chosen = choose()
        return _Decision(chosen, COST_MODEL_SOURCE, note)
    except Exception as exc:  # sent to the other ranks so that none waits forever
        return _Decision(None, "", error=exc)


def _broadcast(decision: _Decision | None) -> Plan:
    """Rank 0's plan on every rank (YAML text), or its error: rank 0 raises its own, the others a PlanError."""
    text = None
    if decision is not None:
        text = decision.plan.to_yaml() if decision.plan is not None else \
            f"error: {type(decision.error).__name__}: {decision.error}"
    text = _dist.broadcast_text(text)
    if decision is not None and decision.error is not None:
        raise decision.error
    if text.startswith("error: "):
        raise PlanError(f"rank 0 could not make a plan: {text[7:]}")
    return Plan.from_yaml(text)


def _check(chosen: Plan, profile: ModelProfile, topo: Topology, *, model: nn.Module, world_size: int,
           global_batch_size: int, force: bool, loop: Loop | None = None) -> None:
    """Refuse, before the model is touched, a plan for another world, batch, model or hardware, or one the
    declared `loop` cannot run."""
    if loop is not None:
        loop.check(chosen)
    chosen.check_world(world_size)
    chosen.check_batch(global_batch_size)
    chosen.check_model(profile.fingerprint, force=force)
    check_plan(chosen, profile, topo, world_size=world_size, model=model)


def _log_choice(chosen: Plan, profile: ModelProfile, topo: Topology, decision: _Decision | None,
                loop: Loop = Loop.PLAIN) -> None:
    log = get_logger()
    if decision is not None and decision.cache_note:
        (log.info if decision.source == "from the plan cache" else log.warning)("%s", decision.cache_note)
    log.info("%s\n%s   (%s)", profile.describe(), chosen.describe(), decision.source if decision else "given")
    if chosen.topology_fingerprint not in (None, topo.fingerprint()):
        log.warning("this plan was made for other hardware (topology %s; here: %s): it runs, but its memory "
                    "and speed estimates may not hold.", chosen.topology_fingerprint, topo.fingerprint())
    if loop.refusal(chosen) is not None:
        log.info("this plan splits the step (pp > 1 or grad_accum > 1): drive it with autopar.train_step.")
