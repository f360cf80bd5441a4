"""Planning by the cost model: `candidates` (every plan, ranked, with predictions) and `predict` (one plan).

Both take a model (profiled here on fake tensors: no memory used) or a ModelProfile, and a topology
(detected, a spec such as "4x8xH100-SXM", or a Topology). bf16 plans are predicted from traces in bf16
(autocast, and bf16 weights as FSDP's mixed precision runs): for a model they are made here; for a
profile, pass them as `variants`. The calibration defaults to the one measured or fitted for this
topology (cached by its fingerprint, autopar.calibration_cache) and else to the defaults.

`describe_candidates` is the table `autopar plan` prints, `dropped_reasons` the dropped plans grouped by
their `Drop` (autopar.search), and `short_name(plan)` a plan in one line (the table's, the tuner's).
"""

from __future__ import annotations

import collections
import dataclasses
import time
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.nn as nn

from ._util.batch import sample_batch_size
from ._util.log import get_logger
from .calibration_cache import calibration_path, load_calibration, load_refit, refit_path
from .cost import Calibration, Prediction, predict_profile
from .errors import AutoparError, PlanError, TraceError
from .exact import exact_memory
from .plan_cache import sample_signature
from .plans import Loop, Plan
from .profile import ModelProfile, profile_model
from .profile.cuda_autocast import NoCudaBf16KernelError
from .search import Candidate, Drop, DropKind, rank_key, search
from .strategies.tensor_parallel import tensor_parallel_refusal
from .topology import Topology, resolve_topology
from .wrap_cache import structure_digest

GiB = 2**30


#: The traces of the models planned last in this process, by model (weakly: a model that is gone is forgotten),
#: with the key they were made under (`structure_digest` and whether bf16 traces were made): `autopar.plan` then
#: `autopar.predict` of one model, or its plans for two topologies, trace it once.
_TRACES: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple[str, bool], ModelProfile, dict[str, ModelProfile | None]]]" = \
    weakref.WeakKeyDictionary()


class TracedVariants(Mapping[str, ModelProfile]):
    """The bf16 profiles of a model, each traced the first time the cost model reads it.

    `"bf16"` (autocast) is read only for plans without FSDP, which a large world often cannot have, and
    `"bf16-pure"` (bf16 weights) only for FSDP's, which one GPU runs only to offload, tried only when nothing else
    fits (autopar.search): a variant no plan reads is never traced. Membership (`in`) and `len` never trace; a
    precision whose step cannot be traced reads as missing (KeyError, `.get` gives None: the cost model then reads
    the fp32 profile), and is not tried again. `done` holds the traces made (shared with a memo, when given)."""

    def __init__(self, trace: Callable[[str], ModelProfile], precisions: Sequence[str],
                 done: dict[str, ModelProfile | None] | None = None) -> None:
        self._trace = trace
        self._precisions = tuple(precisions)
        self._done: dict[str, ModelProfile | None] = done if done is not None else {}
        self.seconds = 0.0  # spent tracing so far

    def __getitem__(self, precision: str) -> ModelProfile:
        if precision not in self._precisions:
            raise KeyError(precision)
        if precision not in self._done:
            start = time.perf_counter()
            try:
                self._done[precision] = self._trace(precision)
            except TraceError:  # e.g. autocast keeps fp32 weights, and the model casts its input to them
                self._done[precision] = None
            finally:
                self.seconds += time.perf_counter() - start
        traced = self._done[precision]
        if traced is None:
            raise KeyError(precision)
        return traced

    def __contains__(self, precision: object) -> bool:
        return precision in self._precisions

    def __iter__(self) -> Iterator[str]:
        return iter(self._precisions)

    def __len__(self) -> int:
        return len(self._precisions)

    @property
    def traced(self) -> tuple[str, ...]:
        """The precisions traced so far (a failed one included)."""
        return tuple(self._done)


def profile_variants(model: nn.Module, sample: Any, topology: Topology, *, loss_fn: Callable | None = None,
                     blocks: Any = None, warn: bool = True, lazy: bool = False
                     ) -> tuple[ModelProfile, Mapping[str, ModelProfile]]:
    """The fp32 profile the planner reads, and the bf16 traces its bf16 plans need (none where the
    hardware has no bf16): a dict of both, or with `lazy=True` a TracedVariants that traces each when the cost
    model first reads it (it holds the model and the sample until it is dropped).

    A model whose fp32 step cannot be traced but whose bf16 step can (an op that runs only in bf16) gets its
    bf16 trace as the profile (its `profile_precision` says which: not "fp32"); the search offers only bf16
    plans there, and on hardware without bf16 this raises the TraceError (no plan can be predicted).

    The same model object with the same structure, sample shapes, loss and blocks (`wrap_cache.structure_digest`:
    no trace) is traced once a process: a later call returns the traces made then (and makes those not made)."""
    bf16 = has_bf16(topology)
    try:
        key = (structure_digest(model, sample, loss_fn=loss_fn, blocks=blocks), bf16)
        memo = _TRACES.get(model)
    except TypeError:  # a model that cannot be weakly referenced: traced every time
        key, memo = None, None
    if memo is not None and memo[0] == key:
        profile, done = memo[1], memo[2]
    else:
        profile = base_profile(model, sample, loss_fn=loss_fn, blocks=blocks, warn=warn, bf16=bf16)
        check_traced_for(profile, topology)
        done = _seeded(profile)
        if key is not None:
            # keyed as the model is now: a forward may write its config (Hugging Face's classifiers set
            # `config.problem_type` from the first labels they see), and the next call reads the model so
            key = (structure_digest(model, sample, loss_fn=loss_fn, blocks=blocks), key[1])
            _TRACES[model] = (key, profile, done)

    # where the profile is a bf16 trace, the fp32 one is made only for an fp32 plan (which the search never offers
    # on GPUs with bf16: a user's autopar.predict of one)
    fp32 = ("fp32",) if profile.profile_precision != "fp32" else ()
    variants = TracedVariants(_tracer(model, sample, loss_fn=loss_fn, blocks=blocks, profile=profile),
                              (*BF16_PRECISIONS, *fp32) if bf16 else (), done)
    return profile, (variants if lazy else _resolved(variants, BF16_PRECISIONS))


def _tracer(model: nn.Module, sample: Any, *, loss_fn: Callable | None, blocks: Any,
            profile: ModelProfile | None) -> Callable[[str], ModelProfile]:
    """A precision's trace of the model, as the cost model reads a variant: no graph count (the search reads the
    profile's), and with the weights' values where the profile's step needed them."""
    def trace(precision: str) -> ModelProfile:
        return profile_model(model, sample, loss_fn=loss_fn, blocks=blocks, warn=False, precision=precision,
                             graphs=False, weight_values=profile is not None and profile.traced_with_weight_values)
    return trace


def _seeded(profile: ModelProfile | None) -> dict[str, ModelProfile | None]:
    """The variants a profile already is: itself, where it was traced in a precision other than fp32."""
    return {profile.profile_precision: profile} if profile is not None and profile.profile_precision != "fp32" \
        else {}


def _resolved(variants: Mapping[str, ModelProfile], precisions: Sequence[str]) -> dict[str, ModelProfile]:
    """The precisions' traces made now, those that cannot be traced left out."""
    return {p: v for p in precisions if (v := variants.get(p)) is not None}


def base_profile(model: nn.Module, sample: Any, *, loss_fn: Callable | None, blocks: Any, warn: bool, bf16: bool,
                  graphs: bool = True) -> ModelProfile:
    """The profile the planner reads: on hardware with bf16 the autocast (bf16) trace, since the search offers only
    bf16 plans there and an fp32 trace would be read for nothing but the model's structure (the predictions of
    every bf16 plan are the same from either: tests/test_trace_memo.py); elsewhere, or where the bf16 step cannot
    be traced, the fp32 trace (with its own fallbacks, autopar.profile), with a note that says so (the bf16 plans
    are then predicted from it, and may not run: wrap's measurement on a GPU refuses a plan whose step runs in no
    mode)."""
    failed: TraceError | None = None
    if bf16:
        try:
            return profile_model(model, sample, loss_fn=loss_fn, blocks=blocks, warn=warn, precision="bf16",
                                 graphs=graphs)
        except TraceError as exc:
            failed = exc
    profile = profile_model(model, sample, loss_fn=loss_fn, blocks=blocks, warn=warn, graphs=graphs)
    if failed is not None:
        cause = failed.__cause__ or failed  # the step's own error, where the TraceError chains it
        text = str(cause).strip()
        reason = f"{type(cause).__name__}: {text.splitlines()[0][:200]}" if text else type(cause).__name__
        if isinstance(cause, NoCudaBf16KernelError):  # it cannot run in bf16 on a GPU: fp32 plans only
            note = f"its bf16 step cannot run on a GPU ({text}): autopar plans it in fp32"
            profile = dataclasses.replace(profile, notes=(*profile.notes, note), bf16_refusal=text)
        else:
            note = (f"its bf16 step could not be traced ({reason}): its bf16 plans are predicted from the fp32 "
                    "trace, and may not run (wrap measures the chosen plan's step on a GPU and refuses one that "
                    "runs no step)")
            profile = dataclasses.replace(profile, notes=(*profile.notes, note))
        if warn:
            warnings.warn("autopar: " + note, stacklevel=2)
    return profile


#: The bf16 traces the cost model reads: under autocast, and with bf16 weights (FSDP's mixed precision).
BF16_PRECISIONS = ("bf16", "bf16-pure")


def bf16_variants(model: nn.Module, sample: Any, topology: Topology, *, loss_fn: Callable | None = None,
                  blocks: Any = None, profile: ModelProfile | None = None,
                  precisions: Sequence[str] = BF16_PRECISIONS) -> dict[str, ModelProfile]:
    """The model traced in bf16 under autocast ("bf16") and with bf16 weights ("bf16-pure"), which the cost
    model reads for bf16 plans; empty where the hardware has no bf16. A precision whose step cannot be traced
    is left out (the cost model then reads the profile: see cost.memory.activation_profile); `profile`, the
    profile already made, is reused where it is itself one of these traces. `precisions`: the traces to make
    (one process never runs FSDP's bf16 weights, unless it offloads: wrap asks for "bf16" alone there)."""
    if not has_bf16(topology):
        return {}
    traced = TracedVariants(_tracer(model, sample, loss_fn=loss_fn, blocks=blocks, profile=profile), precisions,
                            _seeded(profile))
    return _resolved(traced, precisions)


def with_graphs_prediction(plan: Plan, profile: ModelProfile, topology: Topology, calibration: Calibration,
                           variants: Mapping[str, ModelProfile] | None) -> Plan:
    """`plan` with the cost model's step for its compiled graphs replayed as CUDA graphs in its prediction
    (`graphs_step_s`), where they could run (the whole model compiled in one process on a GPU): what makes wrap race
    them (autopar.race.races_graphs)."""
    if not (plan.compiles_whole_model and not plan.cuda_graphs and topology.is_gpu and plan.prediction):
        return plan
    graphs = predict_profile(profile, plan.replace(cuda_graphs=True), topology, calibration, variants=variants)
    return plan.replace(prediction={**plan.prediction, "graphs_step_s": float(graphs.time.step_s)})


def check_traced_for(profile: ModelProfile, topology: Topology) -> None:
    """A TraceError where the profile was traced only in bf16 (its fp32 step could not be) and the hardware
    has no bf16: no plan can be predicted there."""
    if profile.traced and profile.profile_precision != "fp32" and not has_bf16(topology):
        raise TraceError(f"only the {profile.profile_precision} step of {profile.model_class} can be traced on fake "
                         f"tensors, not its fp32 one (the profile's notes say why), and {topology.device.name} has "
                         "no bf16: no plan for it can be predicted here")


def has_bf16(topology: Topology) -> bool:
    return topology.is_gpu and topology.device.supports("bf16")


def calibration_for(topology: Topology, *, profile: ModelProfile | None = None) -> Calibration:
    """The calibration plans on this topology are predicted with: the topology's cached one (measured), else
    the defaults; with `profile`, then the tuner's refit of that model at that sample size where one is cached
    (autopar.calibration_cache: refits are per model, so another model never inherits one). A cached file in
    use is logged (once per file and content in a process) with what it changes, and named in the returned
    calibration's `source`, which a prediction records (`Prediction.calibration_source`)."""
    defaults = _default_calibration(topology)
    fingerprint = topology.fingerprint()
    path = calibration_path(fingerprint)
    cal = _read_cache(lambda: load_calibration(fingerprint), path)
    if cal is None:
        cal = defaults
    else:
        _announce(path, f"this topology's calibration ({cal.source})", _changes(defaults, cal))
        cal = cal.replace(source=f"{cal.source}, cached in {path}")
    if profile is None:
        return cal
    key = dict(model_fingerprint=profile.fingerprint, sample_signature=sample_signature(profile))
    refit = _read_cache(lambda: load_refit(fingerprint, **key), refit_path(fingerprint, **key))
    if refit is None:
        return cal
    refitted = _read_cache(lambda: refit.apply(cal), refit.path)  # a factor the calibration refuses
    if refitted is None:
        return cal
    _announce(refit.path, f"this model's refit ({refit.source})", _changes(cal, refitted))
    return refitted


def _default_calibration(topology: Topology) -> Calibration:
    if not topology.is_gpu:  # no CUDA context or caching allocator on a CPU
        return Calibration(context_bytes=0.0, reserve_bytes=0.0, fragmentation_fraction=0.0, largest_reserve_factor=0.0,
                           source="defaults for CPU processes (no CUDA context or allocator reserve)")
    return Calibration()


def _read_cache(load: Callable[[], Any], path: Path) -> Any:
    """What `load` reads from the calibration cache, or None with a warning where the file is refused: an
    unreadable cache never stops planning, and never goes unsaid."""
    try:
        return load()
    except (AutoparError, OSError, ValueError) as exc:  # a refused file (CacheError), a bad factor
        warnings.warn(f"the cached calibration {path} was not used ({exc}); predicting without it.", stacklevel=3)
        return None


#: (file, what it changes) already logged in this process: a loop of predictions says it once.
_ANNOUNCED: set[tuple[str, str]] = set()


def _announce(path: Path, what: str, changes: str) -> None:
    if (str(path), changes) in _ANNOUNCED:
        return
    _ANNOUNCED.add((str(path), changes))
    get_logger().info("predicting with the calibration cached in %s, %s: %s; remove the file to predict without it.",
                      path, what, changes)


def _changes(before: Calibration, after: Calibration) -> str:
    """The factors `after` changes of `before`, as "name before -> after" (or "nothing")."""
    moved = [f"{f.name} {getattr(before, f.name):.3g} -> {getattr(after, f.name):.3g}"
             for f in dataclasses.fields(Calibration)
             if isinstance(getattr(before, f.name), float) and getattr(before, f.name) != getattr(after, f.name)]
    return ", ".join(moved) or "nothing"


def _inputs(model_or_profile: nn.Module | ModelProfile, sample: Any, topology: Topology, loss_fn: Callable | None,
            blocks: Any, variants: Mapping[str, ModelProfile] | None) -> tuple[ModelProfile, Mapping[str, ModelProfile]]:
    """The profile and the precision variants the search reads: a model is profiled here (sample needed)."""
    if isinstance(model_or_profile, ModelProfile):  # the mapping as given: it may trace a variant on first use
        return model_or_profile, (variants if variants is not None else {})
    if not isinstance(model_or_profile, nn.Module):
        raise TypeError(f"pass an nn.Module (with sample=) or an autopar.ModelProfile, got "
                        f"{type(model_or_profile).__name__}.")
    if sample is None:
        raise PlanError("a model needs sample= (one batch as one rank's loop feeds it) to be profiled.")
    profile, traced = profile_variants(model_or_profile, sample, topology, loss_fn=loss_fn, blocks=blocks, lazy=True)
    return profile, (collections.ChainMap(dict(variants), traced) if variants else traced)  # yours first


def candidates(
    model_or_profile: nn.Module | ModelProfile,
    *,
    sample: Any = None,
    topology: Topology | str | None = None,
    world_size: int | None = None,
    global_batch_size: int | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    blocks: Any = None,
    variants: Mapping[str, ModelProfile] | None = None,
    calibration: Calibration | None = None,
    loop: Loop | str | None = None,
    headroom: float = 0.95,
    verify: int = 0,
    model_fn: Callable[[], nn.Module] | nn.Module | None = None,
    eager: bool = True,
    allow_train_step: bool | None = None,
) -> list[Candidate]:
    """Every plan the search considers for this model on this hardware, predicted and ranked: the ones
    that fit first, fastest first, then the ones dropped, each with its reason.

    `global_batch_size` defaults to the sample's batch times the world size (the topology's GPUs).
    `loop` (autopar.plans.Loop) is what drives the step: by default "train_step" (every plan); "plain" keeps
    to plans a plain loop runs (pure data parallelism), as `wrap` does unless told otherwise; "accumulates"
    (a framework such as the Hugging Face Trainer) leaves out pipelines. `allow_train_step=` is its deprecated
    spelling (True: "train_step", False: "plain"). `headroom`: the share of a GPU's memory a plan may fill.
    `verify=N` runs the exact memory check (autopar.exact) on the N best candidates (a few seconds
    to minutes each, no memory used) and drops those it finds too big; it builds the model with
    `model_fn()` (or copies a meta-device model) and needs `sample`. Eager plans are ranked beside compiled
    ones (compile is chosen where the prediction says it pays); `eager=False` keeps compiled ones only
    (autopar.search.search).
    """
    loop = _candidates_loop(loop, allow_train_step)
    topo = resolve_topology(topology)
    world = world_size or topo.world_size
    profile, var = _inputs(model_or_profile, sample, topo, loss_fn, blocks, variants)
    if global_batch_size is None:
        global_batch_size = (sample_batch_size(sample) if sample is not None else profile.sample_batch_size) * world
    if not 0 < headroom <= 1:
        raise PlanError(f"headroom is the share of a GPU's memory a plan may fill, in (0, 1]; got {headroom}.")
    cal = calibration or calibration_for(topo, profile=profile)
    tp_refusal = tensor_parallel_refusal(model_or_profile, profile) if isinstance(model_or_profile, nn.Module) else None
    ranked = search(profile, topo, world_size=world, global_batch_size=global_batch_size, variants=var,
                    calibration=cal, loop=loop, headroom=headroom, eager=eager,
                    tp_refusal=tp_refusal)
    if verify:
        if model_fn is None:
            if not isinstance(model_or_profile, nn.Module) or not all(
                    t.is_meta for t in list(model_or_profile.parameters()) + list(model_or_profile.buffers())):
                raise PlanError("verify= needs model_fn= (a function that builds the model), or a model on the meta "
                                "device: the exact check builds its own copy without memory.")
            model_fn = model_or_profile  # exact_memory copies a meta-device model
        if sample is None:
            raise PlanError("verify= needs sample= (one data-parallel rank's batch) for the exact check.")
        ranked = verify_candidates(ranked, model_fn, sample, top=verify, topology=topo, loss_fn=loss_fn,
                                   blocks=blocks, headroom=headroom)
    return ranked


def _candidates_loop(loop: Loop | str | None, allow_train_step: bool | None) -> Loop:
    """candidates' loop: `loop`, else the deprecated `allow_train_step` (True: TRAIN_STEP, False: PLAIN), else
    TRAIN_STEP (every plan)."""
    if allow_train_step is None:
        return Loop.TRAIN_STEP if loop is None else Loop.parse(loop)
    if loop is not None:
        raise PlanError("pass loop= only: allow_train_step= is its deprecated spelling "
                        "(allow_train_step=False is loop='plain').")
    warnings.warn("autopar.candidates: allow_train_step= is deprecated; pass loop='train_step' (True) or "
                  "loop='plain' (False).", DeprecationWarning, stacklevel=3)
    return Loop.TRAIN_STEP if allow_train_step else Loop.PLAIN


def verify_candidates(ranked: Sequence[Candidate], model_fn: Callable[[], nn.Module] | nn.Module, sample: Any, *,
                      top: int, topology: Topology, loss_fn: Callable | None = None, blocks: Any = None,
                      headroom: float = 0.95, progress: Callable[[int, int], None] | None = None
                      ) -> list[Candidate]:
    """Check the `top` best feasible candidates with the exact memory check: each gets its `exact` result;
    one whose traced peak plus the predicted allocator and context overhead exceeds `headroom` of a GPU's
    memory is dropped with that reason. The check traces the eager step: for a compiled plan its peak is an
    upper bound (compile saves fewer activations), reported but never the reason to drop it. CPU-offload
    plans are not checked (their state lives in host memory). `progress(checked, total)` is called before the
    first check and after each. Returns the list re-ranked."""

    if top < 0:
        raise PlanError(f"verify must be a non-negative number of candidates, got {top}.")
    budget = headroom * topology.device.memory_bytes
    out, checked = [], 0
    total = min(top, sum(1 for c in ranked if c.feasible and not c.plan.cpu_offload))
    if progress is not None:
        progress(0, total)
    for c in ranked:
        if c.feasible and checked < top and not c.plan.cpu_offload:  # offloaded state lives in host memory
            exact = exact_memory(model_fn, sample, c.plan, topology=topology, loss_fn=loss_fn, blocks=blocks)
            checked += 1
            if progress is not None:
                progress(checked, total)
            assert c.prediction is not None
            need = exact.peak_bytes + c.prediction.memory.overhead_bytes
            plan = c.plan.replace(prediction={**(c.plan.prediction or {}), "exact_allocated_bytes": exact.peak_bytes})
            if need > budget and not c.plan.compile:
                c = dataclasses.replace(c, plan=plan, feasible=False, exact=exact,
                                        drop=Drop.memory(need, budget, exact=True))
            else:
                c = dataclasses.replace(c, plan=plan, exact=exact)
        out.append(c)
    out.sort(key=rank_key)
    return out


def predict(
    model_or_profile: nn.Module | ModelProfile,
    plan: Plan,
    *,
    sample: Any = None,
    topology: Topology | str | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    blocks: Any = None,
    variants: Mapping[str, ModelProfile] | None = None,
    calibration: Calibration | None = None,
) -> Prediction:
    """The cost model's prediction for one plan: `.memory` (peak bytes per GPU, by part), `.time` (step
    seconds, by part), `.tokens_per_s`, `.mfu`. The topology must have the plan's number of GPUs."""
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be an autopar.Plan, got {type(plan).__name__}.")
    topo = resolve_topology(topology)
    if topo.is_gpu and topo.world_size != plan.world_size:
        raise PlanError(f"the plan runs on {plan.world_size} GPUs but the topology has {topo.world_size}: give a "
                        f"topology spec with {plan.world_size} GPUs (e.g. '{plan.world_size}x{topo.device.name}').")
    profile, var = _inputs(model_or_profile, sample, topo, loss_fn, blocks, variants)
    return predict_profile(profile, plan, topo, calibration or calibration_for(topo, profile=profile), variants=var)


def describe_candidates(ranked: Sequence[Candidate], *, limit: int = 10, dropped: int = 5) -> str:
    """A table of the best `limit` feasible candidates, then why the others were dropped: their reasons
    grouped (`dropped_reasons`), the `dropped` most common first."""
    feasible = [c for c in ranked if c.feasible]
    shown = feasible[:limit]
    width = max([56] + [len(short_name(c.plan)) for c in shown])
    rows = [f"rank  {'plan':<{width}}  memory/GPU       step      tokens/s     MFU"]
    for i, c in enumerate(shown, 1):
        p = c.prediction
        assert p is not None
        tokens = f"{p.tokens_per_s:12,.0f}" if p.tokens_per_s is not None else f"{p.samples_per_s:9,.1f} sa/s"
        rows.append(f"{i:>4}  {short_name(c.plan):<{width}}  {p.memory_bytes / GiB:7.1f} GiB  {_ms(p.step_s)}"
                    f"  {tokens}  {p.mfu:6.1%}")
    if len(feasible) > limit:
        rows.append(f"      ... and {len(feasible) - limit} more that fit")
    groups = dropped_reasons(ranked)
    if groups:
        total = sum(n for n, _ in groups)
        rows.append(f"dropped: {total} plan{'s' if total != 1 else ''}")
        for n, why in groups[:dropped]:
            rows.append(f"  {n:>6}  {why}")
        if len(groups) > dropped:
            rest = sum(n for n, _ in groups[dropped:])
            rows.append(f"  {rest:>6}  for {len(groups) - dropped} other reasons")
    return "\n".join(rows)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.1f} ms" if seconds < 10 else f"{seconds:9.2f} s"


#: How `dropped_reasons` names the group of dominated plans.
DOMINATED_GROUP = ("dominated: the same plan with less recomputation (checkpointing) or without resharding "
                   "after forward also fits, and is no slower")


def dropped_reasons(ranked: Sequence[Candidate]) -> list[tuple[int, str]]:
    """Why the candidates that are not feasible were dropped, grouped: (how many, why), the largest group
    first. Plans that do not fit in memory form one group (per budget), with the smallest need among
    them; dominated plans one group; other reasons one group each."""
    memory: dict[str, list[float]] = {}  # the budget, as printed -> the needs of the plans over it, GiB
    host: dict[str, list[float]] = {}  # the same, for host memory per node
    other: dict[str, int] = {}
    for c in ranked:
        if c.feasible:
            continue
        drop = c.drop
        if drop is not None and drop.kind in (DropKind.MEMORY, DropKind.HOST_MEMORY):
            assert drop.needed_bytes is not None and drop.limit_bytes is not None
            into = memory if drop.kind is DropKind.MEMORY else host
            into.setdefault(f"{drop.limit_bytes / GiB:.1f}", []).append(drop.needed_bytes / GiB)
            continue
        reason = DOMINATED_GROUP if drop is not None and drop.kind is DropKind.DOMINATED else (c.reason or "not feasible")
        other[reason] = other.get(reason, 0) + 1
    groups = [(len(needs), f"need more memory than {budget} GiB per GPU (the smallest needs {min(needs):.2f} GiB)")
              for budget, needs in memory.items()]
    groups += [(len(needs), f"CPU offload: need more host memory than {budget} GiB per node (the smallest needs "
                f"{min(needs):.1f} GiB)") for budget, needs in host.items()]
    groups += [(n, why) for why, n in other.items()]
    return sorted(groups, key=lambda g: -g[0])


def short_name(plan: Plan) -> str:
    """A plan in one line, as the tables print it: the mesh (e.g. "pp2xfsdp4", "1gpu"), the micro-batch,
    then the options that differ from the defaults ("acc4 1f1b ac:selective bf16 compile sp no-reshard")."""
    mesh = "x".join(f"{k}{v}" for k, v in (("pp", plan.pp), ("rep", plan.dp_replicate), ("fsdp", plan.dp_shard),
                                          ("tp", plan.tp)) if v > 1) or "1gpu"
    parts = [mesh, f"mb{plan.micro_batch_size}"]
    if plan.grad_accum > 1:
        parts.append(f"acc{plan.grad_accum}")
    if plan.pp > 1:
        parts.append(f"{plan.pp_schedule}" + (f"/v{plan.pp_stages_per_rank}" if plan.pp_stages_per_rank > 1 else ""))
    if plan.checkpointing != "none":
        parts.append(f"ac:{plan.checkpointing}" + (f"/{plan.checkpoint_every}" if plan.checkpoint_every > 1 else ""))
    parts.append(plan.precision)
    if plan.float8:
        parts.append("fp8" if plan.float8_recipe == "tensorwise" else f"fp8-{plan.float8_recipe}")
    if plan.compile:
        parts.append("compile" + ("+graphs" if plan.cuda_graphs else "") + ("+autotune" if plan.max_autotune else ""))
    if plan.sequence_parallel:
        parts.append("sp")
    if plan.uses_fsdp and not plan.reshard_after_forward:
        parts.append("no-reshard" if plan.zero_stage == 3 else f"zero{plan.zero_stage}")
    if plan.cpu_offload:
        parts.append("offload")
    return " ".join(parts)


