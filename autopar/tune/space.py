"""A study's search space: the feasible plans, their names and predictions, the trial parameters Optuna
sees, the sampler over them, and autopar's queue of plans to run next.

The space is built once, from the cost model's feasible candidates (autopar.search.search), and stored in
the study (`autopar.space`), so a resumed study uses the same plans. Optuna sees each plan as parameters
it can show (optuna-dashboard): `plan`, the plan's readable name (planning's one-line summary, e.g.
"fsdp2 mb4 fp32"), and every strategy field of the plan (pp, dp_replicate, dp_shard, tp,
micro_batch_size, grad_accum, checkpointing, precision, compile, cpu_offload, ...), each a categorical
distribution over the values in the space. The sampler (`PlanSampler`) proposes `plan` with a seeded TPE;
the fields follow the plan proposed, so a trial's parameters are always one plan of the space.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from ..errors import InfeasiblePlanError
from ..planning import dropped_reasons, short_name
from ..plans import Loop, Plan
from ..search import search
from .schema import PARAM, STUDY_QUEUE, STUDY_SPACE, trial_key

if TYPE_CHECKING:  # optuna loads when a study runs, not on `import autopar` (which imports autotune)
    from optuna.distributions import BaseDistribution
    from optuna.samplers import BaseSampler

#: The plan's fields that are trial parameters beside `plan`, in the order the dashboard lists them.
FIELDS = (*Plan().strategy(), "zero_stage")  # strategy() leaves zero_stage out at its default


def unit_of(profile: Any) -> str:
    """The throughput a study maximises: tokens/s for inputs with a sequence, else samples/s."""
    return "tokens/s" if profile.tokens_per_sample else "samples/s"


def build_space(probe: Any, *, calibration: Any, loop: Loop, eager: bool,
                max_space: int, max_autotune: bool = False) -> tuple[list[dict[str, Any]], int]:
    """The space's entries (what `autopar.space` stores), best predicted first, and how many candidates
    the search ranked. Raises InfeasiblePlanError when no plan fits."""
    profile = probe.profile
    ranked = search(profile, probe.topology, world_size=probe.world_size, global_batch_size=probe.global_batch_size,
                    variants=dict(probe.variants or {}), calibration=calibration,
                    loop=loop, eager=eager, measured=True, max_autotune=max_autotune)
    feasible = [c for c in ranked if c.feasible][:max_space]
    if not feasible:
        why = "; ".join(f"{n} {r}" for n, r in dropped_reasons(ranked)[:3]) or "no plan was enumerated"
        raise InfeasiblePlanError(f"no plan fits this model on this hardware, so there is nothing to tune ({why}).")
    unit = unit_of(profile)
    entries, names = [], set()
    for c in feasible:
        p, short = c.prediction, short_name(c.plan)
        name = short if short not in names else f"{short} ({c.plan.key()[:6]})"
        names.add(name)
        throughput = p.tokens_per_s if unit == "tokens/s" else p.samples_per_s
        entries.append({"key": c.plan.key(), "name": name, "short": short, "plan": c.plan.to_yaml(),
                        "predicted": {"step_s": float(p.step_s), "throughput": float(throughput),
                                      "memory_bytes": float(p.memory.peak_bytes),
                                      "allocated_bytes": float(p.memory.allocated_bytes), "mfu": float(p.mfu)}})
    return entries, len(ranked)


@dataclass(frozen=True)
class Space:
    """The plans of a study, read from its `autopar.space` attribute (format 2)."""

    entries: tuple[Mapping[str, Any], ...]
    keys: tuple[str, ...]  # best predicted first
    plans: Mapping[str, Plan]  # by key
    names: Mapping[str, str]  # key -> readable name (the parameter `plan`)
    keys_by_name: Mapping[str, str]
    distributions: Mapping[str, BaseDistribution]  # `plan` first, then FIELDS

    @classmethod
    def from_attrs(cls, attrs: Mapping[str, Any]) -> "Space":
        from optuna.distributions import CategoricalDistribution  # lazy: optuna loads when a study runs

        entries = tuple(attrs[STUDY_SPACE])
        keys = tuple(e["key"] for e in entries)
        plans = {e["key"]: Plan.from_yaml(e["plan"], source="the study's search space") for e in entries}
        names = {e["key"]: e.get("name") or e["key"] for e in entries}
        distributions: dict[str, BaseDistribution] = {PARAM: CategoricalDistribution([names[k] for k in keys])}
        for field_name in FIELDS:
            values: list[Any] = []
            for k in keys:
                v = getattr(plans[k], field_name)
                if v not in values:
                    values.append(v)
            distributions[field_name] = CategoricalDistribution(values)
        return cls(entries=entries, keys=keys, plans=plans, names=names,
                   keys_by_name={n: k for k, n in names.items()}, distributions=distributions)

    def predicted(self, key: str) -> Mapping[str, Any]:
        return next(e.get("predicted", {}) for e in self.entries if e["key"] == key)

    def params_of(self, key: str) -> dict[str, Any]:
        """A plan's trial parameters: its name and its fields (what enqueue_trial is given)."""
        plan = self.plans[key]
        return {PARAM: self.names[key], **{f: getattr(plan, f) for f in FIELDS}}

    def key_of(self, trial: Any) -> str | None:
        """The plan key of an Optuna trial of this study (FrozenTrial or Trial)."""
        return trial_key(trial.params, trial.user_attrs, self.keys_by_name)


class PlanSampler:
    """Optuna's sampler for a study's space: `sampler` (a seeded TPE) proposes the parameter `plan`; each plan
    field is the value of the plan proposed, so the sampler never proposes a plan outside the space.

    It has the methods of optuna.samplers.BaseSampler that a study calls, without subclassing it, so that
    defining it does not import optuna (which loads only when a study runs)."""

    def __init__(self, space: Space, sampler: BaseSampler) -> None:
        self._space, self._sampler = space, sampler

    def infer_relative_search_space(self, study: Any, trial: Any) -> dict[str, BaseDistribution]:
        return {}

    def sample_relative(self, study: Any, trial: Any, search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        return {}

    def sample_independent(self, study: Any, trial: Any, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        if param_name == PARAM:
            return self._sampler.sample_independent(study, trial, param_name, param_distribution)
        key = self._space.keys_by_name[trial.params[PARAM]]
        return getattr(self._space.plans[key], param_name)

    def before_trial(self, study: Any, trial: Any) -> None:
        self._sampler.before_trial(study, trial)

    def after_trial(self, study: Any, trial: Any, state: Any, values: Sequence[float] | None) -> None:
        self._sampler.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self._sampler.reseed_rng()


class Queue:
    """autopar's queue of plans to run before the sampler's (the study attribute `autopar.queue`): entries
    {"key", "source"}. It is autopar's own rather than Optuna's waiting trials, so that a stale trial's retry
    can go first (Optuna pops its waiting trials oldest first)."""

    def __init__(self, study: Any) -> None:
        self._study = study
        self.entries: list[dict[str, Any]] = [dict(e) for e in study.user_attrs.get(STUDY_QUEUE, [])]

    @staticmethod
    def initial(entries: Sequence[Mapping[str, Any]], top_k: int) -> list[dict[str, str]]:
        """The queue a new study starts with: the `top_k` best predicted plans, in predicted order."""
        return [{"key": e["key"], "source": f"enqueued: predicted rank {rank}"}
                for rank, e in enumerate(entries[:max(0, top_k)], 1)]

    def put_first(self, entries: Sequence[Mapping[str, Any]]) -> None:
        if entries:
            self.entries = [dict(e) for e in entries] + self.entries
            self.save()

    def head(self, decided: Callable[[str], bool]) -> Mapping[str, Any] | None:
        """The first entry whose plan is not decided yet (decided ones, measured since they were queued,
        are dropped), or None."""
        while self.entries and decided(self.entries[0]["key"]):
            self.entries.pop(0)
        return self.entries[0] if self.entries else None

    def pop(self) -> None:
        self.entries.pop(0)
        self.save()

    def save(self) -> None:
        self._study.set_user_attr(STUDY_QUEUE, self.entries)
