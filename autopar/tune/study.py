"""The tuning study: measured trials of the cost model's best plans, driven by Optuna, resumable.

    report = tune(["torchrun", "--nproc-per-node", "8", "train.py"], study_path="study.db", trials=12)
    report = autopar.autotune(lambda: MyModel(), sample, loss_fn, trials=6)     # in this process, one GPU

How a study runs (docs/tuning.md, "The study"):

1. **Probe** the user's script once (autopar.tune.trial.probe): the profile its `wrap` makes, the
   topology, the world size and the global batch.
2. **The space** is the cost model's feasible candidates (autopar.search.search with the calibration
   cached for this topology): plans that do not fit or are dominated never run. At most `max_space` of
   them, the best predicted. It is one Optuna categorical parameter, "plan", whose choices are the plans'
   keys (Plan.key()). The first run of a study stores each key's plan YAML and prediction in the study's
   user attributes, and a resumed study uses those, so the space never changes under a study.
3. **The best predicted first**: the `top_k_enqueue` best predicted plans are queued in predicted order;
   then a seeded TPE sampler explores. The queue is autopar's (a study attribute, `autopar.queue`): each
   entry becomes an Optuna trial (enqueue_trial, then ask) only when it runs, so nothing waits in Optuna's
   own queue and a stale trial's retry can be put first.
4. **Each trial** runs the plan in the user's command (run_trial) and reports the measured throughput
   (tokens/s, or samples/s for inputs without a sequence) to maximise. A plan that fails (oom, crash,
   exit, timeout) is recorded as FAIL with its status and cause, and the study goes on.
5. **No plan runs twice.** Optuna may propose a categorical choice again; a proposed plan already decided
   (measured, failed or pruned) is answered from the study: the trial is told the stored value (or FAIL, or
   PRUNED), marked `repeat_of`, and nothing runs. After 3 repeats in a row the best-predicted undecided
   plan is enqueued, so the study always moves on.
6. **Pruning on prediction.** The runner only returns at the end of a trial, so "clearly slower" is judged
   before running. Once 2 plans have been measured, and while the cost model is trusted here (its fitted
   predictions, scaled by the median measured/predicted ratio, are within 25% of every measured step), a
   plan whose scaled prediction is more than `prune_factor` (1.5) times the best measured step is marked
   PRUNED and never runs. A model that mispredicts this hardware prunes nothing.
7. **Calibration.** After every measured trial the time model's efficiencies are refitted
   to every plan measured in the study, from the calibration the study started with: one common scale of
   the rates, and autopar.cost.calibration.fit re-linearised for up to 3 rounds (see `_Study._refit`); the
   calibration kept is the one that predicts the measured steps best, so a fit never makes them worse. It
   is saved for this topology (save_calibration).
   The report shows the step-time prediction error of each measured plan before (the starting
   calibration) and after (the last fit).
8. **Budgets**: `trials` plans measured (ok or failed) over the study's life, resumed runs included;
   `time_budget_s` of this call (no trial starts after it; the one in flight finishes); or the space is
   exhausted. Pruned trials and repeats do not count.
9. **At the end** the best measured plan is cached (autopar.plan_cache.store) and written to `plan_out`.

**Storage and resuming.** The study lives in a SQLite file (Optuna's RDBStorage), one study per file.
While a tuner works on it, it holds an exclusive lock on `STUDY.lock` (a second tuner is refused), so
when a tuner starts, any trial still RUNNING was left by a tuner that was killed: it is marked FAIL
(status "stale") and its plan is put first in the queue, so no trial is lost; a completed trial is never run again
(point 5), so none is duplicated. Optuna's own heartbeat (`fail_stale_trials`) only works inside
`study.optimize`, which the ask-and-tell loop here does not use.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Mapping, Sequence

from ..errors import AutoparError, InfeasiblePlanError
from ..plans import Plan
from .report import (FAILED, PARAM, STUDY_BEST, STUDY_CAL_BEFORE, STUDY_QUEUE, STUDY_FIT, STUDY_META, STUDY_SPACE,
                     STUDY_WALL, TuneReport, report_from_study)

STUDY_NAME = "autopar"
#: Version of what autopar stores in a study (the user attributes); a study of another version is refused.
STUDY_FORMAT = 1
#: A plan whose corrected predicted step exceeds this times the best measured step is pruned (not run).
PRUNE_FACTOR = 1.5
#: Pruning starts once this many plans have been measured (the correction needs measurements).
PRUNE_AFTER = 2
#: The space holds at most this many feasible plans, the best predicted.
MAX_SPACE = 256
#: ... and only while the fitted predictions, corrected by the median measured/predicted ratio, are within this
#: share of every measured plan's step time (a model that mispredicts this hardware prunes nothing).
PRUNE_TRUST = 0.25
#: Rounds of the calibration fit (each re-linearised at the previous result); the best one is kept.
FIT_ROUNDS = 3
#: After this many repeats in a row, the best-predicted undecided plan is enqueued.
MAX_REPEATS = 3
STALE_CAUSE = "stale: the tuner stopped while it ran"


# ---------------------------------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Progress:
    """What a `progress` callback receives, at each event of a study.

    event: "start" (the space is ready), "trial" (a plan starts running), "result" (it ended: `status`),
    "pruned" (a plan skipped on its prediction), "done" (the study stopped: `message` says why)."""

    event: str
    measured: int  # plans measured so far in the study (ok or failed), the running one not included
    budget: int | None  # the trial budget
    number: int | None = None  # the Optuna trial number
    plan: str | None = None  # the plan, in one line (planning._short)
    status: str | None = None
    throughput: float | None = None  # this trial's measured throughput
    best: float | None = None  # the best measured so far
    best_plan: str | None = None
    unit: str = "tokens/s"
    message: str | None = None
    elapsed_s: float = 0.0


# ---------------------------------------------------------------------------------------------------
# Storage
# ---------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _locked(study_path: Path | None) -> Iterator[None]:
    """An exclusive lock on STUDY.lock while a tuner works on the study (released by the kernel if killed)."""
    if study_path is None:
        yield
        return
    import fcntl

    lock_path = study_path.with_name(study_path.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise AutoparError(f"another autopar tuner is working on {study_path} (it holds {lock_path}): wait for "
                               "it to end, or use another --study file.") from None
        yield
    finally:
        os.close(fd)


def _storage(study_path: Path | None) -> Any:
    import optuna

    if study_path is None:
        return optuna.storages.InMemoryStorage()
    import sqlalchemy

    study_path.parent.mkdir(parents=True, exist_ok=True)
    storage = optuna.storages.RDBStorage(f"sqlite:///{study_path.resolve()}",
                                         engine_kwargs={"connect_args": {"timeout": 60}})

    # Write-ahead logging with synchronous=NORMAL: a commit no longer waits for the disk (about 10 ms each, and
    # Optuna commits a few times per trial), and a killed tuner still loses nothing it committed (only a power
    # loss can drop the last commits). Pooled connections are dropped so that every new one gets the setting.
    def _pragmas(connection: Any, _record: Any) -> None:
        cursor = connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    sqlalchemy.event.listen(storage.engine, "connect", _pragmas)
    storage.engine.dispose()
    return storage


def _plan_short(plan: Plan) -> str:
    from ..planning import _short

    return _short(plan)


# ---------------------------------------------------------------------------------------------------
# The study
# ---------------------------------------------------------------------------------------------------
@dataclass
class _Record:
    key: str
    number: int
    step_s: float
    throughput: float


@dataclass
class _Study:
    """One tuning study over a probed model (the shared engine of `tune` and `autotune`)."""

    probe: Any  # ProbeResult (or the same attributes)
    measure: Callable[[Plan], Any]  # runs one plan, returns a TrialResult (or the same attributes)
    study_path: Path | None
    trials: int | None = None
    time_budget_s: float | None = None
    allow_train_step: bool = True
    top_k_enqueue: int = 5
    plan_out: str | os.PathLike[str] | None = None
    progress: Callable[[Progress], None] | None = None
    cache_directory: str | os.PathLike[str] | None = None
    seed: int = 0
    prune_factor: float = PRUNE_FACTOR
    max_space: int = MAX_SPACE
    eager: bool = True  # eager plans beside compiled ones in the space (autopar.search.search(eager=))
    argv: Sequence[str] | None = None
    started: float = field(default_factory=time.perf_counter)

    # ---- set up ---------------------------------------------------------------------------------------
    def run(self) -> TuneReport:
        with _locked(self.study_path):
            return self._run()

    def _run(self) -> TuneReport:
        import optuna
        from optuna.distributions import CategoricalDistribution

        self.topology = self.probe.topology
        self.profile = self.probe.profile
        self.variants = dict(self.probe.variants or {})
        self.storage = _storage(self.study_path)
        self.study = optuna.create_study(storage=self.storage, study_name=STUDY_NAME, direction="maximize",
                                         load_if_exists=True)
        if STUDY_SPACE not in self.study.user_attrs:
            self._initialise()
        else:
            self._check_same_job()
        attrs = self.study.user_attrs
        self.space = list(attrs[STUDY_SPACE])
        self.keys = tuple(e["key"] for e in self.space)
        self.plans = {e["key"]: Plan.from_yaml(e["plan"], source="the study's search space") for e in self.space}
        self.predicted = {e["key"]: e.get("predicted", {}) for e in self.space}
        self.unit = attrs[STUDY_META]["unit"]
        from ..cost.calibration import Calibration

        self.base = Calibration.from_dict(attrs[STUDY_CAL_BEFORE])
        self.distribution = CategoricalDistribution(self.keys)
        self.queue = [dict(e) for e in attrs.get(STUDY_QUEUE, [])]
        self._fail_stale()
        # The sampler: seeded, and re-seeded by the trials so far, so that a resumed study does not replay the
        # first run's random proposals.
        done = len(self.study.get_trials(deepcopy=False))
        self.study.sampler = optuna.samplers.TPESampler(seed=None if self.seed is None else self.seed + done)
        self._load_state()
        self._refit()
        self._emit("start", message=f"{len(self.keys)} feasible plans in the space; {len(self.ok)} measured earlier")
        stopped = self._loop()
        report = self._finish(stopped)
        self._emit("done", message=stopped)
        return report

    def _initialise(self) -> None:
        from ..planning import calibration_for
        from ..search import search

        topo, profile = self.topology, self.profile
        base = calibration_for(topo)
        ranked = search(profile, topo, world_size=self.probe.world_size,
                        global_batch_size=self.probe.global_batch_size, variants=self.variants, calibration=base,
                        allow_train_step=self.allow_train_step, eager=self.eager)
        feasible = [c for c in ranked if c.feasible][:self.max_space]
        if not feasible:
            from ..planning import dropped_reasons

            why = "; ".join(f"{n} {r}" for n, r in dropped_reasons(ranked)[:3]) or "no plan was enumerated"
            raise InfeasiblePlanError(f"no plan fits this model on this hardware, so there is nothing to tune ({why}).")
        unit = "tokens/s" if profile.tokens_per_sample else "samples/s"
        space = []
        for c in feasible:
            p = c.prediction
            throughput = p.tokens_per_s if unit == "tokens/s" else p.samples_per_s
            space.append({"key": c.plan.key(), "short": _plan_short(c.plan), "plan": c.plan.to_yaml(),
                          "predicted": {"step_s": float(p.step_s), "throughput": float(throughput),
                                        "memory_bytes": float(p.memory.peak_bytes),
                                        "allocated_bytes": float(p.memory.allocated_bytes), "mfu": float(p.mfu)}})
        meta = {"format": STUDY_FORMAT, "model_fingerprint": self.probe.model_fingerprint or profile.fingerprint,
                "topology_fingerprint": topo.fingerprint(), "device": topo.device.name,
                "world_size": int(self.probe.world_size), "global_batch_size": int(self.probe.global_batch_size),
                "allow_train_step": bool(self.allow_train_step), "eager": bool(self.eager), "unit": unit,
                "tokens_per_sample": profile.tokens_per_sample, "candidates": len(ranked),
                "argv": list(self.argv) if self.argv is not None else None,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        self.study.set_user_attr(STUDY_META, meta)
        self.study.set_user_attr(STUDY_CAL_BEFORE, base.to_dict())
        self.study.set_user_attr(STUDY_QUEUE, [{"key": e["key"], "source": f"enqueued: predicted rank {rank}"}
                                               for rank, e in enumerate(space[:max(0, self.top_k_enqueue)], 1)])
        self.study.set_user_attr(STUDY_SPACE, space)  # last: its presence marks the study as initialised

    def _check_same_job(self) -> None:
        meta = self.study.user_attrs.get(STUDY_META, {})
        if meta.get("format") != STUDY_FORMAT:
            raise AutoparError(f"{self.study_path} was written by another autopar (study format {meta.get('format')}, "
                               f"this one writes {STUDY_FORMAT}): use a new --study file.")
        now = {"model_fingerprint": self.probe.model_fingerprint or self.profile.fingerprint,
               "topology_fingerprint": self.topology.fingerprint(), "world_size": int(self.probe.world_size),
               "global_batch_size": int(self.probe.global_batch_size), "allow_train_step": bool(self.allow_train_step),
               "eager": bool(self.eager)}
        diffs = [f"{k} {meta.get(k, True if k == 'eager' else None)!r} there, {v!r} here" for k, v in now.items()
                 if meta.get(k, True if k == "eager" else None) != v]
        if diffs:
            raise AutoparError(f"{self.study_path} is a study of another job ({'; '.join(diffs)}): resume it with the "
                               "same model, hardware, batch, --plain-loop and --compiled-only settings, or use a new "
                               "--study file.")

    def _save_queue(self) -> None:
        self.study.set_user_attr(STUDY_QUEUE, self.queue)

    def _fail_stale(self) -> None:
        """Trials left RUNNING by a killed tuner (we hold the lock, so no live tuner runs them): FAIL, "stale",
        and their plans put first in the queue, so they run first when the study goes on."""
        from optuna.trial import TrialState

        retries = []
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            self.storage.set_trial_user_attr(t._trial_id, "status", "stale")
            self.storage.set_trial_user_attr(t._trial_id, "cause", STALE_CAUSE)
            self.storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            key = t.params.get(PARAM) or t.user_attrs.get("key")
            if key in self.keys:
                retries.append({"key": key, "source": f"retry of stale trial {t.number}"})
        if retries:
            self.queue = retries + self.queue
            self._save_queue()

    # ---- what the study knows -----------------------------------------------------------------------
    def _load_state(self) -> None:
        from optuna.trial import TrialState

        self.ok: dict[str, _Record] = {}
        self.failed: dict[str, int] = {}
        self.pruned: dict[str, int] = {}
        for t in self.study.get_trials(deepcopy=False):
            ua = t.user_attrs
            if ua.get("repeat_of") is not None:
                continue
            key = t.params.get(PARAM)
            if t.state == TrialState.COMPLETE and key is not None:
                self.ok.setdefault(key, _Record(key, t.number, float(ua["measured"]["step_s"]), float(t.value)))
            elif t.state == TrialState.FAIL and ua.get("status") in FAILED and key is not None:
                self.failed.setdefault(key, t.number)
            elif t.state == TrialState.PRUNED and key is not None:
                self.pruned.setdefault(key, t.number)

    @property
    def measured(self) -> int:
        return len(self.ok) + len(self.failed)

    def _decided(self, key: str) -> tuple[str, int] | None:
        for kind, table in (("ok", self.ok), ("failed", self.failed), ("pruned", self.pruned)):
            if key in table:
                number = table[key].number if kind == "ok" else table[key]
                return kind, number
        return None

    def _best(self) -> _Record | None:
        return max(self.ok.values(), key=lambda r: r.throughput) if self.ok else None

    # ---- calibration ----------------------------------------------------------------------------------
    def _predict_step(self, plan: Plan, cal: Any) -> float:
        from ..cost.time import time_terms

        return float(time_terms(self.profile, plan, self.topology, cal, variants=self.variants)[0].step_s)

    def _scaled(self, cal: Any, s: float) -> Any:
        """`cal` with every rate it fits scaled by `s` (s < 1: the hardware is slower than assumed); capped at
        1 on GPUs, whose datasheet peaks are upper bounds, not on CPUs, whose figures are nominal."""
        cap = 1.0 if self.topology.is_gpu else math.inf
        return cal.replace(matmul_efficiency=min(cap, cal.matmul_efficiency * s),
                           fp32_matmul_efficiency=min(cap, cal.fp32_matmul_efficiency * s),
                           memory_efficiency=min(cap, cal.memory_efficiency * s), launch_s=cal.launch_s / s)

    def _refit(self) -> None:
        """Fit the time model to every plan measured in the study, from the starting calibration; save it for
        this topology and record the fitted predictions of the measured plans in the study.

        autopar.cost.calibration.fit is a linear least-squares fit of the time terms at the calibration it is
        given (matmul, memory-bound, launch), while the model is not linear in its factors (launch time hides
        behind GPU work, a pipeline's bubble grows with the stage's compute but counts as fixed, efficiencies
        are capped at 1), and with few runs its three factors are barely determined. So the candidates are:
        one common scale of every rate (a 1-D search of the step-time error: well determined from one run),
        and `fit` repeated from the start and from that scale, each round re-linearised at the last (like
        Gauss-Newton), `FIT_ROUNDS` rounds. The calibration kept is whichever of the start and the
        candidates predicts the measured steps best (mean |predicted / measured - 1|): a fit never makes the
        predictions worse."""
        from ..cost.calibration import fit, save_calibration
        from ..cost.time import time_terms

        records = list(self.ok.values())
        self.fitted = self.base
        self.ratio, self.trusted = 1.0, False
        if not records:
            return

        def error(cal: Any) -> tuple[float, dict[str, float]]:
            steps = {r.key: self._predict_step(self.plans[r.key], cal) for r in records}
            return sum(abs(steps[r.key] / r.step_s - 1) for r in records) / len(records), steps

        base_err, base_steps = error(self.base)
        best = (base_err, base_steps, self.base)
        if len(records) >= 2:
            # One common scale of the rates: golden-section search of log(s) in [1/64, 64].
            lo, hi, g = -math.log(64), math.log(64), (math.sqrt(5) - 1) / 2
            a, b = hi - g * (hi - lo), lo + g * (hi - lo)
            fa, fb = error(self._scaled(self.base, math.exp(a)))[0], error(self._scaled(self.base, math.exp(b)))[0]
            while hi - lo > 0.01:
                if fa < fb:
                    hi, b, fb = b, a, fa
                    a = hi - g * (hi - lo)
                    fa = error(self._scaled(self.base, math.exp(a)))[0]
                else:
                    lo, a, fa = a, b, fb
                    b = lo + g * (hi - lo)
                    fb = error(self._scaled(self.base, math.exp(b)))[0]
            scaled = self._scaled(self.base, math.exp((lo + hi) / 2))
            err, steps = error(scaled)
            if err < best[0]:
                best = (err, steps, scaled)
            for start in (self.base, scaled):
                cal = start
                for _ in range(FIT_ROUNDS):
                    runs = [(time_terms(self.profile, self.plans[r.key], self.topology, cal,
                                        variants=self.variants)[1], r.step_s) for r in records]
                    new = fit(cal, runs)
                    if new is cal:
                        break
                    err, steps = error(new)
                    if err < best[0]:
                        best = (err, steps, new)
                    cal = new
        best_err, best_steps, self.fitted = best
        if self.fitted is not self.base:
            self.fitted = self.fitted.replace(fitted_runs=self.base.fitted_runs + len(records),
                                              source=f"fitted to {len(records)} measured steps (autopar tune)")
        # Pruning trusts the predictions only where, corrected by the median measured/predicted ratio, they
        # predict every measured plan within PRUNE_TRUST.
        self.ratio = statistics.median(r.step_s / best_steps[r.key] for r in records)
        self.trusted = len(records) >= PRUNE_AFTER and all(
            abs(best_steps[r.key] * self.ratio / r.step_s - 1) <= PRUNE_TRUST for r in records)
        if len(records) < 2:
            return
        if self.fitted is not self.base:
            try:
                save_calibration(self.fitted, self.topology.fingerprint())
            except (OSError, AutoparError) as exc:  # the study goes on; the fit is in the study too
                import warnings

                warnings.warn(f"could not save the fitted calibration: {exc}", stacklevel=2)
        self.study.set_user_attr(STUDY_FIT, {"calibration": self.fitted.to_dict(), "runs": len(records),
                                             "accepted": self.fitted is not self.base, "error_before": base_err,
                                             "error_after": best_err, "step_s": best_steps})

    def _prune_reason(self, plan: Plan) -> str | None:
        """Why `plan` is clearly slower than the best measured one (module docstring, point 6), or None."""
        if not self.trusted:
            return None
        estimate = self._predict_step(plan, self.fitted) * self.ratio
        best = min(r.step_s for r in self.ok.values())
        if estimate > self.prune_factor * best:
            return (f"pruned: predicted {estimate * 1e3:.1f} ms a step (fitted, corrected by the measured ratio), "
                    f"{estimate / best:.2f}x the best measured {best * 1e3:.1f} ms (> {self.prune_factor:g}x)")
        return None

    # ---- the loop -------------------------------------------------------------------------------------
    def _loop(self) -> str:
        from optuna.trial import TrialState

        repeats = 0
        while True:
            if self.trials is not None and self.measured >= self.trials:
                return f"trial budget reached ({self.measured} of {self.trials} measured)"
            if self.time_budget_s is not None and time.perf_counter() - self.started >= self.time_budget_s:
                return f"time budget of {self.time_budget_s:g} s spent"
            undecided = [k for k in self.keys if self._decided(k) is None]
            if not undecided:
                return "every plan in the space was measured or pruned"
            if repeats >= MAX_REPEATS:
                self._enqueue_fallback(undecided)
                repeats = 0
            trial = self._next_trial()
            key = trial.params[PARAM]
            decided = self._decided(key)
            if decided is not None:  # a plan already decided: answer from the study, run nothing
                repeats += 1
                kind, number = decided
                trial.set_user_attr("key", key)
                trial.set_user_attr("repeat_of", number)
                if kind == "ok":
                    self.study.tell(trial, self.ok[key].throughput)
                else:
                    self.study.tell(trial, state=TrialState.FAIL if kind == "failed" else TrialState.PRUNED)
                continue
            repeats = 0
            plan = self.plans[key]
            trial.set_user_attr("key", key)
            if "source" not in trial.user_attrs:
                trial.set_user_attr("source", "sampled")
            reason = self._prune_reason(plan)
            if reason is not None:
                trial.set_user_attr("status", "pruned")
                trial.set_user_attr("cause", reason)
                self.study.tell(trial, state=TrialState.PRUNED)
                self.pruned[key] = trial.number
                self._emit("pruned", number=trial.number, plan=_plan_short(plan), status="pruned", message=reason)
                continue
            self._emit("trial", number=trial.number, plan=_plan_short(plan))
            result = self.measure(plan)
            self._record(trial, key, plan, result)
            self._save_wall()

    def _next_trial(self) -> Any:
        """The next trial: the head of autopar's queue (the best predicted first, stale trials' plans before
        them), else the sampler's proposal. The queue is autopar's own (a study attribute) rather than Optuna's
        waiting trials, so that a stale trial's retry can go first: Optuna pops waiting trials oldest first."""
        while self.queue and self._decided(self.queue[0]["key"]) is not None:  # measured since it was queued
            self.queue.pop(0)
        if self.queue:
            head = self.queue[0]
            self.study.enqueue_trial({PARAM: head["key"]}, user_attrs={"source": head["source"]})
            trial = self.study.ask({PARAM: self.distribution})
            self.queue.pop(0)
            self._save_queue()
            return trial
        return self.study.ask({PARAM: self.distribution})

    def _enqueue_fallback(self, undecided: list[str]) -> None:
        """The sampler keeps proposing decided plans: queue the undecided one predicted fastest (after the fit)."""
        if self.ok:
            key = min(undecided, key=lambda k: self._predict_step(self.plans[k], self.fitted))
        else:
            key = undecided[0]  # the space is in predicted order
        self.queue.insert(0, {"key": key, "source": "enqueued: the sampler repeated itself"})
        self._save_queue()

    def _record(self, trial: Any, key: str, plan: Plan, result: Any) -> None:
        from optuna.trial import TrialState

        status = getattr(result, "status", "crash")
        measured = {"wall_s": float(getattr(result, "wall_s", 0.0) or 0.0)}
        for name in ("peak_allocated_bytes", "peak_reserved_bytes"):
            peaks = [int(b) for b in (getattr(result, name, None) or ()) if b]
            if peaks:
                measured[name] = float(max(peaks))
        returncode = getattr(result, "returncode", None)
        if returncode is not None:
            trial.set_user_attr("returncode", int(returncode))
        throughput = None
        if status == "ok":
            step = float(result.step_s)
            throughput = (getattr(result, "tokens_per_s", None) if self.unit == "tokens/s"
                          else getattr(result, "samples_per_s", None))
            if throughput is None:  # from the step time, as the prediction computes it
                per_sample = self.profile.tokens_per_sample if self.unit == "tokens/s" else 1
                throughput = plan.global_batch_size * per_sample / step
            throughput = float(throughput)
            measured.update(step_s=step, throughput=throughput)
            if not (math.isfinite(throughput) and throughput > 0 and step > 0):
                status = "crash"
                trial.set_user_attr("cause", f"the run reported a step of {step!r} s and {throughput!r} {self.unit}")
        trial.set_user_attr("status", status)
        trial.set_user_attr("measured", measured)
        if status == "ok":
            self.study.tell(trial, throughput)
            self.ok[key] = _Record(key, trial.number, measured["step_s"], throughput)
            self._refit()
        else:
            cause = getattr(result, "cause", None)
            if cause and "cause" not in trial.user_attrs:
                trial.set_user_attr("cause", str(cause)[:2000])
            tail = getattr(result, "log_tail", None)
            if tail:
                trial.set_user_attr("log_tail", str(tail)[-2000:])
            self.study.tell(trial, state=TrialState.FAIL)
            self.failed[key] = trial.number
        self._emit("result", number=trial.number, plan=_plan_short(plan), status=status, throughput=throughput,
                   message=None if status == "ok" else getattr(result, "cause", None))

    def _save_wall(self) -> None:
        now = time.perf_counter()
        total = float(self.study.user_attrs.get(STUDY_WALL, 0.0)) + (now - getattr(self, "_wall_mark", self.started))
        self._wall_mark = now
        self.study.set_user_attr(STUDY_WALL, total)

    def _emit(self, event: str, **kw: Any) -> None:
        if self.progress is None:
            return
        best = self._best() if hasattr(self, "ok") else None
        self.progress(Progress(event=event, measured=self.measured if hasattr(self, "ok") else 0, budget=self.trials,
                               best=best.throughput if best else None,
                               best_plan=_plan_short(self.plans[best.key]) if best else None,
                               unit=getattr(self, "unit", "tokens/s"), elapsed_s=time.perf_counter() - self.started,
                               **kw))

    # ---- the end ---------------------------------------------------------------------------------------
    def _finish(self, stopped: str) -> TuneReport:
        self._save_wall()
        report = report_from_study(self.study, study_path=str(self.study_path) if self.study_path else None,
                                   wall_s=time.perf_counter() - self.started, stopped=stopped)
        if report.best is None:
            return report
        from ..plan_cache import cache_key, store, write_plan_out

        best = report.best
        key = cache_key(self.probe.model_fingerprint or self.profile, self.topology,
                        global_batch_size=int(self.probe.global_batch_size),
                        allow_train_step=bool(self.allow_train_step))
        measurement = dict(best.measurement or {})
        if self.study_path is not None:
            measurement["study"] = str(self.study_path)
        cached = store(best.replace(measurement=None), key, measurement=measurement, directory=self.cache_directory)
        out = str(write_plan_out(best, self.plan_out)) if self.plan_out is not None else None
        self.study.set_user_attr(STUDY_BEST, {"key": best.key(), "cached": str(cached), "plan_out": out})
        from dataclasses import replace

        return replace(report, cached_path=str(cached), plan_out=out)


# ---------------------------------------------------------------------------------------------------
# autopar tune: trials in the user's own launch command
# ---------------------------------------------------------------------------------------------------
def tune(
    argv: Sequence[str],
    *,
    study_path: str | os.PathLike[str],
    trials: int | None = None,
    time_budget_s: float | None = None,
    steps: int = 10,
    warmup: int = 3,
    trial_timeout_s: float = 600.0,
    allow_train_step: bool | None = None,
    top_k_enqueue: int = 5,
    plan_out: str | os.PathLike[str] | None = None,
    progress: Callable[[Progress], None] | None = None,
    runner: Callable[..., Any] | None = None,
    prober: Callable[..., Any] | None = None,
    cache_directory: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    workdir: str | os.PathLike[str] | None = None,
    seed: int = 0,
    prune_factor: float = PRUNE_FACTOR,
    max_space: int = MAX_SPACE,
    eager: bool = True,
) -> TuneReport:
    """Tune the parallelism plan of the job `argv` (the user's launch command, e.g. `["torchrun",
    "--nproc-per-node", "8", "train.py"]`, whose script calls autopar.wrap) by measured trials, in the
    Optuna study at `study_path` (SQLite; created, or resumed). See the module docstring for how.

    `trials`: plans to measure over the study's life (resumed runs included); `time_budget_s`: seconds for
    this call; with neither, every feasible plan is measured or pruned. `steps` timed optimizer steps after
    `warmup` per trial, each trial at most `trial_timeout_s`. `allow_train_step`: whether plans that need
    autopar.train_step (accumulation, pipelines, tensor parallelism) are tried; None (the default) follows
    the script's own `wrap(uses_train_step=...)`, as the probe saw it, so that the cached plan is the one
    later runs of the script look up. `eager`: measure eager plans beside compiled ones (the cost model
    ranks compiled plans first, but compilation can fail or lose on a given model); False keeps the search's
    compiled plans only. The best plan is cached (autopar.plan_cache; in
    `cache_directory` when given) and written to `plan_out`. `progress(Progress)` is called at each event.
    `runner`/`prober` replace autopar.tune.trial's run_trial/probe (tests)."""
    _check_budget(trials, time_budget_s, steps, warmup, top_k_enqueue)
    if runner is None or prober is None:
        from . import trial as _trial

        runner = runner or _trial.run_trial
        prober = prober or _trial.probe
    started = time.perf_counter()
    argv = [str(a) for a in argv]
    probe = prober(argv, timeout_s=trial_timeout_s, env=env, workdir=workdir)
    if allow_train_step is None:
        declared = getattr(probe, "uses_train_step", None)
        allow_train_step = True if declared is None else bool(declared)

    def measure(plan: Plan) -> Any:
        return runner(argv, plan, steps=steps, warmup=warmup, timeout_s=trial_timeout_s, env=env, workdir=workdir)

    return _Study(probe=probe, measure=measure, study_path=Path(study_path), trials=trials,
                  time_budget_s=time_budget_s, allow_train_step=allow_train_step, top_k_enqueue=top_k_enqueue,
                  plan_out=plan_out, progress=progress, cache_directory=cache_directory, seed=seed,
                  prune_factor=prune_factor, max_space=max_space, eager=eager, argv=argv, started=started).run()


def _check_budget(trials: Any, time_budget_s: Any, steps: Any, warmup: Any, top_k: Any) -> None:
    for name, value, low in (("trials", trials, 1), ("steps", steps, 1), ("warmup", warmup, 0),
                             ("top_k_enqueue", top_k, 0)):
        if value is None and name == "trials":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer of at least {low}, got {value!r}.")
    if time_budget_s is not None and not (isinstance(time_budget_s, (int, float)) and time_budget_s > 0):
        raise ValueError(f"time_budget_s must be a positive number of seconds, got {time_budget_s!r}.")


# ---------------------------------------------------------------------------------------------------
# autopar.autotune: trials in this process (one GPU, a notebook)
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class InProcessResult:
    """One in-process trial: the fields of autopar.tune.trial.TrialResult that the study reads."""

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


def _single_device(topology: Any) -> Any:
    """The topology of one device of `topology` (autotune runs one process)."""
    import dataclasses

    from ..planning import resolve_topology

    topo = resolve_topology(topology)
    if topo.world_size == 1:
        return topo
    if topo.is_gpu:
        return dataclasses.replace(topo, num_nodes=1, devices_per_node=1, nvlink_pairs=None)
    from ..topology import Topology

    return Topology.cpu(1)


def _batch_of(sample: Any, n: int) -> Any:
    """`sample` repeated along dim 0 (and cut) to `n` samples."""
    from .._util.batch import map_tensors, sample_batch_size

    have = sample_batch_size(sample)
    if have == n:
        return sample

    def grow(t: Any) -> Any:
        if t.dim() == 0 or t.shape[0] != have:
            return t
        reps = -(-n // have)
        return t.repeat(reps, *([1] * (t.dim() - 1)))[:n]

    return map_tensors(grow, sample)


def measure_in_process(model_fn: Callable[[], Any], sample: Any, plan: Plan, *, loss_fn: Callable | None = None,
                       topology: Any = None, steps: int = 10, warmup: int = 3,
                       optimizer_fn: Callable[[Any], Any] | None = None, tokens_per_sample: int | None = None,
                       ) -> InProcessResult:
    """Build a fresh model, wrap it with `plan`, and time `steps` autopar.train_step steps after `warmup`
    on `sample` repeated to the plan's batch. Out of memory (torch.cuda.OutOfMemoryError, MemoryError) is
    "oom", any other exception "crash"; memory is freed after (del, gc, torch.cuda.empty_cache)."""
    import torch

    from ..api import wrap
    from .._util.batch import map_tensors
    from ..step import train_step

    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    model = optimizer = step = batch = None
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        model = model_fn()
        wrap(model, sample=sample, plan=plan, topology=topology, loss_fn=loss_fn, verbose=False, uses_train_step=True,
             global_batch_size=plan.global_batch_size)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = optimizer_fn(params) if optimizer_fn is not None else torch.optim.AdamW(params, lr=1e-4)
        step = train_step(model, optimizer, loss_fn)
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        batch = map_tensors(lambda t: t.to(device), _batch_of(sample, plan.local_batch_size))
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
        return InProcessResult("oom", plan, wall_s=time.perf_counter() - started,
                               cause=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500])
    except Exception as exc:  # noqa: BLE001 - a plan that cannot run is a failed trial; the study goes on
        return InProcessResult("crash", plan, wall_s=time.perf_counter() - started,
                               cause=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500])
    finally:
        del model, optimizer, step, batch
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def autotune(
    model_fn: Callable[[], Any],
    sample: Any,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    *,
    trials: int | None = 8,
    time_budget_s: float | None = None,
    steps: int = 10,
    warmup: int = 3,
    topology: Any = None,
    global_batch_size: int | None = None,
    study_path: str | os.PathLike[str] | None = None,
    allow_train_step: bool = True,
    top_k_enqueue: int = 5,
    plan_out: str | os.PathLike[str] | None = None,
    progress: Callable[[Progress], None] | None = None,
    optimizer_fn: Callable[[Any], Any] | None = None,
    cache_directory: str | os.PathLike[str] | None = None,
    seed: int = 0,
    prune_factor: float = PRUNE_FACTOR,
    blocks: Any = None,
    eager: bool = True,
) -> TuneReport:
    """Tune the plan of one process (one GPU, or the CPU) in this process: for a notebook or a single-GPU
    script. The same study as `autopar tune` (the module docstring), with each trial run here: a fresh model
    from `model_fn()`, wrapped with the plan, trained `steps` steps with autopar.train_step after `warmup`
    on `sample` repeated to the plan's batch; out of memory is a failed trial, and memory is freed after
    each. `sample`: one batch (its batch size is the global batch unless `global_batch_size` is given).
    `study_path`: a SQLite file to keep (and resume) the study; default: in memory. `optimizer_fn(params)`:
    the optimizer (default AdamW, lr 1e-4). `eager`: as in `tune`. Returns the TuneReport; the best plan is cached for `wrap`."""
    from ..planning import profile_variants
    from .._util.batch import sample_batch_size

    _check_budget(trials, time_budget_s, steps, warmup, top_k_enqueue)
    started = time.perf_counter()
    topo = _single_device(topology)
    gbs = global_batch_size if global_batch_size is not None else sample_batch_size(sample)
    model = model_fn()
    try:
        profile, variants = profile_variants(model, sample, topo, loss_fn=loss_fn, blocks=blocks)
    finally:
        del model
        gc.collect()
    probe = SimpleNamespace(profile=profile, variants=variants, topology=topo, world_size=1, global_batch_size=gbs,
                            model_fingerprint=profile.fingerprint)

    def measure(plan: Plan) -> InProcessResult:
        return measure_in_process(model_fn, sample, plan, loss_fn=loss_fn, topology=topo, steps=steps, warmup=warmup,
                                  optimizer_fn=optimizer_fn, tokens_per_sample=profile.tokens_per_sample)

    return _Study(probe=probe, measure=measure, study_path=Path(study_path) if study_path is not None else None,
                  trials=trials, time_budget_s=time_budget_s, allow_train_step=allow_train_step,
                  top_k_enqueue=top_k_enqueue, plan_out=plan_out, progress=progress, cache_directory=cache_directory,
                  seed=seed, prune_factor=prune_factor, eager=eager, started=started).run()


__all__ = ["Progress", "TuneReport", "autotune", "measure_in_process", "tune"]
