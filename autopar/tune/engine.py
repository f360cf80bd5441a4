"""The study engine: the ask-and-tell loop that runs a study's trials, shared by `tune` and `autotune`.

It opens (or resumes) the Optuna study, builds or reads the space (autopar.tune.space), fails the trials
a killed tuner left running, then loops: the next plan (autopar's queue, else the sampler), answered from
the study if already decided (autopar.tune.ledger), pruned if clearly slower (autopar.tune.refit), else
measured; after each measurement the calibration is refitted. At the end the best plan is cached. The
steps are described in autopar.tune.study and docs/tuning.md ("How a study runs").
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ..calibration_cache import save_refit
from ..cost.calibration import Calibration
from ..errors import AutoparError, ResultNotSavedError, TuneError
from ..plan_cache import (SOURCE_TUNER, cache_key, lookup, measured_throughput, path_for, sample_signature, store,
                          write_plan_out)
from ..planning import calibration_for, short_name
from ..plans import Loop, Plan
from .interrupt import held
from .ledger import Ledger, Measured
from .refit import StepModel
from .report import TuneReport, report_from_study
from .schema import (PARAM, STUDY_BEST, STUDY_CAL_BEFORE, STUDY_FIT, STUDY_FORMAT, STUDY_META, STUDY_NAME, STUDY_QUEUE,
                     STUDY_SPACE, STUDY_WALL)
from .space import PlanSampler, Queue, Space, build_space, unit_of
from .storage import create_or_load_study, study_lock

#: A plan whose corrected predicted step exceeds this times the best measured step is pruned (not run).
PRUNE_FACTOR = 1.5
#: The space holds at most this many feasible plans, the best predicted.
MAX_SPACE = 256
#: After this many repeats in a row, the best-predicted undecided plan is enqueued.
MAX_REPEATS = 3
STALE_CAUSE = "stale: the tuner stopped while it ran"
INTERRUPTED = "interrupted"  # the status (and a user attribute, true) of a trial whose tuner got SIGTERM or SIGINT


class KeptFasterPlanWarning(UserWarning):
    """A study's best was not cached: the plan already cached for the job was measured faster."""


class RefitRejectedWarning(UserWarning):
    """A study's calibration refit out of bounds, not saved (autopar.cost.calibration.RefitRejection)."""


@dataclass(frozen=True)
class Progress:
    """What a `progress` callback receives, at each event of a study.

    event: "start" (the space is ready), "trial" (a plan starts running), "result" (it ended: `status`),
    "pruned" (a plan skipped on its prediction), "done" (the study stopped: `message` says why)."""

    event: str
    measured: int  # plans measured so far in the study (ok or failed), the running one not included
    budget: int | None  # the trial budget
    number: int | None = None  # the Optuna trial number
    plan: str | None = None  # the plan, in one line (planning.short_name)
    status: str | None = None
    throughput: float | None = None  # this trial's measured throughput
    best: float | None = None  # the best measured so far
    best_plan: str | None = None
    unit: str = "tokens/s"
    message: str | None = None
    elapsed_s: float = 0.0


@dataclass(frozen=True)
class StudyOptions:
    """How a study runs (the keyword options of `tune` and `autotune`)."""

    trials: int | None = None
    time_budget_s: float | None = None
    loop: Loop = Loop.TRAIN_STEP  # what drives the step in the tuned job: which plans are tried
    top_k_enqueue: int = 5
    plan_out: str | os.PathLike[str] | None = None
    progress: Callable[[Progress], None] | None = None
    cache_directory: str | os.PathLike[str] | None = None
    seed: int | None = 0
    prune_factor: float = PRUNE_FACTOR
    max_space: int = MAX_SPACE
    eager: bool = True  # eager plans beside compiled ones in the space (autopar.search.search(eager=))
    max_autotune: bool = False  # compiled plans' max-autotune twins in the space (autopar.search.search)
    argv: Sequence[str] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "loop", Loop.parse(self.loop))  # "plain" and the like, or refused


def check_budget(trials: Any, time_budget_s: Any, steps: Any, warmup: Any, top_k: Any) -> None:
    for name, value, low in (("trials", trials, 1), ("steps", steps, 1), ("warmup", warmup, 0),
                             ("top_k_enqueue", top_k, 0)):
        if value is None and name == "trials":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise TuneError(f"{name} must be an integer of at least {low}, got {value!r}.")
    if time_budget_s is not None and not (isinstance(time_budget_s, (int, float)) and time_budget_s > 0):
        raise TuneError(f"time_budget_s must be a positive number of seconds, got {time_budget_s!r}.")


class StudyEngine:
    """One tuning study over a probed model. `probe`: a ProbeResult (or the same attributes); `measure(plan)`
    runs one plan and returns a TrialResult (or the same attributes); `study_path`: None for a study in
    memory; `started`: time.perf_counter() when the caller started (the time budget and wall time count
    from it)."""

    def __init__(self, probe: Any, measure: Callable[[Plan], Any], study_path: Path | None, options: StudyOptions,
                 *, started: float | None = None, lock_held: bool = False) -> None:
        self.probe, self.measure, self.study_path, self.options = probe, measure, study_path, options
        self.lock_held = lock_held  # the caller holds the study's lock (storage.study_lock) already
        self.started = time.perf_counter() if started is None else started
        self._wall_mark = self.started
        self.topology, self.profile = probe.topology, probe.profile
        self.variants = dict(probe.variants or {})
        self._rejected: tuple[object, str] | None = None  # the last refit rejection warned of: (problem, factor)

    def run(self) -> TuneReport:
        with contextlib.nullcontext() if self.lock_held else study_lock(self.study_path):
            self._open()
            self._emit("start", message=f"{len(self.space.keys)} feasible plans in the space; "
                                        f"{len(self.ledger.ok)} measured earlier")
            stopped = self._loop()
            report = self._finish(stopped)
            self._emit("done", message=stopped)
            return report

    # ---- opening the study --------------------------------------------------------------------------------
    def _open(self) -> None:
        import optuna  # lazy: optuna loads when a study runs, not on `import autopar` (which imports autotune)

        self.storage, self.study = create_or_load_study(self.study_path, STUDY_NAME)
        if STUDY_SPACE not in self.study.user_attrs:
            self._initialise()
        else:
            self._check_same_job()
        attrs = self.study.user_attrs
        self.space = Space.from_attrs(attrs)
        self.unit = attrs[STUDY_META]["unit"]
        self.model = StepModel(self.profile, self.topology, self.variants, self.space.plans,
                               Calibration.from_dict(attrs[STUDY_CAL_BEFORE]))
        self.queue = Queue(self.study)
        self._fail_stale()
        # The sampler: seeded, and re-seeded by the trials so far, so that a resumed study does not replay the
        # first run's random proposals.
        trials = self.study.get_trials(deepcopy=False)
        seed = None if self.options.seed is None else self.options.seed + len(trials)
        self.study.sampler = PlanSampler(self.space, optuna.samplers.TPESampler(seed=seed))
        self.ledger = Ledger.from_trials(trials, self.space.key_of)
        self._refit()

    def _job(self) -> dict[str, Any]:
        """What a study is a study of: a resumed study must match it (`_check_same_job`)."""
        return {"model_fingerprint": self.probe.model_fingerprint or self.profile.fingerprint,
                "topology_fingerprint": self.topology.fingerprint(), "world_size": int(self.probe.world_size),
                "global_batch_size": int(self.probe.global_batch_size),
                "loop": self.options.loop.value, "eager": bool(self.options.eager),
                "max_autotune": bool(self.options.max_autotune)}

    def _initialise(self) -> None:
        opts = self.options
        base = calibration_for(self.topology, profile=self.profile)
        entries, candidates = build_space(self.probe, calibration=base, loop=opts.loop,
                                          eager=opts.eager, max_space=opts.max_space,
                                          max_autotune=opts.max_autotune)
        meta = {"format": STUDY_FORMAT, **self._job(), "device": self.topology.device.name,
                "unit": unit_of(self.profile), "tokens_per_sample": self.profile.tokens_per_sample,
                "candidates": candidates, "argv": list(opts.argv) if opts.argv is not None else None,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        self.study.set_user_attr(STUDY_META, meta)
        self.study.set_user_attr(STUDY_CAL_BEFORE, base.to_dict())
        self.study.set_user_attr(STUDY_QUEUE, Queue.initial(entries, opts.top_k_enqueue))
        self.study.set_user_attr(STUDY_SPACE, entries)  # last: its presence marks the study as initialised

    def _check_same_job(self) -> None:
        meta = self.study.user_attrs.get(STUDY_META, {})
        if meta.get("format") != STUDY_FORMAT:
            raise AutoparError(f"{self.study_path} was written by another autopar (study format {meta.get('format')}, "
                               f"this one writes {STUDY_FORMAT}): use a new --study file.")
        meta = _upgraded_meta(meta)
        defaults = {"eager": True, "max_autotune": False}  # a study older than the option ran at its default
        diffs = [f"{k} {meta.get(k, defaults.get(k))!r} there, {v!r} here"
                 for k, v in self._job().items() if meta.get(k, defaults.get(k)) != v]
        if diffs:
            raise AutoparError(f"{self.study_path} is a study of another job ({'; '.join(diffs)}): resume it with the "
                               "same model, hardware, batch, --loop, --compiled-only and --max-autotune settings, or "
                               "use a new --study file.")

    def _fail_stale(self) -> None:
        """Trials left RUNNING by a killed tuner (we hold the lock, so no live tuner runs them): FAIL, "stale",
        and their plans put first in the queue, so they run first when the study goes on."""
        from optuna.trial import TrialState  # lazy, as in _open

        retries = []
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            self.storage.set_trial_user_attr(t._trial_id, "status", "stale")
            self.storage.set_trial_user_attr(t._trial_id, "cause", STALE_CAUSE)
            self.storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            key = self.space.key_of(t)
            if key in self.space.plans:
                retries.append({"key": key, "source": f"retry of stale trial {t.number}"})
        self.queue.put_first(retries)

    # ---- calibration ----------------------------------------------------------------------------------
    def _refit(self) -> None:
        """Refit the calibration to every plan measured (autopar.tune.refit); from 2 measured plans on, record it,
        with its predictions of the measured plans, in the study, and save a refit within bounds for this model
        on this topology (never for the topology alone: another model must not inherit it). A refit out of bounds
        is not saved, and said in one line (once per distinct reason)."""
        self.fit = self.model.refit(list(self.ledger.ok.values()))
        if self.fit.runs < 2:
            return
        if self.fit.accepted:
            try:
                save_refit(self.fit.calibration, topology_fingerprint=self.topology.fingerprint(),
                           model_fingerprint=self.profile.fingerprint, sample_signature=sample_signature(self.profile))
            except (OSError, AutoparError) as exc:  # the study goes on; the fit is in the study too
                warnings.warn(f"could not save the fitted calibration: {exc}", stacklevel=2)
        elif self.fit.rejection is not None and (self.fit.rejection.problem, self.fit.rejection.factor) != self._rejected:
            # once per reason: the fitted value in the message moves with every trial
            self._rejected = (self.fit.rejection.problem, self.fit.rejection.factor)
            warnings.warn(self.fit.rejection.message(), RefitRejectedWarning, stacklevel=2)
        self.study.set_user_attr(STUDY_FIT, self.fit.to_attr())

    # ---- the loop -------------------------------------------------------------------------------------
    def _loop(self) -> str:
        """Run trials until a budget is spent or the space is decided; returns why it stopped."""
        repeats = 0
        while True:
            stopped = self._stop_reason()
            if stopped is not None:
                return stopped
            if repeats >= MAX_REPEATS:
                self._enqueue_fallback()
                repeats = 0
            trial, key = self._next_trial()
            if self._answer_repeat(trial, key):
                repeats += 1
                continue
            repeats = 0
            self._run_trial(trial, key)
            self._save_wall()

    def _stop_reason(self) -> str | None:
        opts = self.options
        if opts.trials is not None and self.ledger.measured >= opts.trials:
            return f"trial budget reached ({self.ledger.measured} of {opts.trials} measured)"
        if opts.time_budget_s is not None and time.perf_counter() - self.started >= opts.time_budget_s:
            return f"time budget of {opts.time_budget_s:g} s spent"
        if all(self.ledger.decided(k) is not None for k in self.space.keys):
            return "every plan in the space was measured or pruned"
        return None

    def _next_trial(self) -> tuple[Any, str]:
        """The next trial and its plan's key: the head of autopar's queue (the best predicted first, stale
        trials' plans before them), else the sampler's proposal."""
        head = self.queue.head(lambda key: self.ledger.decided(key) is not None)
        if head is not None:
            key = head["key"]
            self.study.enqueue_trial(self.space.params_of(key), user_attrs={"key": key, "source": head["source"]})
            trial = self.study.ask(self.space.distributions)
            self.queue.pop()
            return trial, key
        trial = self.study.ask(self.space.distributions)
        key = self.space.keys_by_name[trial.params[PARAM]]
        trial.set_user_attr("key", key)
        return trial, key

    def _enqueue_fallback(self) -> None:
        """The sampler keeps proposing decided plans: queue the undecided one predicted fastest (after the fit)."""
        undecided = [k for k in self.space.keys if self.ledger.decided(k) is None]
        if self.ledger.ok:
            key = min(undecided, key=lambda k: self.model.predict_step(self.space.plans[k], self.fit.calibration))
        else:
            key = undecided[0]  # the space is in predicted order
        self.queue.put_first([{"key": key, "source": "enqueued: the sampler repeated itself"}])

    def _answer_repeat(self, trial: Any, key: str) -> bool:
        """A plan already decided is answered from the study (its value, or FAIL, or PRUNED) and not run."""
        from optuna.trial import TrialState  # lazy, as in _open

        decided = self.ledger.decided(key)
        if decided is None:
            return False
        trial.set_user_attr("repeat_of", decided.number)
        if decided.kind == "ok":
            self.study.tell(trial, self.ledger.ok[key].throughput)
        else:
            self.study.tell(trial, state=TrialState.FAIL if decided.kind == "failed" else TrialState.PRUNED)
        return True

    def _run_trial(self, trial: Any, key: str) -> None:
        """Prune the plan on its prediction, or measure it and record the measurement."""
        from optuna.trial import TrialState  # lazy, as in _open

        plan = self.space.plans[key]
        if "source" not in trial.user_attrs:
            trial.set_user_attr("source", "sampled")
        trial.set_user_attr("predicted", self._predicted(key))
        best_step = min((r.step_s for r in self.ledger.ok.values()), default=math.inf)
        reason = self.model.prune_reason(plan, self.fit, best_step, self.options.prune_factor)
        if reason is not None:
            trial.set_user_attr("status", "pruned")
            trial.set_user_attr("cause", reason)
            self.study.tell(trial, state=TrialState.PRUNED)
            self.ledger.pruned[key] = trial.number
            self._emit("pruned", number=trial.number, plan=short_name(plan), status="pruned", message=reason)
            return
        self._emit("trial", number=trial.number, plan=short_name(plan))
        try:
            result = self.measure(plan)
        except KeyboardInterrupt as exc:  # SIGINT or SIGTERM (autopar.tune.interrupt): the run was ended
            with held():
                self._interrupted(trial, key, exc)
            raise
        with held():  # a signal now comes once the trial is recorded
            self._record(trial, key, plan, result)

    def _interrupted(self, trial: Any, key: str, exc: KeyboardInterrupt) -> None:
        """The trial in flight when the tuner was interrupted: FAIL, status and user attribute "interrupted", and its
        plan first in the queue (it is run again when the study resumes)."""
        from optuna.trial import TrialState  # lazy, as in _open

        signum = getattr(exc, "signum", signal.SIGINT)
        trial.set_user_attr("status", INTERRUPTED)
        trial.set_user_attr(INTERRUPTED, True)
        trial.set_user_attr("cause", f"interrupted: the tuner got {signal.Signals(signum).name} while it ran; its run "
                                     "was ended")
        self.study.tell(trial, state=TrialState.FAIL)
        self.queue.put_first([{"key": key, "source": f"retry of interrupted trial {trial.number}"}])

    # ---- recording a trial ------------------------------------------------------------------------------
    @property
    def _unit_key(self) -> str:
        return "tokens_per_s" if self.unit == "tokens/s" else "samples_per_s"

    def _predicted(self, key: str) -> dict[str, Any]:
        """The prediction of a plan (the trial user attribute `predicted`), its throughput also by its unit."""
        predicted = dict(self.space.predicted(key))
        if "throughput" in predicted:
            predicted[self._unit_key] = predicted["throughput"]
        return predicted

    def _measurement(self, plan: Plan, result: Any) -> tuple[str, dict[str, float], str | None]:
        """A trial's status, what it measured (the trial user attribute `measured`) and the cause of a failure."""
        status = getattr(result, "status", "crash")
        measured = {"wall_s": float(getattr(result, "wall_s", 0.0) or 0.0)}
        for name in ("peak_allocated_bytes", "peak_reserved_bytes"):
            peaks = [int(b) for b in (getattr(result, name, None) or ()) if b]
            if peaks:
                measured[name] = float(max(peaks))
        if status != "ok":
            cause = getattr(result, "cause", None)
            return status, measured, str(cause) if cause else None
        step = float(result.step_s)
        throughput = getattr(result, self._unit_key, None)
        if throughput is None:  # from the step time, as the prediction computes it
            per_sample = self.profile.tokens_per_sample if self.unit == "tokens/s" else 1
            throughput = plan.global_batch_size * per_sample / step
        throughput = float(throughput)
        measured.update({"step_s": step, "throughput": throughput, self._unit_key: throughput})
        if not (math.isfinite(throughput) and throughput > 0 and step > 0):
            return "crash", measured, f"the run reported a step of {step!r} s and {throughput!r} {self.unit}"
        return "ok", measured, None

    def _record(self, trial: Any, key: str, plan: Plan, result: Any) -> None:
        from optuna.trial import TrialState  # lazy, as in _open

        status, measured, cause = self._measurement(plan, result)
        returncode = getattr(result, "returncode", None)
        if returncode is not None:
            trial.set_user_attr("returncode", int(returncode))
        trial.set_user_attr("status", status)
        trial.set_user_attr("measured", measured)
        if status == "ok":
            self.study.tell(trial, measured["throughput"])
            self.ledger.ok[key] = Measured(key, trial.number, measured["step_s"], measured["throughput"])
            self._refit()
        else:
            if cause:
                trial.set_user_attr("cause", cause[:2000])
            tail = getattr(result, "log_tail", None)
            if tail:
                trial.set_user_attr("log_tail", str(tail)[-2000:])
            self.study.tell(trial, state=TrialState.FAIL)
            self.ledger.failed[key] = trial.number
        self._emit("result", number=trial.number, plan=short_name(plan), status=status,
                   throughput=measured.get("throughput"), message=cause)

    def _save_wall(self) -> None:
        now = time.perf_counter()
        total = float(self.study.user_attrs.get(STUDY_WALL, 0.0)) + (now - self._wall_mark)
        self._wall_mark = now
        self.study.set_user_attr(STUDY_WALL, total)

    def _emit(self, event: str, **kw: Any) -> None:
        if self.options.progress is None:
            return
        best = self.ledger.best()
        self.options.progress(Progress(
            event=event, measured=self.ledger.measured, budget=self.options.trials,
            best=best.throughput if best else None, best_plan=short_name(self.space.plans[best.key]) if best else None,
            unit=self.unit, elapsed_s=time.perf_counter() - self.started, **kw))

    # ---- the end ---------------------------------------------------------------------------------------
    def _finish(self, stopped: str) -> TuneReport:
        """The report; the best measured plan written to `plan_out` first, then cached. A write that fails
        raises ResultNotSavedError, which carries the report and says where the best plan is kept."""
        self._save_wall()
        report = report_from_study(self.study, study_path=str(self.study_path) if self.study_path else None,
                                   wall_s=time.perf_counter() - self.started, stopped=stopped)
        if report.best is None:
            return report
        best, plan_out = report.best, self.options.plan_out
        out, out_failure = _attempt(lambda: write_plan_out(best, plan_out)) if plan_out is not None else (None, None)
        cached, cache_failure = _attempt(lambda: self._store(best))
        self.study.set_user_attr(STUDY_BEST, {"key": best.key(), "cached": cached, "plan_out": out})
        report = replace(report, cached_path=cached, plan_out=out)
        if out_failure or cache_failure:
            raise ResultNotSavedError(self._unsaved(report, out_failure, cache_failure), report=report,
                                      path=str(plan_out if out_failure else self._cache_file()))
        return report

    def _cache_key(self) -> Any:
        return cache_key(self.probe.model_fingerprint or self.profile, self.topology,
                         global_batch_size=int(self.probe.global_batch_size),
                         loop=self.options.loop, profile=self.profile)

    def _cache_file(self) -> Path:
        return path_for(self._cache_key(), directory=self.options.cache_directory)

    def _store(self, best: Plan) -> Path:
        """Cache the study's best, unless the plan cached for this job was measured faster (by an earlier study or
        run: a short or noisy study must not replace it, found by a helper); then that one stays, and is said."""
        measurement = dict(best.measurement or {}, source=SOURCE_TUNER)
        if self.study_path is not None:
            measurement["study"] = str(self.study_path)
        key = self._cache_key()
        cached = lookup(key, directory=self.options.cache_directory)
        theirs = measured_throughput(cached.measurement if cached is not None else None)
        ours = measured_throughput(measurement)
        if theirs is not None and ours is not None and theirs > ours:
            path = self._cache_file()
            warnings.warn(KeptFasterPlanWarning(
                f"kept the plan cached at {path}, {short_name(cached)}, measured at {theirs:,.0f}/s: this study's "
                f"best, {short_name(best)}, measured {ours:,.0f}/s. Delete that file to cache this study's best."),
                stacklevel=2)
            return path
        return store(best.replace(measurement=None), key, measurement=measurement,
                     directory=self.options.cache_directory)

    def _unsaved(self, report: TuneReport, out_failure: str | None, cache_failure: str | None) -> str:
        """One line: what could not be written, where the best plan is kept, and how to save it."""
        assert report.best is not None
        failed = "; ".join(f"{what}: {why}" for what, why in (("--plan-out", out_failure),
                                                              ("the plan cache", cache_failure)) if why)
        kept = [f"in {where}" for where in (report.plan_out, report.cached_path) if where]
        head = (f"the best plan, {short_name(report.best)} (trial {report.best_number}), was measured but not saved "
                f"({failed}).")
        if self.study_path is None:
            kept_text = " and ".join(kept + ["in the error's report (report.best.save(PATH) writes it)"])
            return f"{head} It is kept {kept_text}."
        kept.append(f"in the study {self.study_path} (autopar report prints it)")
        return (f"{head} It is kept {' and '.join(kept)}. Make that place writable (or point AUTOPAR_CACHE_DIR or "
                "--plan-out elsewhere) and run the same command again: the study resumes, runs no measured plan "
                "again, and saves it.")


def _upgraded_meta(meta: Mapping[str, Any]) -> dict[str, Any]:
    """A study's job as written before the loop had three values (`allow_train_step: true/false`), in today's
    terms (`loop`), so that such a study resumes."""
    out = dict(meta)
    if "loop" not in out and isinstance(out.get("allow_train_step"), bool):
        out["loop"] = (Loop.TRAIN_STEP if out.pop("allow_train_step") else Loop.PLAIN).value
    return out


def _attempt(write: Callable[[], Any]) -> tuple[str | None, str | None]:
    """(the path `write()` returned, None), or (None, why it failed) when it raised OSError or AutoparError."""
    try:
        return str(write()), None
    except (OSError, AutoparError) as exc:
        return None, " ".join(str(exc).split())
