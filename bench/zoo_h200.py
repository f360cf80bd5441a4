"""Issue 10's GPU must-show: every zoo family trained on one GPU by hand and under autopar.wrap, measured.

For each family of bench/zoo.py at its realistic size and batch, the model built on the GPU (seeded random init):
  hand          bf16 autocast (forward and loss) + fused AdamW, eager
  hand_compile  the same, the model under torch.compile (skipped on a CPU, with the reason recorded)
  wrap          autopar.wrap(model, sample=..., loss_fn=...) (its own choice), then the user's plain loop with
                AdamW (fused where the plan allows)
  plan_eager    autopar.wrap with the plan given: one GPU, bf16, micro-batch = the batch, eager
  plan_compile  the same, compiled (the two plans wrap chooses between on one GPU)
  plan_float8   the same compiled, with float8 linears (Plan.float8; needs torchao there: `.whl-fp8`)
  plan_graphs   the same compiled, replayed as CUDA graphs (Plan.cuda_graphs: what wrap's race may keep)
each timed over `--steps` steps after `--warmup`, more where they last under `--min-timed-s` (the median of
per-step CUDA-event times), with the steady
state's torch.cuda.max_memory_allocated / max_memory_reserved and the CUDA context (device memory in use
that the caching allocator does not hold, torch.cuda.mem_get_info). A wrap record holds its plan and the
prediction wrap made for it; a hand record, autopar's prediction for the same recipe as a plan (bf16,
micro-batch = the batch, eager or compiled), traced on the meta device.

One JSON line per (family, mode), appended as it finishes to `--out` (default $OUT/zoo_h200.jsonl). Each
family runs in its own process (a clean CUDA context and allocator, killed at `--family-timeout-s`);
no family starts when `--time-budget-s` is spent. Records already in `--out` or in a `--resume` file are
not measured again (but those of status `cut`, `unavailable`: `--redo`).

    python -m bench.zoo_h200 --families gpt2,vit --time-budget-s 480 [--resume bench/results/zoo_h200_DATE.jsonl]
    python -m bench.zoo_h200 --device cpu --size tiny --families gpt2,vit,resnet --steps 2   # the CPU smoke test
    python -m bench.zoo_h200 --report bench/results/zoo_h200_DATE.jsonl                    # the must-show table
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib.util
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import autopar
from autopar.planning import calibration_for, profile_variants, short_name
from autopar.search import enumerate_plans
from bench._common import host_op_us, kernel_kind, results_path
from bench.zoo import FAMILIES, ZOO, Family, build_model, make_sample
from bench.zoo_h200_report import NOT_MEASURED, read_records, report

MODES = ("hand", "hand_compile", "hand_bf16", "fp32", "wrap", "rewrap", "plan_eager", "plan_compile", "plan_float8",
         "plan_graphs", "oracle", "tune")
#: "hand_bf16": the other hand recipe, the model's weights cast to bf16 (`model.to(torch.bfloat16)`; no autocast, no
#: fp32 master weights; eager): matmuls autocast does not reach (a custom op's, e.g. an MoE's experts in
#: transformers' grouped_mm fallback) run in bf16 there; not an autopar plan, so not in the must-show's "best".
#: "rewrap": a fresh copy of the model wrapped again after "wrap" in the same process (same model and job):
#: wrap's own cache (autopar/wrap_cache.py) then gives the plan, and `wrap_s` is the cached start-up (no steps are
#: timed: they are "wrap"'s).
#: "fp32": by hand without autocast (fp32 weights and compute, fused AdamW), issue 14's baseline column.
#: "oracle": every plan of autopar's own one-GPU candidate space for the family's batch (autopar.search's
#: enumerate_plans: checkpointing x compile, x float8 where torchao imports), each measured as wrap given that
#: plan; the record is the fastest's, every candidate's step and status in `grid` (issue 14's oracle).
#: "tune": autopar.autotune's study in this process (--tune-trials trials, a fresh model each, over the same plain-loop
#: space), then wrap given its best plan, measured like the others; the trials in `grid`, the study's time `tune_s`.
DEFAULT_MODES = ("hand", "hand_compile", "wrap")  # the must-show's; the plan modes when asked for
PLAN_MODES = ("plan_eager", "plan_compile", "plan_float8", "plan_graphs")  # wrap given the plan of mode_plan
# the modes that run one GPU's bf16 plan at the family's batch, by hand or given to wrap: mode -> the plan's options
ONE_GPU_MODES = {"hand": {}, "hand_compile": {"compile": True}, "fp32": {"precision": "fp32"}, "plan_eager": {},
                 "plan_compile": {"compile": True},
                 "plan_float8": {"compile": True, "float8": True},
                 "plan_graphs": {"compile": True, "cuda_graphs": True}}  # Plan.cuda_graphs: CUDA graphs replayed
MAX_TIMED_STEPS = 200  # --min-timed-s's most timed steps
STATUSES = ("ok", "oom", "error", "skipped", "unavailable", "timeout", "cut")
GiB = 2**30

@dataclass(frozen=True)
class Options:
    """What every measurement of one call shares."""

    device: str  # "cuda" or "cpu"
    size: str  # "realistic" or "tiny"
    batch: int | None  # None: the family's batch at that size
    warmup: int
    steps: int
    lr: float
    hand_predictions: bool
    compile_on_cpu: bool
    out: Path
    command: str
    profile_steps: int = 0  # > 0: torch.profiler over this many more steps, GPU kernel time by kind (kernels_of)
    min_timed_s: float = 0.0  # more steps than `steps` where they last less than this (a steadier median)
    tune_trials: int = 6  # mode "tune": the study's trials
    tune_max_autotune: bool = False  # mode "tune": the compiled plans' max-autotune twins in its space too


# ---- what a record says about where it was made -------------------------------------------------------
def environment(opts: Options, device_name: str | None = None) -> dict[str, Any]:
    """Where a record was made. The parent gives `device_name` (a child's): it never touches the GPU, so
    that the children's context figures (device memory in use) hold no parent's CUDA context."""
    import transformers  # optional: the zoo's Hugging Face families need it; recorded for the results

    if device_name is None:
        device_name = torch.cuda.get_device_name() if opts.device == "cuda" else "cpu"
    return {"device": device_name, "torch": torch.__version__, "transformers": transformers.__version__,
            "date": datetime.date.today().isoformat(), "command": opts.command}


def batch_of(family: Family, opts: Options) -> int:
    if opts.batch is not None:
        return opts.batch
    return family.realistic_batch if opts.size == "realistic" else family.tiny_batch


def to_device(sample: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in sample.items()}


def real_sample(family: Family, opts: Options) -> dict[str, Any]:
    """One batch of real tensors on the device (the zoo makes them on the CPU, seeded)."""
    sample = family.sample(opts.size, batch_of(family, opts), torch.device("cpu"), torch.Generator().manual_seed(0))
    return to_device(sample, torch.device(opts.device))


def tokens_per_sample(sample: dict[str, Any]) -> int | None:
    ids = sample.get("input_ids")
    return int(ids.shape[1]) if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None


def build_on_device(family: Family, opts: Options) -> nn.Module:
    torch.manual_seed(0)
    with torch.device(opts.device):
        model = family.build(opts.size)
    return model.train()


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


# ---- one training step, and timing it ------------------------------------------------------------------
class Step:
    """The user's loop body: forward (under autocast where asked), the family's loss, backward, AdamW."""

    def __init__(self, model: nn.Module, family: Family, sample: dict[str, Any], opt: torch.optim.Optimizer, *,
                 autocast_device: str | None) -> None:
        self.model, self.family, self.sample, self.opt = model, family, sample, opt
        self.autocast_device = autocast_device
        self.loss: torch.Tensor | None = None

    def __call__(self) -> None:
        if self.autocast_device is not None:
            with torch.autocast(self.autocast_device, dtype=torch.bfloat16):
                loss = self.family.loss_fn(self.model(**self.sample), self.sample)
        else:
            loss = self.family.loss_fn(self.model(**self.sample), self.sample)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.loss = loss.detach()


def adamw(model: nn.Module, lr: float, *, fused: bool) -> tuple[torch.optim.Optimizer, str]:
    """AdamW over the trainable parameters, fused where asked and torch accepts it; and what it is."""
    params = [p for p in model.parameters() if p.requires_grad]
    if fused:
        try:
            return torch.optim.AdamW(params, lr=lr, fused=True), "AdamW(fused=True)"
        except Exception as exc:  # e.g. parameters torch's fused kernel does not take
            return torch.optim.AdamW(params, lr=lr), f"AdamW (fused refused: {first_line(exc)})"
    return torch.optim.AdamW(params, lr=lr), "AdamW"


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(step: Step, opts: Options) -> dict[str, Any]:
    """Warm up, reset the peak statistics, then time `opts.steps` steps: per-step CUDA events on a GPU (the
    steps stay queued back to back, as in training), the wall clock around each step on a CPU."""
    t0 = time.perf_counter()
    for _ in range(opts.warmup):
        step()
    sync(opts.device)
    warmup_s = time.perf_counter() - t0
    out: dict[str, Any] = {"warmup_s": round(warmup_s, 3)}
    steps = opts.steps
    if opts.min_timed_s > 0:  # one more step, synchronised, says how many last min_timed_s (at most MAX_TIMED_STEPS)
        t1 = time.perf_counter()
        step()
        sync(opts.device)
        steps = max(steps, min(MAX_TIMED_STEPS, math.ceil(opts.min_timed_s / max(time.perf_counter() - t1, 1e-6))))
    out["timed_steps"] = steps
    if opts.device == "cuda":
        out["peak_allocated_warmup_bytes"] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        t0 = time.perf_counter()
        events[0].record()
        for event in events[1:]:
            step()
            event.record()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        times = [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(events)]
    else:
        times = []
        t0 = time.perf_counter()
        for _ in range(steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        wall = time.perf_counter() - t0
    out.update(step_s=statistics.median(times), step_s_mean=wall / steps,
               step_s_all=[round(t, 6) for t in times], loss=float(step.loss) if step.loss is not None else None)
    return out


def _busy_s(intervals: list[tuple[float, float]]) -> float:
    """Seconds of the union of (start, end) intervals in microseconds: the time some kernel ran."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if a > end:
            busy, end = busy + (b - a), b
        elif b > end:
            busy, end = busy + (b - end), b
    return busy / 1e6


def kernels_of(step: Step, num_steps: int) -> dict[str, Any]:
    """Where `num_steps` more steps' GPU time goes (torch.profiler, CUDA activity only), per step: seconds and
    kernels by kind (kernel_kind), the seconds some kernel ran (busy_s: the step's wall time less this is the
    GPU waiting for the host), the 12 longest kernels (name, seconds, count), the 8 longest of each kind, and
    every kernel (all_kernels: name, seconds, count, by name), for pricing fused work kernel by kernel."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(num_steps):
            step()
        torch.cuda.synchronize()
    out = _kernel_summary(prof, num_steps)
    with profile(activities=[ProfilerActivity.CPU]) as cpu:  # apart: the CPU's events slow the step they watch
        for _ in range(num_steps):
            step()
        torch.cuda.synchronize()
    top = sorted(cpu.key_averages(), key=lambda e: -e.self_cpu_time_total)[:25]
    out["cpu_top"] = [(e.key[:80], round(e.self_cpu_time_total / 1e6 / num_steps, 6), e.count // num_steps)
                      for e in top]
    out["op_device_top"] = _op_device_top(step, num_steps)
    return out


def _op_device_top(step: Step, num_steps: int, num_ops: int = 40) -> list[tuple[str, str, float, int]]:
    """The ops whose own kernels take the most GPU time (op, input shapes, seconds and calls per step): which
    aten op launched the memory-bound kernels a kernel name alone does not say. Profiled apart, CPU and CUDA
    together with shapes, which slows the host but not the kernels."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(num_steps):
            step()
        torch.cuda.synchronize()
    ops = [e for e in prof.key_averages(group_by_input_shape=True) if e.self_device_time_total > 0]
    ops.sort(key=lambda e: -e.self_device_time_total)
    return [(e.key[:80], str(e.input_shapes)[:160], round(e.self_device_time_total / 1e6 / num_steps, 6),
             e.count // num_steps) for e in ops[:num_ops]]


def _kernel_summary(prof: Any, num_steps: int) -> dict[str, Any]:
    """kernels_of's figures from a CUDA-activity profile of `num_steps` steps."""
    seconds: dict[str, float] = {}
    counts: dict[str, int] = {}
    top: dict[str, list[float]] = {}
    intervals = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        kind = kernel_kind(e.name)
        us = e.time_range.end - e.time_range.start
        seconds[kind] = seconds.get(kind, 0.0) + us / 1e6 / num_steps
        counts[kind] = counts.get(kind, 0) + 1
        entry = top.setdefault(e.name[:160], [0.0, 0])
        entry[0] += us / 1e6 / num_steps
        entry[1] += 1
        intervals.append((e.time_range.start, e.time_range.end))
    longest = sorted(top.items(), key=lambda kv: -kv[1][0])
    by_kind: dict[str, list[tuple[str, float, int]]] = {}
    for name, (t, c) in longest:  # the 8 longest of each kind (the memory-bound ones hide under the GEMMs)
        kept = by_kind.setdefault(kernel_kind(name), [])
        if len(kept) < 8:
            kept.append((name, round(t, 6), int(c) // num_steps))
    return {"kernel_s": {k: round(v, 6) for k, v in seconds.items()},
            "kernel_count": {k: v // num_steps for k, v in counts.items()},
            "busy_s": round(_busy_s(intervals) / num_steps, 6),
            "top_kernels": [(name, round(t, 6), int(c) // num_steps) for name, (t, c) in longest[:12]],
            "top_by_kind": by_kind,
            "all_kernels": [(name, round(t, 7), int(c) // num_steps) for name, (t, c) in longest]}


def memory(opts: Options) -> dict[str, Any]:
    """The steady state's peaks and the CUDA context now (device memory in use beyond what torch reserves)."""
    if opts.device != "cuda":
        return {"peak_allocated_bytes": None, "peak_reserved_bytes": None, "context_bytes": None}
    free, total = torch.cuda.mem_get_info()
    return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
            "context_bytes": total - free - torch.cuda.memory_reserved(), "device_total_bytes": total}


def throughput(rec: dict[str, Any], batch: int, tokens: int | None) -> None:
    rec["samples_per_s"] = batch / rec["step_s"]
    rec["tokens_per_s"] = batch * tokens / rec["step_s"] if tokens else None


def clean(device: str) -> None:
    """Free what the last measurement left: its graphs, its cached blocks, its peak statistics."""
    gc.collect()
    torch._dynamo.reset()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# ---- what autopar predicts -----------------------------------------------------------------------------
def mode_plan(mode: str, batch: int) -> autopar.Plan:
    """A one-GPU mode's recipe as an autopar plan (ONE_GPU_MODES): bf16 autocast with fp32 master weights (fp32
    throughout for "fp32"), no checkpointing, the batch as one micro-batch; compiled, with float8 linears, as the
    mode says."""
    return autopar.Plan(micro_batch_size=batch, **{"precision": "bf16", **ONE_GPU_MODES[mode]})


def prediction_fields(summary: dict[str, Any] | None, context_bytes: float) -> dict[str, Any]:
    """A plan's prediction (Prediction.summary(), as Plan.prediction holds it) in the record's names: the
    predicted peak is reserved + context, the calibration's context taken out for the reserved part."""
    if not summary:
        return {"predicted_step_s": None, "predicted_allocated_bytes": None, "predicted_reserved_bytes": None,
                "predicted_peak_bytes": None}
    peak = summary.get("memory_bytes")
    return {"predicted_step_s": summary.get("step_s"), "predicted_allocated_bytes": summary.get("allocated_bytes"),
            "predicted_reserved_bytes": None if peak is None else peak - context_bytes,
            "predicted_peak_bytes": peak, "predicted_context_bytes": context_bytes,
            "predicted_samples_per_s": summary.get("samples_per_s"),
            "predicted_tokens_per_s": summary.get("tokens_per_s"), "predicted_mfu": summary.get("mfu")}


class Predictor:
    """autopar's predictions for plans of one family, from one trace of the model on the meta device (at
    "tiny", on the CPU) in fp32 and bf16 (autopar.planning.profile_variants), made on first use."""

    def __init__(self, family: Family, opts: Options) -> None:
        self.family, self.opts = family, opts
        self.topology = autopar.Topology.detect()
        self.context_bytes = calibration_for(self.topology).context_bytes
        self._traced: tuple[Any, Any] | None = None
        self._error: str | None = None

    def _trace(self) -> tuple[Any, Any] | None:
        if self._traced is None and self._error is None:
            try:
                model = build_model(self.family, self.opts.size)
                sample = make_sample(self.family, self.opts.size, batch_of(self.family, self.opts))
                self._traced = profile_variants(model, sample, self.topology, loss_fn=self.family.loss_fn, warn=False)
            except Exception as exc:  # recorded with the measurement, which still happens
                self._error = first_line(exc)
        return self._traced

    @property
    def error(self) -> str | None:
        return self._error

    def candidates(self, batch: int) -> list[autopar.Plan]:
        """autopar's own candidate plans for one device at `batch` samples a step in a plain loop (the search's
        enumerate_plans; float8 twins where torchao imports; compiled ones even where the trace read values: they
        are measured here, not predicted), or none where the trace failed."""
        traced = self._trace()
        if traced is None:
            return []
        float8 = importlib.util.find_spec("torchao") is not None
        return list(enumerate_plans(traced[0], self.topology, world_size=1, global_batch_size=batch, loop="plain",
                                    measured=True, float8=float8))

    def fields(self, plan: autopar.Plan) -> dict[str, Any]:
        traced = self._trace()
        if traced is None:
            return {**prediction_fields(None, self.context_bytes), "predicted_error": self._error}
        profile, variants = traced
        try:
            prediction = autopar.predict(profile, plan, topology=self.topology, variants=variants)
        except Exception as exc:
            return {**prediction_fields(None, self.context_bytes), "predicted_error": first_line(exc)}
        return prediction_fields(prediction.summary(), self.context_bytes)


def compile_counts() -> dict[str, int]:
    """torch.compile's graphs and graph breaks so far in this process (dynamo's counters)."""
    counters = torch._dynamo.utils.counters
    return {"compiled_graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


# ---- the three modes -----------------------------------------------------------------------------------
class Measurement:
    """One (family, mode) measured in this process: builds the model, runs the mode, returns the record."""

    def __init__(self, family: Family, opts: Options, predictor: Predictor) -> None:
        self.family, self.opts, self.predictor = family, opts, predictor
        self._given: autopar.Plan | None = None  # the oracle's plan being measured

    def oracle(self) -> dict[str, Any]:
        """Mode "oracle": each plan of autopar's one-GPU candidate space (Predictor.candidates) measured as wrap
        given it, in turn; the fastest's record, with every candidate's plan, status and step in `grid`."""
        grid: list[dict[str, Any]] = []
        best: dict[str, Any] | None = None
        last: dict[str, Any] = {}
        for plan in self.predictor.candidates(batch_of(self.family, self.opts)):
            last = self._run_given("oracle", plan)
            grid.append({"plan_short": short_name(plan), "status": last["status"], "step_s": last.get("step_s"),
                         "error": last.get("error")})
            if last["status"] == "ok" and (best is None or last["step_s"] < best["step_s"]):
                best = last
        if best is None:
            base = last or self._record("oracle")
            why = "no candidate plan ran" if grid else f"no candidate plans: {self.predictor.error or 'none made'}"
            best = {**base, "status": "error", "error": why}
        return {**best, "grid": grid}

    def tune(self) -> dict[str, Any]:
        """Mode "tune": autopar.autotune's trials (each a fresh model, wrapped with the trial's plan and timed with
        autopar.train_step) over the plain loop's space at the family's batch, then wrap given the study's best plan
        measured as the other modes are; the trials' plans, statuses and steps in `grid`."""
        t0 = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory() as cache:  # the study's plan cache: not the user's
                report = autopar.autotune(lambda: build_on_device(self.family, self.opts),
                                          real_sample(self.family, self.opts), self.family.loss_fn,
                                          trials=self.opts.tune_trials, steps=self.opts.steps,
                                          warmup=self.opts.warmup, loop="plain", cache_directory=cache,
                                          max_autotune=self.opts.tune_max_autotune)
        except Exception as exc:  # recorded like a failed mode; the next mode still runs
            clean(self.opts.device)
            return {**self._record("tune"), "status": "error", "error": first_line(exc),
                    "tune_s": round(time.perf_counter() - t0, 2)}
        clean(self.opts.device)
        tune_s = round(time.perf_counter() - t0, 2)
        grid = [{"plan_short": short_name(r.plan), "status": r.status, "step_s": r.measured_step_s, "error": r.cause}
                for r in report.rows]
        if report.best is None:
            return {**self._record("tune"), "status": "error", "error": "no trial ran", "grid": grid, "tune_s": tune_s}
        rec = self._run_given("tune", dataclasses.replace(report.best, measurement=None))  # its trial is in grid
        return {**rec, "grid": grid, "tune_s": tune_s, "tune_trials": report.trials_run}

    def _record(self, mode: str, **fields: Any) -> dict[str, Any]:
        """What every record of this family and mode starts with: who, what, where."""
        return {"family": self.family.name, "kind": self.family.kind, "mode": mode, "size": self.opts.size,
                "batch": batch_of(self.family, self.opts), **fields, **environment(self.opts)}

    def _run_given(self, mode: str, plan: autopar.Plan) -> dict[str, Any]:
        """Mode `mode` ("oracle", "tune") measured as wrap given `plan`."""
        self._given = plan
        try:
            return self.run(mode)
        finally:
            self._given = None

    def run(self, mode: str) -> dict[str, Any]:
        batch = batch_of(self.family, self.opts)
        rec = self._record(mode, warmup=self.opts.warmup, steps=self.opts.steps)
        skip = self._skip_reason(mode)
        if skip is not None:
            rec.update(status="skipped", error=skip)
            return rec
        clean(self.opts.device)
        rec["host_op_us"] = host_op_us(self.opts.device)  # this lease's host speed (bench._common.host_op_us)
        t0 = time.perf_counter()
        try:
            sample = real_sample(self.family, self.opts)
            model = build_on_device(self.family, self.opts)
            rec["parameters"] = sum(p.numel() for p in model.parameters())
            # dynamo's graphs from here: wrap's race compiles the plan before the steps (its failed compiles too)
            graphs_before = compile_counts()
            if mode in ("wrap", "rewrap", "oracle", "tune", *PLAN_MODES):
                step = self._wrap(model, sample, rec, mode)
            else:
                step = self._hand(model, sample, rec, mode)
            if mode == "rewrap":  # its start-up alone: the steps (and their compile warm-up) are "wrap"'s
                rec.update(status="ok", wall_s=round(time.perf_counter() - t0, 2))
                return rec
            rec.update(time_steps(step, self.opts))
            rec.update({k: v - graphs_before[k] for k, v in compile_counts().items()})
            rec.update(memory(self.opts))
            throughput(rec, batch, tokens_per_sample(sample))
            if self.opts.profile_steps > 0 and self.opts.device == "cuda":
                rec["kernels"] = kernels_of(step, self.opts.profile_steps)
            rec["status"] = "ok"
        except torch.cuda.OutOfMemoryError as exc:
            rec.update(status="oom", error=first_line(exc), **memory(self.opts))
        except autopar.InfeasiblePlanError as exc:  # wrap's refusal: no plan fits (right where the hand modes OOM)
            rec.update(status="refused", error=first_line(exc))
        except Exception as exc:  # recorded; the next mode still runs
            rec.update(status="error", error=first_line(exc))
        finally:
            step = model = sample = None  # dropped before the next mode is built
            clean(self.opts.device)
        rec["wall_s"] = round(time.perf_counter() - t0, 2)  # build, wrap or compile, warm-up and timed steps
        return rec

    def _skip_reason(self, mode: str) -> str | None:
        if mode == "hand_compile" and self.opts.device == "cpu" and not self.opts.compile_on_cpu:
            return "torch.compile is measured on the GPU only (on a CPU it needs a C++ toolchain and minutes)"
        return None

    def _hand(self, model: nn.Module, sample: dict[str, Any], rec: dict[str, Any], mode: str) -> Step:
        if mode == "hand_bf16":  # the weights and the sample's floating tensors in bf16
            model.to(torch.bfloat16)
            rec.update(plan_short="bf16 weights by hand", parameter_dtypes=sorted({str(p.dtype) for p in model.parameters()}))
            opt, rec["optimizer"] = adamw(model, self.opts.lr, fused=True)
            cast = {k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                    for k, v in sample.items()}
            return Step(model, self.family, cast, opt, autocast_device=None)
        plan = mode_plan(mode, rec["batch"])
        if self.opts.hand_predictions:
            rec.update(self.predictor.fields(plan))
        rec["plan_short"] = short_name(plan)
        opt, rec["optimizer"] = adamw(model, self.opts.lr, fused=True)
        runnable = torch.compile(model) if plan.compile else model
        return Step(runnable, self.family, sample, opt,
                    autocast_device=self.opts.device if plan.precision == "bf16" else None)

    def _wrap(self, model: nn.Module, sample: dict[str, Any], rec: dict[str, Any], mode: str) -> Step:
        """wrap's own choice (mode "wrap"), or the plan a plan mode names."""
        given = self._given if mode in ("oracle", "tune") else mode_plan(mode, rec["batch"]) if mode in PLAN_MODES else None
        t0 = time.perf_counter()
        autopar.wrap(model, sample=sample, plan=given, loss_fn=self.family.loss_fn, verbose=False)
        rec["wrap_s"] = round(time.perf_counter() - t0, 3)
        plan = autopar.plan_of(model)
        rec.update(plan=plan.strategy(), plan_short=short_name(plan), plan_text=plan.describe())
        # wrap's own time before the first step, and its compile race (autopar.race), where it ran
        rec["wrap_timing"] = {k: (plan.prediction or {}).get(k) for k in
                              ("planning_s", "planning_phases_s", "measuring_s", "compile_warmup_s", "measured_eager_s", "measured_compiled_s",
                               "cached_at")}
        # the cost model's own figures beside the measured ones wrap's prediction carries (autopar.race)
        rec["wrap_modelled"] = {k: (plan.prediction or {}).get(k) for k in
                                ("modelled_step_s", "modelled_allocated_bytes", "measured_forward_backward_s",
                                 "measured_peak_allocated_bytes", "optimizer_s", "optimizer_state_bytes",
                                 "modelled_memory_bytes", "measured_reserve_bytes", "context_bytes")}
        if plan.prediction:
            rec.update(prediction_fields(dict(plan.prediction), self.predictor.context_bytes),
                       predicted_source="the plan wrap chose (Plan.prediction)")
        else:
            rec.update(self.predictor.fields(plan), predicted_source="autopar.predict on the meta trace")
        if self.opts.hand_predictions:  # the same plan predicted from the meta trace: does the trace agree?
            meta = self.predictor.fields(plan)
            rec["predicted_meta"] = {k: meta.get(k) for k in ("predicted_step_s", "predicted_allocated_bytes",
                                                              "predicted_peak_bytes", "predicted_error")}
        fused = not plan.cpu_offload and all(p.device.type == self.opts.device for p in model.parameters())
        opt, rec["optimizer"] = adamw(model, self.opts.lr, fused=fused)
        return Step(model, self.family, sample, opt, autocast_device=None)


def append(path: Path, rec: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(rec, default=str) + "\n")
        f.flush()


def brief(rec: dict[str, Any]) -> str:
    """One line of progress for the log."""
    parts = [f"{rec['family']:<20} {rec['mode']:<13} {rec['status']:<8}"]
    if rec.get("step_s"):
        parts.append(f"step {rec['step_s'] * 1e3:9.2f} ms")
    if rec.get("predicted_step_s"):
        parts.append(f"pred {rec['predicted_step_s'] * 1e3:9.2f} ms")
    if rec.get("peak_allocated_bytes"):
        parts.append(f"alloc {rec['peak_allocated_bytes'] / GiB:6.2f} GiB")
    if rec.get("plan_short"):
        parts.append(rec["plan_short"])
    if rec.get("error"):
        parts.append(str(rec["error"])[:160])
    return "  ".join(parts)


def run_family(name: str, modes: Iterable[str], opts: Options) -> None:
    """The child's job: the family's modes, one after another in this process, each appended as it ends."""
    family = FAMILIES[name]
    predictor = Predictor(family, opts)
    measurement = Measurement(family, opts, predictor)
    for mode in modes:
        rec = (measurement.oracle() if mode == "oracle" else measurement.tune() if mode == "tune"
               else measurement.run(mode))
        append(opts.out, rec)
        print(brief(rec), flush=True)


# ---- the parent: families, time limits, resuming -------------------------------------------------------
def record_key(rec: dict[str, Any]) -> tuple[Any, ...]:
    return rec["family"], rec["mode"], rec.get("size"), rec.get("batch")


@dataclass(frozen=True)
class Child:
    """What happened to one family's process."""

    returncode: int | None  # None: killed at its time limit
    limit_s: float
    wall_s: float


class Runner:
    """Runs the chosen families, each in its own process, under the call's time budget; records what a
    killed or crashed process did not."""

    def __init__(self, args: argparse.Namespace, opts: Options) -> None:
        self.args, self.opts = args, opts
        self.start = time.perf_counter()
        self.redo = set(args.redo.split(",")) if args.redo else set()
        previous = read_records([opts.out, *map(Path, args.resume or [])])
        self.done = {record_key(r) for r in previous if r.get("status") not in self.redo}
        self.device_name = opts.device  # a child's name for it, once one has run

    def remaining_s(self) -> float:
        return self.args.time_budget_s - (time.perf_counter() - self.start)

    def todo(self, family: Family) -> list[str]:
        batch = batch_of(family, self.opts)
        return [m for m in self.args.modes.split(",") if (family.name, m, self.opts.size, batch) not in self.done]

    def run(self, families: list[Family]) -> dict[str, list[str]]:
        summary: dict[str, list[str]] = {"measured": [], "family_wall_s": [], "already_done": [], "not_reached": [],
                                         "unavailable": []}
        for family in families:
            modes = self.todo(family)
            if not modes:
                summary["already_done"].append(family.name)
                continue
            why = family.unavailable()
            if why is not None:
                self._fill(family, modes, status="unavailable", error=why)
                summary["unavailable"].append(family.name)
                continue
            if self.remaining_s() < self.args.min_family_s:
                summary["not_reached"].append(family.name)
                continue
            child = self._spawn(family, modes)
            self._after(family, modes, child)
            summary["measured"].append(family.name)
            summary["family_wall_s"].append(f"{family.name}={child.wall_s:.0f}")
        return summary

    def _spawn(self, family: Family, modes: list[str]) -> Child:
        limit = max(1.0, min(self.args.family_timeout_s, self.remaining_s()))
        options = json.dumps({**asdict(self.opts), "out": str(self.opts.out)})
        argv = [sys.executable, "-m", "bench.zoo_h200", "--child", family.name, "--modes", ",".join(modes),
                "--child-options", options]
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=Path(__file__).resolve().parents[1], start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            self._kill(proc)
            rc = None
        child = Child(returncode=rc, limit_s=limit, wall_s=time.perf_counter() - t0)
        self.device_name = next((r["device"] for r in reversed(read_records([self.opts.out])) if "parameters" in r),
                                self.device_name)
        return child

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        """The child and what it started (inductor's compile workers): its own process group, by its id."""
        for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                return

    def _after(self, family: Family, modes: list[str], child: Child) -> None:
        batch = batch_of(family, self.opts)
        written = {record_key(r) for r in read_records([self.opts.out])}
        missing = [m for m in modes if (family.name, m, self.opts.size, batch) not in written]
        if not missing:
            return
        if child.returncode is None:
            cut = child.limit_s < self.args.family_timeout_s
            status = "cut" if cut else "timeout"
            error = (f"the call's time budget ended {child.wall_s:.0f} s into this family" if cut else
                     f"the family's process ran past --family-timeout-s {self.args.family_timeout_s:.0f}")
        else:
            status, error = "error", f"the family's process exited with {child.returncode} before recording this mode"
        self._fill(family, missing, status=status, error=error, wall_s=round(child.wall_s, 1))

    def _fill(self, family: Family, modes: list[str], **fields: Any) -> None:
        for mode in modes:
            rec = {"family": family.name, "kind": family.kind, "mode": mode, "size": self.opts.size,
                   "batch": batch_of(family, self.opts), **environment(self.opts, self.device_name), **fields}
            append(self.opts.out, rec)
            print(brief(rec), flush=True)


def choose_families(spec: str) -> list[Family]:
    if spec == "all":
        return list(ZOO)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise SystemExit(f"no zoo family {', '.join(unknown)}; the zoo has {', '.join(FAMILIES)}")
    return [FAMILIES[n] for n in names]


# ---- the command line ----------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.zoo_h200", description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="all", help="comma-separated zoo families, or 'all' (python -m bench.zoo --list)")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", choices=("realistic", "tiny"), default="realistic")
    ap.add_argument("--batch", type=int, default=None, help="samples per step (default: the family's at that size)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="timed steps, at least")
    ap.add_argument("--min-timed-s", type=float, default=1.0,
                    help="more timed steps where --steps last less than this (s): a 20 ms step timed 10 times is 0.2 s "
                         "of a host whose speed drifts")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--time-budget-s", type=float, default=480.0,
                    help="the call's seconds: no family starts after them, and one running then is cut (give it at "
                         "least --family-timeout-s)")
    ap.add_argument("--family-timeout-s", type=float, default=300.0, help="a family's process is killed after this")
    ap.add_argument("--min-family-s", type=float, default=90.0, help="no family starts with less time left than this")
    ap.add_argument("--out", default=None, help="the JSON-lines file (default: $OUT/zoo_h200.jsonl)")
    ap.add_argument("--resume", action="append", help="a JSON-lines file of earlier records: not measured again")
    ap.add_argument("--redo", default=",".join(NOT_MEASURED), help="statuses measured again when resuming")
    ap.add_argument("--no-hand-predictions", action="store_true", help="no meta trace for the hand plans' predictions")
    ap.add_argument("--compile-on-cpu", action="store_true", help="measure hand_compile on a CPU too")
    ap.add_argument("--tune-trials", type=int, default=6, help="mode tune: autopar.autotune's trials")
    ap.add_argument("--tune-max-autotune", action="store_true",
                    help="mode tune: the compiled plans' max-autotune twins (Plan.max_autotune) in the study too")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="after timing, profile this many more steps: GPU kernel time by kind in the record")
    ap.add_argument("--report", nargs="+", default=None, help="print the must-show table of these files and exit")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one family, in this process
    ap.add_argument("--child-options", default=None, help=argparse.SUPPRESS)  # the parent's Options, as JSON
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.report:
        print(report(read_records(map(Path, args.report))))
        return 0
    if args.child:
        given = json.loads(args.child_options)
        run_family(args.child, args.modes.split(","), Options(**{**given, "out": Path(given["out"])}))
        return 0
    out = results_path(args.out, "zoo_h200.jsonl")
    command = " ".join(["python -m bench.zoo_h200", *(sys.argv[1:] if argv is None else argv)])
    opts = Options(device=args.device, size=args.size, batch=args.batch, warmup=args.warmup, steps=args.steps,
                   lr=args.lr, hand_predictions=not args.no_hand_predictions, compile_on_cpu=args.compile_on_cpu,
                   out=out, command=command, profile_steps=args.profile_steps, min_timed_s=args.min_timed_s,
                   tune_trials=args.tune_trials, tune_max_autotune=args.tune_max_autotune)
    bad = [m for m in args.modes.split(",") if m not in MODES]
    if bad:
        raise SystemExit(f"unknown mode {', '.join(bad)}; the modes are {', '.join(MODES)}")
    runner = Runner(args, opts)
    summary = runner.run(choose_families(args.families))
    print(json.dumps({"summary": summary, "out": str(out),
                      "wall_s": round(time.perf_counter() - runner.start, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
