"""wrap's decision as it travels between ranks (`Decision`), the global batch, and wrap's own cache on every rank:
the key of the model and job on rank 0 (no trace), the cached plan sent to every rank, the choice stored after it
was applied. Orchestrated by autopar.api (its `wrap`)."""

from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch.nn as nn

from . import wrap_cache
from ._util import dist as _dist
from ._util.batch import sample_batch_size
from ._util.io import CacheWarning
from ._util.progress import phase
from .errors import CacheError, PlanError
from .plan_cache import cache_key as plan_cache_key
from .plan_cache import plans_folder
from .planning import resolve_topology
from .plans import Loop, Plan
from .profile import ModelProfile, profile_model
from .profile.build import NOT_TRACED_NOTE
from .topology import Topology


#: The note of the profile a cached wrap plans from: its structure now, the rest from wrap's cache.
CACHED_NOTE = ("not traced now: the step's FLOPs are those traced when wrap's cache stored this plan, and the "
               "plan's prediction and measurements are that wrap's")


@dataclass(frozen=True)
class Decision:
    """Rank 0's decision: the plan and where it came from, or the error every rank must raise."""

    plan: Plan | None
    source: str  # "given", "from the plan cache", "chosen by the cost model" or SAFE_SOURCE
    cache_note: str | None = None  # what the plan cache said (a hit, or why a stored plan was not used)
    error: BaseException | None = None
    warning: str | None = None  # said once on rank 0 (why a safe plan, and what it costs)


def global_batch_of(sample: Any, global_batch_size: int | None, readers: int) -> int:
    """The global batch: as given, else the sample's batch times the number of ranks that read different
    data (every process today; a given plan's data-parallel degree)."""
    if global_batch_size is None:
        return sample_batch_size(sample) * readers
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise PlanError(f"global_batch_size must be a positive integer, got {global_batch_size!r}.")
    return global_batch_size


def check_same_batch(sample: Any) -> None:
    smallest, largest = _dist.min_max(sample_batch_size(sample))
    if smallest != largest:  # every rank raises the same error (one raising alone leaves the others hanging)
        raise PlanError(f"the ranks were given samples of different batch sizes ({smallest} to {largest} samples): "
                        "give every rank one data-parallel rank's batch, the same size on each (the last, smaller "
                        "batch of an epoch too: drop it, as autopar.dataloader does).")


#: Where a plan came from when wrap's own cache held it (`Decision.source`).
WRAP_CACHE_SOURCE = "from wrap's cache"


def wrap_key_of(model: nn.Module, sample: Any, *, topology: Topology | str | None, loss_fn: Callable | None,
              blocks: Any, global_batch_size: int | None, world: _dist.World, loop: Loop) -> Any:
    """Rank 0: the wrap cache's key of this model and job (no trace; before the plan changes the model), or None
    where the cache is off or the key cannot be made (the topology is then refused by the full path)."""
    if not wrap_cache.enabled():
        return None
    try:
        topo = resolve_topology(topology)
        with phase("the wrap cache's key of the model", say=False, key="cache_key"):
            return wrap_cache.wrap_key(model, sample, topology_fingerprint=topo.fingerprint(),
                                       world_size=world.size,
                                       global_batch_size=global_batch_of(sample, global_batch_size, world.size),
                                       loop=loop, loss_fn=loss_fn, blocks=blocks)
    except Exception:  # noqa: BLE001 - the full path reports what is wrong with the job, with its own message
        return None


def from_wrap_cache(model: nn.Module, sample: Any, key: Any, *, topology: Topology | str | None, blocks: Any,
                     global_batch_size: int | None, world: _dist.World, started: float,
                     warn: bool = False) -> tuple[Topology, ModelProfile, int, Decision | None] | None:
    """On every rank: (topology, the model's structure, global batch, rank 0's decision) when rank 0's wrap cache
    holds a plan for this model and job (`key`, rank 0's `wrap_key_of`), else None (every rank then plans as usual).
    A refused cache file raises on every rank (CacheError on rank 0, with the remedy). `warn`: the structure's
    notes (no repeated blocks) as UserWarnings, as the wrap that stored the plan warned them."""
    if not wrap_cache.enabled():
        return None
    text = None
    found: tuple[Plan, str] | None = None
    if world.rank == 0:
        text = ""
        try:
            entry = wrap_cache.lookup(key) if key is not None else None
        except Exception as exc:  # noqa: BLE001 - sent to every rank, raised on rank 0 as it is
            entry, text = None, f"error: {type(exc).__name__}: {exc}"
            failure = exc
        if entry is not None and entry.tuned_key and (plans_folder() / f"{entry.tuned_key}.yaml").exists():
            entry = None  # the tuner measured a plan for this model and job since: the full path uses it
        if entry is not None:
            found = entry.plan, entry.stored_at
            text = entry.plan.to_yaml()
    text = _dist.broadcast_text(text)
    if text.startswith("error: "):
        if world.rank == 0:
            raise failure
        raise PlanError(f"rank 0 could not read wrap's cache: {text[7:]}")
    if not text:
        return None
    topo = resolve_topology(topology)
    global_batch = global_batch_of(sample, global_batch_size, world.size)
    check_same_batch(sample)
    profile = profile_model(model, sample, blocks=blocks, warn=warn, trace=False)
    plan_text = Plan.from_yaml(text).prediction or {}
    traced = {name: plan_text.get(f"traced_{name}") for name in ("flops", "forward_flops")}
    if all(isinstance(v, (int, float)) and v >= 0 for v in traced.values()):  # the step's FLOPs, as traced then
        # (the summary's notes say so, in place of the untraced profile's "FLOPs unknown")
        notes = tuple(n for n in profile.notes if n != NOT_TRACED_NOTE) + (CACHED_NOTE,)
        profile = dataclasses.replace(profile, notes=notes, **{k: float(v) for k, v in traced.items()})
    weights = plan_text.get("traced_bf16_weights")
    if isinstance(weights, str) and weights:  # the weights the autocast forward gives in bf16, as traced then
        profile = dataclasses.replace(profile, bf16_weights=tuple(weights.split(",")))
    decision = None
    if found is not None:
        plan, stored_at = found
        prediction = {**{k: v for k, v in (plan.prediction or {}).items() if k != "planning_phases_s"},
                      "planning_s": round(time.perf_counter() - started, 2), "measuring_s": 0.0,
                      "cached_at": stored_at}  # the stored plan's own planning phases were that wrap's, not this one's
        decision = Decision(plan.replace(prediction=prediction), WRAP_CACHE_SOURCE,
                             f"using the plan wrap chose for this model and job on {stored_at[:10]} (wrap's cache; "
                             f"{wrap_cache.DISABLE_ENV}=1 plans afresh)")
    return topo, profile, global_batch, decision


def store_wrap_choice(plan: Plan, key: Any, profile: ModelProfile, topo: Topology, *, global_batch: int,
                       loop: Loop) -> None:
    """Rank 0: keep wrap's choice for the next wrap of this model and job; a cache that cannot be written is
    skipped with one warning (training goes on)."""
    try:
        tuned = plan_cache_key(profile, topo, global_batch_size=global_batch, loop=loop).digest()
        # the traced FLOPs go with it: a cache hit reads the model's structure only, and MFU needs them
        # and the weights autocast does not reach, which the autocast forward gives in bf16 (strategies.precision)
        plan = plan.replace(prediction={**(plan.prediction or {}), "traced_flops": float(profile.flops),
                                        "traced_forward_flops": float(profile.forward_flops),
                                        "traced_bf16_weights": ",".join(profile.bf16_weights)})
        wrap_cache.store(plan, key, tuned_key=tuned)
    except (CacheError, OSError) as exc:
        warnings.warn(f"autopar: wrap's choice was not cached ({exc}); the next wrap of this model plans afresh.",
                      CacheWarning, stacklevel=3)
