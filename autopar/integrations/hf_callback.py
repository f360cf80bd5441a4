"""`AutoparCallback`: the Hugging Face Trainer's steps measured against autopar's prediction, fed back to the
plan cache the way a tuner's trial is, and the training state saved through `autopar.save`.

The step time is the time between consecutive ends of optimizer steps (`on_step_end`, the device synchronised),
after `warmup_steps`, as a tuner's trial times the steps between its optimizer-step hooks: it holds the data
loading and everything else the Trainer does per step. From it: tokens/s (samples/s for inputs without a
sequence) at the plan's global batch, MFU as the prediction's MFU scaled by predicted / measured step time (the
same model FLOPs), and the peak memory (CUDA's reserved peak, the most of any rank; on CPU the process's peak
resident set, which holds more than the model's tensors).
"""

from __future__ import annotations

import io
import json
import math
import random
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import transformers  # this module is the Hugging Face integration: `pip install -e ".[hf]"` in the clone
from accelerate.optimizer import AcceleratedOptimizer  # the Trainer's optimizer wrapper (accelerate: autopar[hf])
from transformers.trainer import SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.training_args import ParallelMode

from .._util.log import get_logger
from ..checkpoint import load, save
from ..errors import AutoparError, PlanError
from ..plan_cache import SOURCE_RUN, cache_key, lookup, measured_throughput, store
from ..plans import Loop
from ..strategies.state import Applied, applied, is_wrapped
from ._measure import _sync

#: Where in a Trainer checkpoint folder (`checkpoint-N`) the callback saves the training state.
STATE_FOLDER = "autopar"

#: Bounds on what a resume reads besides autopar's checkpoint (the Trainer's state and the schedule: kilobytes).
_MAX_TRAINER_STATE_BYTES = 64 << 20
_MAX_SCHEDULER_BYTES = 16 << 20


@dataclass(frozen=True)
class StepMeasurement:
    """What `AutoparCallback` measured over a Trainer run, beside the plan's prediction (None: not predicted)."""

    steps: int  # timed optimizer steps (after the warm-up)
    step_s: float  # mean seconds per timed optimizer step
    samples_per_s: float  # the plan's global batch per step_s
    tokens_per_s: float | None  # samples_per_s x tokens per sample (None without a sequence)
    mfu: float | None  # the predicted MFU x predicted step_s / measured step_s
    peak_memory_bytes: int | None  # CUDA's reserved peak, the most of any rank (None on CPU)
    peak_rss_bytes: int  # this process's peak resident set (host memory)
    predicted_step_s: float | None = None
    predicted_tokens_per_s: float | None = None
    predicted_mfu: float | None = None
    predicted_memory_bytes: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise AutoparError(f"StepMeasurement.steps must be a positive integer, got {self.steps!r}.")
        for name in ("step_s", "samples_per_s"):
            value = getattr(self, name)
            if not (isinstance(value, float) and math.isfinite(value) and value > 0):
                raise AutoparError(f"StepMeasurement.{name} must be a positive number, got {value!r}.")

    def throughput(self) -> float:
        """tokens/s where the inputs have a sequence, else samples/s (what a tuner's study maximises)."""
        return self.tokens_per_s if self.tokens_per_s is not None else self.samples_per_s

    def to_cache(self) -> dict[str, float]:
        """The measurement as the plan cache keeps it (autopar.plan_cache.store)."""
        out = {"step_s": self.step_s, "samples_per_s": self.samples_per_s, "steps": float(self.steps)}
        if self.tokens_per_s is not None:
            out["tokens_per_s"] = self.tokens_per_s
        if self.peak_memory_bytes is not None:
            out["peak_reserved_bytes"] = float(self.peak_memory_bytes)
        return out

    def describe(self) -> str:
        """One line: each measured figure with its prediction beside it."""
        def beside(value: str, predicted: str | None) -> str:
            return value if predicted is None else f"{value} (predicted {predicted})"

        parts = [beside(f"{self.step_s * 1e3:,.1f} ms/step", _ms(self.predicted_step_s))]
        if self.tokens_per_s is not None:
            parts.append(beside(f"{self.tokens_per_s:,.0f} tokens/s", _count(self.predicted_tokens_per_s)))
        else:
            parts.append(f"{self.samples_per_s:,.1f} samples/s")
        if self.mfu is not None:
            parts.append(beside(f"MFU {self.mfu:.1%}", _share(self.predicted_mfu)))
        if self.peak_memory_bytes is not None:
            parts.append(beside(f"peak {self.peak_memory_bytes / 2**30:.2f} GiB", _gib(self.predicted_memory_bytes)))
        else:
            parts.append(beside(f"peak host RSS {self.peak_rss_bytes / 2**30:.2f} GiB", None))
        return f"measured over {self.steps} steps: " + ", ".join(parts)


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value > 0 else None


def _ms(value: float | None) -> str | None:
    return None if value is None else f"{value * 1e3:,.1f} ms"


def _count(value: float | None) -> str | None:
    return None if value is None else f"{value:,.0f}"


def _share(value: float | None) -> str | None:
    return None if value is None else f"{value:.1%}"


def _gib(value: float | None) -> str | None:
    return None if value is None else f"{value / 2**30:.2f} GiB"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _peak_device_bytes() -> int | None:
    """CUDA's reserved peak, the most of any rank; None on CPU."""
    if not torch.cuda.is_available():
        return None
    peak = torch.tensor([torch.cuda.max_memory_reserved()], dtype=torch.float64, device="cuda")
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())


def _peak_rss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * (1 if sys.platform == "darwin" else 1024)


def measure(state: Applied, step_s: float, *, steps: int) -> StepMeasurement:
    """The measurement of `steps` timed steps of a run of the plan in `state` (`step_s`: their mean), beside its
    prediction."""
    plan, profile = state.plan, state.profile
    step = float(step_s)
    samples = plan.global_batch_size / step
    tokens = samples * profile.tokens_per_sample if profile.tokens_per_sample else None
    pred = dict(plan.prediction or {})
    p_step, p_mfu = _finite(pred.get("step_s")), _finite(pred.get("mfu"))
    return StepMeasurement(
        steps=steps, step_s=step, samples_per_s=samples, tokens_per_s=tokens,
        mfu=p_mfu * p_step / step if p_mfu is not None and p_step is not None else None,
        peak_memory_bytes=_peak_device_bytes(), peak_rss_bytes=_peak_rss_bytes(), predicted_step_s=p_step,
        predicted_tokens_per_s=_finite(pred.get("tokens_per_s")), predicted_mfu=p_mfu,
        predicted_memory_bytes=_finite(pred.get("memory_bytes")))


class _Window:
    """The timed steps: the clock starts at the end of the last warm-up step and is read when a measurement is
    asked for, the device synchronised at both (never between steps: a synchronisation per step would stop the
    host from queuing the next step while the GPU runs this one, and cost the run a few percent)."""

    def __init__(self, warmup_steps: int) -> None:
        self.warmup_steps = warmup_steps
        self.t0: float | None = None
        self.first_step = 0

    def step_end(self, global_step: int) -> None:
        if self.t0 is None and global_step >= self.warmup_steps:
            _sync()
            self.t0, self.first_step = time.perf_counter(), global_step

    def read(self, global_step: int) -> tuple[float, int] | None:
        """(mean seconds per step, steps) since the clock started; None before any timed step."""
        if self.t0 is None or global_step <= self.first_step:
            return None
        _sync()
        steps = global_step - self.first_step
        return (time.perf_counter() - self.t0) / steps, steps


def feed_back(state: Applied, measured: StepMeasurement, *, loop: Loop,
              directory: str | Path | None = None) -> Path | None:
    """Keep the measured plan in the plan cache for this job (model, hardware, global batch, torch, loop), as the
    tuner keeps its best measured plan, unless a plan is cached there that was measured faster; returns the file
    written, or None. The next `prepare` (or `wrap`) of the same job then applies the faster plan."""
    key = cache_key(state.profile, state.topology, global_batch_size=state.plan.global_batch_size, loop=loop)
    cached = lookup(key, directory=directory)
    best = measured_throughput(cached.measurement if cached is not None else None)
    if best is not None and best >= measured.throughput():
        return None
    # the source says a measured run, never a tuner study (issue 34, item 7)
    return store(state.plan, key, measurement={**measured.to_cache(), "source": f"{SOURCE_RUN} (the Hugging Face "
                                                                                  "Trainer)"}, directory=directory)


def _inner(optimizer: Any) -> Any:
    """The optimizer itself (AdamW, ...), not accelerate's wrapper: autopar.save and load check its kind."""
    return optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer


def _rng_file(args: Any) -> str:
    """The Trainer's name for this process's random states in a checkpoint (its `_load_rng_state` reads it)."""
    return f"rng_state_{args.process_index}.pth" if args.world_size > 1 else "rng_state.pth"


def _save_trainer_extras(folder: Path, args: Any, lr_scheduler: Any) -> None:
    """What the Trainer leaves out of a checkpoint under `save_only_model` besides the optimizer, in its own files
    and formats: the learning-rate schedule (rank 0; the callback loads it on resume) and each process's random
    states (the Trainer loads them itself on resume, where its data loader reaches the step)."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():  # as the Trainer's _save_rng_state keeps them
        distributed = args.parallel_mode == ParallelMode.DISTRIBUTED
        states["cuda"] = torch.cuda.random.get_rng_state_all() if distributed else torch.cuda.random.get_rng_state()
    torch.save(states, folder / _rng_file(args))
    if lr_scheduler is not None and args.should_save:
        torch.save(lr_scheduler.state_dict(), folder / SCHEDULER_NAME)


def _read_bounded(path: Path, limit: int, what: str) -> bytes:
    size = path.stat().st_size
    if size > limit:
        raise AutoparError(f"{path} ({what}) is {size} bytes, more than the {limit} a resume reads: it is not the "
                           "file AutoparCallback's checkpoint holds.")
    return path.read_bytes()


def resume(args: Any, state: Any, model: Any, optimizer: Any, lr_scheduler: Any) -> None:
    """Restore what the Trainer does not under `save_only_model` when it resumes at `state.global_step`: the model
    and optimizer from the checkpoint's `autopar` folder (`autopar.load`, under any plan) and the learning-rate
    schedule. The Trainer does not tell a callback which checkpoint it resumed from, so this reads
    `output_dir/checkpoint-N` (what `resume_from_checkpoint=True` picks) and refuses it unless its trainer state has
    the same history as the one the Trainer read; it refuses any checkpoint it cannot restore fully rather than go
    on with a fresh optimizer or schedule."""
    step = state.global_step
    folder = Path(args.output_dir) / f"checkpoint-{step}"
    start_anew = ("resume from a checkpoint-N in output_dir that AutoparCallback saved, or start the run anew (the "
                  "Trainer alone would go on with a fresh optimizer and schedule)")
    if not (folder / STATE_FOLDER).is_dir():
        raise AutoparError(f"trainer.train(resume_from_checkpoint=...) at step {step} needs the training state "
                           f"AutoparCallback saves in {folder / STATE_FOLDER}, which is not there: {start_anew}.")
    written = folder / TRAINER_STATE_NAME
    history = (json.loads(_read_bounded(written, _MAX_TRAINER_STATE_BYTES, "the Trainer's state")).get("log_history")
               if written.is_file() else None)
    if json.dumps(history) != json.dumps(state.log_history):  # (as text: a NaN loss equals itself)
        raise AutoparError(f"the Trainer resumed at step {step} from a checkpoint other than {folder} (their "
                           f"histories differ), and only that one's optimizer state is found: {start_anew}.")
    if lr_scheduler is not None and not (folder / SCHEDULER_NAME).is_file():
        raise AutoparError(f"{folder} holds no learning-rate schedule ({SCHEDULER_NAME}; saved by an older autopar): "
                           f"resume in your own loop with autopar.load(model, optimizer, '{folder / STATE_FOLDER}'), "
                           "or start the run anew.")
    if optimizer is None:
        raise AutoparError(f"the Trainer resumed at step {step} without an optimizer to restore: {start_anew}.")
    load(model, _inner(optimizer), folder / STATE_FOLDER)
    if lr_scheduler is not None:
        data = _read_bounded(folder / SCHEDULER_NAME, _MAX_SCHEDULER_BYTES, "the learning-rate schedule")
        lr_scheduler.load_state_dict(torch.load(io.BytesIO(data), weights_only=True))  # tensors and numbers only
    if _rank() == 0:
        get_logger().info("resumed at step %d from %s: weights, optimizer and schedule.", step, folder)


class AutoparCallback(transformers.TrainerCallback):
    """Measures the Trainer's steps against autopar's prediction, logs them (rank 0), keeps the measured plan in
    the plan cache when it is the fastest measured for the job (`feedback`), and saves the training state with
    `autopar.save` at each of the Trainer's checkpoints (`save`), so that it loads under another plan; when the
    Trainer resumes from such a checkpoint (`resume_from_checkpoint`), it restores the optimizer and schedule the
    Trainer does not (see `resume`).

    `warmup_steps`: optimizer steps not timed (compilation, the allocator). `feedback=False` writes nothing to the
    plan cache; `cache_directory`: its root (default, autopar's). `measurement` holds the last run's result."""

    def __init__(self, *, warmup_steps: int = 3, feedback: bool = True, save: bool = True,
                 cache_directory: str | Path | None = None) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise AutoparError(f"warmup_steps must be a non-negative integer, got {warmup_steps!r}.")
        self.warmup_steps, self.feedback, self.save = warmup_steps, feedback, save
        self.cache_directory = cache_directory
        self.measurement: StepMeasurement | None = None
        self._state: Applied | None = None
        self._window = _Window(warmup_steps)
        self._said_at: int | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        if model is None or not is_wrapped(model):
            raise PlanError("AutoparCallback needs the model autopar.integrations.hf.prepare returned: pass that "
                            "model to the Trainer.")
        if state.global_step > 0:  # the Trainer resumed (its state read from a checkpoint's trainer_state.json)
            resume(args, state, model, optimizer, lr_scheduler)
        self._state, self._window, self.measurement = applied(model), _Window(self.warmup_steps), None
        self._said_at = None  # the step whose measurement on_log said last
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._window.step_end(state.global_step)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        timed = self._window.read(state.global_step) if self._state is not None else None
        if timed is None:
            return
        self.measurement = measure(self._state, timed[0], steps=timed[1])
        if logs is not None:  # for the callbacks after this one (reporters)
            logs.update({f"autopar/{k}": v for k, v in self.measurement.to_cache().items()})
        if _rank() == 0 and self._said_at != state.global_step:  # (the Trainer's summary logs at the last step too)
            get_logger().info("step %d: %s", state.global_step, self.measurement.describe())
            self._said_at = state.global_step

    def on_save(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                lr_scheduler: Any = None, **kwargs: Any) -> None:
        if self.save and model is not None and optimizer is not None:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            save(model, _inner(optimizer), folder / STATE_FOLDER)
            _save_trainer_extras(folder, args, lr_scheduler)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        timed = self._window.read(state.global_step) if self._state is not None else None
        if timed is None:
            if _rank() == 0 and self._state is not None:
                get_logger().info("no step timed: the run had at most %d warm-up steps.", self.warmup_steps)
            return
        self.measurement = measure(self._state, timed[0], steps=timed[1])
        if _rank() != 0:
            return
        if self._said_at != state.global_step:  # not said already by the last step's log
            get_logger().info("%s", self.measurement.describe())
        if self.feedback:
            path = feed_back(self._state, self.measurement, loop=Loop.ACCUMULATES, directory=self.cache_directory)
            if path is not None:
                get_logger().info("kept this plan, measured, in the plan cache at %s: the next prepare of this job "
                                  "applies it.", path)
