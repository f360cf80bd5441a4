"""The tuning study: measured trials of the cost model's best plans, driven by Optuna, resumable.

    report = tune(["torchrun", "--nproc-per-node", "8", "train.py"], study_path="study.db", trials=12)
    report = autopar.autotune(lambda: MyModel(), sample, loss_fn, trials=6)     # in this process, one GPU

This module holds the two entry points; the engine is autopar.tune.engine, the space autopar.tune.space,
the refit autopar.tune.refit. How a study runs (docs/tuning.md, "The study"):

1. **Probe** the user's script once (autopar.tune.launcher.probe): the profile its `wrap` makes, the
   topology, the world size and the global batch.
2. **The space** is the cost model's feasible candidates (autopar.search.search with the calibration
   cached for this topology): plans that do not fit or are dominated never run. At most `max_space` of
   them, the best predicted. Each trial's parameters are the plan's readable name (`plan`, e.g.
   "fsdp2 mb4 fp32") and its strategy fields (pp, dp_replicate, dp_shard, tp, micro_batch_size, ...),
   categorical over the values in the space, so optuna-dashboard shows what each trial ran. The first
   run of a study stores each plan's YAML and prediction in the study's user attributes, and a resumed
   study uses those, so the space never changes under a study.
3. **The best predicted first**: the `top_k_enqueue` best predicted plans are queued in predicted order;
   then a seeded TPE sampler proposes plan names (the fields follow the name). The queue is autopar's (a
   study attribute, `autopar.queue`): each entry becomes an Optuna trial (enqueue_trial, then ask) only
   when it runs, so nothing waits in Optuna's own queue and a stale trial's retry can be put first.
4. **Each trial** runs the plan in the user's command (run_trial) and reports the measured throughput
   (tokens/s, or samples/s for inputs without a sequence) to maximise; its user attributes hold the
   prediction (`predicted`) and the measurement (`measured`, `status`). A plan that fails (oom, crash,
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
   to every plan measured in the study, from the calibration the study started with (autopar.tune.refit);
   the calibration kept is the one that predicts the measured steps best, so a fit never makes them
   worse. A fit within bounds (autopar.cost.calibration.check_refit) is saved for this model on this topology
   (save_refit), never for the topology alone; one out of bounds is not saved, with a one-line warning.
   The report shows the step-time prediction error of each measured plan before (the starting
   calibration) and after (the last fit).
8. **Budgets**: `trials` plans measured (ok or failed) over the study's life, resumed runs included;
   `time_budget_s` of this call (no trial starts after it; the one in flight finishes); or the space is
   exhausted. Pruned trials and repeats do not count.
9. **At the end** the best measured plan is written to `plan_out`, then cached (autopar.plan_cache.store). If
   either write fails, ResultNotSavedError carries the report and says where the plan is kept (the other
   file, the study); running the same command again runs no measured plan again and saves it.

**Before anything runs** (autopar.tune.storage.check_places), every place the study writes (the plan and
calibration caches, the study file and its lock, `plan_out`'s folder) is tried for writing and the study file
is checked to be sound SQLite, and (launcher.check_launchable) the launch command's program and script must
exist: each refusal is one line naming the path and what to change.

**Storage and resuming.** The study lives in a SQLite file (Optuna's RDBStorage), one study per file.
While a tuner works on it, it holds an exclusive lock on `STUDY.lock` (taken before the probe; a second tuner is
refused at once, StudyLockedError naming the holder's pid and the file), so
when a tuner starts, any trial still RUNNING was left by a tuner that was killed: it is marked FAIL
(status "stale") and its plan is put first in the queue, so no trial is lost; a completed trial is never run
again (point 5), so none is duplicated. Optuna's own heartbeat (`fail_stale_trials`) only works inside
`study.optimize`, which the ask-and-tell loop here does not use. A study written by an autopar of another
study format (autopar.tune.schema.STUDY_FORMAT) is refused, with a sentence; `autopar report` still reads it.

**SIGTERM and SIGINT** (autopar.tune.interrupt): `tune` ends the run in flight (its whole process group, SIGTERM
then SIGKILL), records its trial as FAIL with status "interrupted" (and the user attribute `interrupted: true`),
puts its plan first in the queue, and raises TuneInterrupted (a KeyboardInterrupt); `autopar tune` exits 128 + the
signal's number (130 for SIGINT, 143 for SIGTERM).
"""

from __future__ import annotations

import gc
import os
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Mapping, Sequence

from .._util.batch import sample_batch_size
from ..errors import TuneError
from ..planning import profile_variants
from ..plans import Loop, Plan
from . import launcher
from .engine import MAX_SPACE, PRUNE_FACTOR, STALE_CAUSE, Progress, StudyEngine, StudyOptions, check_budget
from .inprocess import InProcessResult, measure_in_process, single_device
from .interrupt import handling_signals
from .report import TuneReport
from .storage import check_places, study_lock


def tune(
    argv: Sequence[str],
    *,
    study_path: str | os.PathLike[str],
    trials: int | None = None,
    time_budget_s: float | None = None,
    steps: int = 10,
    warmup: int = 3,
    trial_timeout_s: float = 600.0,
    loop: Loop | str | None = None,
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
    allow_train_step: bool | None = None,
    max_autotune: bool = False,
) -> TuneReport:
    """Tune the parallelism plan of the job `argv` (the user's launch command, e.g. `["torchrun",
    "--nproc-per-node", "8", "train.py"]`, whose script calls autopar.wrap) by measured trials, in the
    Optuna study at `study_path` (SQLite; created, or resumed). See the module docstring for how.

    `trials`: plans to measure over the study's life (resumed runs included); `time_budget_s`: seconds for
    this call; with neither, every feasible plan is measured or pruned. `steps` timed optimizer steps after
    `warmup` per trial, each trial at most `trial_timeout_s`. `loop` (autopar.plans.Loop): what drives the
    script's step, so which plans are tried ("plain": pure data parallelism; "accumulates": accumulation and
    tensor parallelism too; "train_step": pipelines too); None (the default) follows the script's own
    `wrap(loop=...)` (or `autopar.integrations.hf.prepare`, "accumulates"), as the probe saw it, so that the
    cached plan is the one later runs of the script look up. `allow_train_step=` is its deprecated spelling
    (True: "train_step", False: "plain"). `eager`: measure eager plans beside compiled ones (the cost model
    ranks compiled plans first, but compilation can fail or lose on a given model); False keeps the search's
    compiled plans only. `max_autotune`: each compiled plan has a twin compiled with inductor's max-autotune
    (Plan.max_autotune: GEMM and convolution kernels chosen by timing, minutes more compile a trial; give
    `trial_timeout_s` room). The best plan is cached (autopar.plan_cache; in
    `cache_directory` when given) and written to `plan_out`. `progress(Progress)` is called at each event.
    `runner`/`prober` replace autopar.tune.launcher's run_trial/probe (tests)."""
    check_budget(trials, time_budget_s, steps, warmup, top_k_enqueue)
    check_places(Path(study_path), plan_out=plan_out, cache_directory=cache_directory)  # before the probe and trials
    runner = runner or launcher.run_trial  # looked up now: tests replace them on the module
    prober = prober or launcher.probe
    started = time.perf_counter()
    argv = [str(a) for a in argv]
    loop = _legacy_loop(loop, allow_train_step)
    # the lock first (a second tuner is refused at once, not after the probe), then SIGTERM and SIGINT end the run
    # in flight and record its trial as interrupted (autopar.tune.interrupt)
    with study_lock(Path(study_path)), handling_signals():
        probe = prober(argv, timeout_s=trial_timeout_s, env=env, workdir=workdir)
        if loop is None:
            loop = _probed_loop(probe)

        def measure(plan: Plan) -> Any:
            return runner(argv, plan, steps=steps, warmup=warmup, timeout_s=trial_timeout_s, env=env, workdir=workdir)

        options = StudyOptions(trials=trials, time_budget_s=time_budget_s, loop=loop,
                               top_k_enqueue=top_k_enqueue, plan_out=plan_out, progress=progress,
                               cache_directory=cache_directory, seed=seed, prune_factor=prune_factor,
                               max_space=max_space, eager=eager, argv=argv, max_autotune=max_autotune)
        return StudyEngine(probe, measure, Path(study_path), options, started=started, lock_held=True).run()


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
    loop: Loop | str | None = None,
    top_k_enqueue: int = 5,
    plan_out: str | os.PathLike[str] | None = None,
    progress: Callable[[Progress], None] | None = None,
    optimizer_fn: Callable[[Any], Any] | None = None,
    cache_directory: str | os.PathLike[str] | None = None,
    seed: int = 0,
    prune_factor: float = PRUNE_FACTOR,
    blocks: Any = None,
    eager: bool = True,
    allow_train_step: bool | None = None,
    max_autotune: bool = False,
) -> TuneReport:
    """Tune the plan of one process (one GPU, or the CPU) in this process: for a notebook or a single-GPU
    script. The same study as `autopar tune` (the module docstring), with each trial run here: a fresh model
    from `model_fn()`, wrapped with the plan, trained `steps` steps with autopar.train_step after `warmup`
    on `sample` repeated to the plan's batch; out of memory is a failed trial, and memory is freed after
    each. `sample`: one batch (its batch size is the global batch unless `global_batch_size` is given).
    `study_path`: a SQLite file to keep (and resume) the study; default: in memory. `optimizer_fn(params)`:
    the optimizer (default AdamW, lr 1e-4). `eager`, `max_autotune`: as in `tune`. `loop`: as in `tune`; by default "train_step"
    (each trial runs autopar.train_step), the deprecated `allow_train_step=False` is "plain". Returns the
    TuneReport; the best plan is cached for `wrap`."""
    loop = _legacy_loop(loop, allow_train_step) or Loop.TRAIN_STEP
    check_budget(trials, time_budget_s, steps, warmup, top_k_enqueue)
    path = Path(study_path) if study_path is not None else None
    check_places(path, plan_out=plan_out, cache_directory=cache_directory)  # before any trial
    started = time.perf_counter()
    topo = single_device(topology)
    gbs = global_batch_size if global_batch_size is not None else sample_batch_size(sample)
    with study_lock(path):  # first: a second tuner on the study is refused before the profile
        model = model_fn()
        try:
            profile, variants = profile_variants(model, sample, topo, loss_fn=loss_fn, blocks=blocks)
        finally:
            del model
            gc.collect()
        probe = SimpleNamespace(profile=profile, variants=variants, topology=topo, world_size=1,
                                global_batch_size=gbs, model_fingerprint=profile.fingerprint)

        def measure(plan: Plan) -> InProcessResult:
            return measure_in_process(model_fn, sample, plan, loss_fn=loss_fn, topology=topo, steps=steps,
                                      warmup=warmup, optimizer_fn=optimizer_fn,
                                      tokens_per_sample=profile.tokens_per_sample)

        options = StudyOptions(trials=trials, time_budget_s=time_budget_s, loop=loop,
                               top_k_enqueue=top_k_enqueue, plan_out=plan_out, progress=progress,
                               cache_directory=cache_directory, seed=seed, prune_factor=prune_factor, eager=eager,
                               max_autotune=max_autotune)
        return StudyEngine(probe, measure, path, options, started=started, lock_held=True).run()


def _legacy_loop(loop: Loop | str | None, allow_train_step: bool | None) -> Loop | None:
    """`loop`, or the deprecated `allow_train_step` (True: TRAIN_STEP, False: PLAIN); None when neither says."""
    if allow_train_step is None:
        return None if loop is None else Loop.parse(loop)
    if loop is not None:
        raise TuneError("pass loop= only: allow_train_step= is its deprecated spelling (False is loop='plain').")
    warnings.warn("autopar tune: allow_train_step= is deprecated; pass loop='train_step' (True) or loop='plain' "
                  "(False).", DeprecationWarning, stacklevel=3)
    return Loop.TRAIN_STEP if allow_train_step else Loop.PLAIN


def _probed_loop(probe: Any) -> Loop:
    """The loop the probed script's wrap declared; a probe that recorded none (an older run) allows every plan."""
    loop = getattr(probe, "loop", None)
    if isinstance(loop, Loop):
        return loop
    declared = getattr(probe, "uses_train_step", None)  # a probe of another shape (tests, older runs)
    return Loop.TRAIN_STEP if declared is None else (Loop.TRAIN_STEP if declared else Loop.PLAIN)


__all__ = ["InProcessResult", "Progress", "STALE_CAUSE", "TuneReport", "autotune", "measure_in_process", "tune"]
