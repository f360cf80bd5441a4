"""What a framework's training run measures of its plan, next to the plan's prediction, and how the
measurement goes back to the cost model. Shared by the framework integrations; imports no framework.

- `StepTimer` times `steps` optimizer steps after `warmup_steps` (the device synchronised at both ends), as
  a tuner's trial does (autopar.tune.worker.StepRecorder).
- `measure` turns the time into a `StepMeasurement`: step time, samples and tokens per second, MFU (the cost
  model's formula) and the peak memory of the most loaded rank (one all_gather of numbers).
- `predicted` is the plan's prediction (the one it carries, else the cost model's for it, now).
- `Comparison.describe` is the one line logged: each measured figure beside its prediction.
- `feed_back` records the measurement as a tuner's trial is recorded: in a small ledger per model, sample
  size and topology (`<cache>/runs/`), one entry per plan measured; from 2 plans measured on, the calibration is
  refitted to them (autopar.tune.refit.StepModel, bounded as a study's refit is) and a refit within bounds is
  saved for this model (autopar.calibration_cache.save_refit), where the next `wrap` or `autopar plan` reads it.
"""

from __future__ import annotations

import hashlib
import json
import math
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
import yaml

from .._util.dist import local_device
from .._util.io import atomic_write_text, cache_subdir, read_private_bytes
from .._util.yaml_text import load_yaml
from ..calibration_cache import save_refit
from ..cost import predict_profile
from ..cost.time import model_flops_per_step
from ..errors import AutoparError, CacheError
from ..plan_cache import sample_signature
from ..planning import calibration_for
from ..plans import Plan
from ..strategies.state import Applied
from ..tune.ledger import Measured
from ..tune.refit import Fit, StepModel

#: The ledger's layout version (a file of another is refused, with the remedy).
LEDGER_VERSION = 1
_LEDGER_FIELD = "autopar_runs"
MAX_LEDGER_BYTES = 1 << 20
#: At most this many plans are kept per ledger (the oldest measured first out).
MAX_LEDGER_PLANS = 64
#: StepMeasurement.memory_source of a CPU run: the process's peak resident memory (all of it, Python included).
PEAK_RSS = "peak RSS"


def _check_count(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise AutoparError(f"{name} must be an integer of at least {low}, got {value!r}.")


@dataclass(frozen=True)
class MeasureOptions:
    """How a run measures its plan: `steps` optimizer steps timed after `warmup_steps`, once per run, and
    whether the measurement is fed back to the cost model (`feed_back`, see `feed_back`)."""

    warmup_steps: int = 3
    steps: int = 10
    feed_back: bool = True

    def __post_init__(self) -> None:
        _check_count("MeasureOptions.warmup_steps", self.warmup_steps, 0)
        _check_count("MeasureOptions.steps", self.steps, 1)
        if not isinstance(self.feed_back, bool):
            raise AutoparError(f"MeasureOptions.feed_back must be True or False, got {self.feed_back!r}.")


@dataclass(frozen=True)
class StepMeasurement:
    """One run's measured steps: the mean step over `steps` steps (the slowest rank's), the rates over all
    ranks, and the peak memory of the most loaded rank (`memory_source` says which peak)."""

    steps: int
    step_s: float
    samples_per_s: float
    tokens_per_s: float | None
    mfu: float
    peak_memory_bytes: int
    memory_source: str  # "cuda max allocated" (device) or PEAK_RSS (the process's, CPU runs)

    def __post_init__(self) -> None:
        _check_count("StepMeasurement.steps", self.steps, 1)
        for name in ("step_s", "samples_per_s", "mfu"):
            value = getattr(self, name)
            if not (isinstance(value, float) and math.isfinite(value) and value >= 0):
                raise AutoparError(f"StepMeasurement.{name} must be a finite number of at least 0, got {value!r}.")
        if not self.step_s > 0:
            raise AutoparError(f"StepMeasurement.step_s must be positive, got {self.step_s!r}.")
        _check_count("StepMeasurement.peak_memory_bytes", self.peak_memory_bytes, 0)

    @property
    def throughput(self) -> float:
        """What a tuner's study maximises: tokens/s for token inputs, else samples/s."""
        return self.tokens_per_s if self.tokens_per_s is not None else self.samples_per_s


@dataclass(frozen=True)
class Comparison:
    """A measurement beside the plan's prediction (`predicted`: Plan.prediction's names, possibly empty)."""

    measured: StepMeasurement
    predicted: Mapping[str, float]

    def describe(self) -> str:
        """One line: each measured figure, with its prediction and their ratio where there is one."""
        m, p = self.measured, self.predicted
        parts = [f"{m.step_s * 1e3:,.1f} ms/step" + _versus(p.get("step_s"), m.step_s, lambda v: f"{v * 1e3:,.1f} ms")]
        if m.tokens_per_s is not None:
            parts.append(f"{m.tokens_per_s:,.0f} tokens/s" + _versus(p.get("tokens_per_s"), m.tokens_per_s,
                                                                    lambda v: f"{v:,.0f}"))
        else:
            parts.append(f"{m.samples_per_s:,.1f} samples/s" + _versus(p.get("samples_per_s"), m.samples_per_s,
                                                                      lambda v: f"{v:,.1f}"))
        parts.append(f"MFU {m.mfu:.1%}" + _versus(p.get("mfu"), m.mfu, lambda v: f"{v:.1%}"))
        if m.memory_source == PEAK_RSS:  # the whole process's memory: no ratio to the training state's prediction
            memory = p.get("memory_bytes")
            parts.append(f"peak RSS {m.peak_memory_bytes / 2**30:.2f} GiB (the whole process"
                         + (f"; predicted training state {memory / 2**30:.2f} GiB)" if memory else ")"))
        else:
            parts.append(f"peak {m.peak_memory_bytes / 2**30:.2f} GiB ({m.memory_source})"
                         + _versus(p.get("memory_bytes"), m.peak_memory_bytes, lambda v: f"{v / 2**30:.2f} GiB"))
        return f"measured over {m.steps} steps: " + ", ".join(parts)

    def metrics(self) -> dict[str, float]:
        """Numbers for a framework's logger: `autopar/<name>` measured and `autopar/predicted_<name>`."""
        m = self.measured
        out = {"autopar/step_s": m.step_s, "autopar/samples_per_s": m.samples_per_s, "autopar/mfu": m.mfu,
               "autopar/peak_memory_bytes": float(m.peak_memory_bytes)}
        if m.tokens_per_s is not None:
            out["autopar/tokens_per_s"] = m.tokens_per_s
        for name in ("step_s", "samples_per_s", "tokens_per_s", "mfu", "memory_bytes"):
            if isinstance(self.predicted.get(name), (int, float)):
                out[f"autopar/predicted_{name}"] = float(self.predicted[name])
        return out


def _versus(predicted: Any, measured: float, show: Any) -> str:
    if not isinstance(predicted, (int, float)) or not predicted > 0:
        return ""
    return f" (predicted {show(predicted)}, measured/predicted {measured / predicted:.2f})"


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepTimer:
    """Counts optimizer steps; `step_done()` after each returns the mean step time once `steps` steps after
    `warmup_steps` have run (once), else None. Every rank calls it at the same steps."""

    def __init__(self, options: MeasureOptions) -> None:
        self.options = options
        self.count = 0
        self.t0: float | None = None
        self.done = False

    def start(self) -> None:
        """Call before the first step (the clock starts here when there is no warm-up)."""
        if self.options.warmup_steps == 0:
            _sync()
            self.t0 = time.perf_counter()

    def step_done(self) -> float | None:
        if self.done:
            return None
        self.count += 1
        if self.count == self.options.warmup_steps:
            _sync()
            self.t0 = time.perf_counter()
            return None
        if self.count < self.options.warmup_steps + self.options.steps or self.t0 is None:
            return None
        _sync()
        self.done = True
        return (time.perf_counter() - self.t0) / self.options.steps


def _peak_bytes() -> tuple[int, str]:
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated()), "cuda max allocated"
    rss = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * (1 if sys.platform == "darwin" else 1024)
    return rss, PEAK_RSS


def _gather(values: list[float]) -> list[list[float]]:
    """Every rank's `values` (one all_gather of numbers; a collective: every rank calls it)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [values]
    device = local_device() if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    return [p.cpu().tolist() for p in parts]


def measure(state: Applied, step_s: float, *, steps: int) -> StepMeasurement:
    """The run's measurement from this rank's mean step (a collective: the slowest rank's step, the most
    loaded rank's peak)."""
    peak, source = _peak_bytes()
    rows = _gather([float(step_s), float(peak)])
    step = max(r[0] for r in rows)
    plan, profile, topo = state.plan, state.profile, state.topology
    samples = plan.global_batch_size / step
    tokens = samples * profile.tokens_per_sample if profile.tokens_per_sample else None
    flops_peak = topo.device.peak_flops("bf16" if topo.device.supports("bf16") else "fp32") * plan.world_size
    mfu = model_flops_per_step(profile, plan) / step / flops_peak if flops_peak > 0 else 0.0
    return StepMeasurement(steps=steps, step_s=float(step), samples_per_s=float(samples),
                           tokens_per_s=None if tokens is None else float(tokens), mfu=float(mfu),
                           peak_memory_bytes=int(max(r[1] for r in rows)), memory_source=source)


def predicted(state: Applied, *, variants: Mapping[str, Any] | None = None) -> dict[str, float]:
    """The plan's prediction: the one it carries (chosen by the cost model, or cached), else the cost model's
    for it now (a given plan); {} for a model whose step could not be traced."""
    carried = {k: float(v) for k, v in (state.plan.prediction or {}).items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if carried.get("step_s") or not state.profile.traced:
        return carried
    cal = calibration_for(state.topology, profile=state.profile)
    return predict_profile(state.profile, state.plan, state.topology, cal, variants=variants).summary()


@dataclass(frozen=True)
class FeedBack:
    """What `feed_back` did: the ledger it wrote, how many plans it holds, the refit (None with fewer than 2
    plans) and where a refit within bounds was saved (None when it was not)."""

    ledger_path: Path
    plans_measured: int
    fit: Fit | None
    refit_path: Path | None

    def describe(self) -> str:
        head = f"recorded in {self.ledger_path} ({self.plans_measured} plan(s) of this model measured here)"
        if self.fit is None:
            return head + "; the calibration is refitted once 2 plans are measured (run another plan, or autopar tune)."
        if self.refit_path is not None:
            err = (f", step-time error {self.fit.error_before:.0%} -> {self.fit.error_after:.0%}"
                   if self.fit.error_before is not None and self.fit.error_after is not None else "")
            return head + f"; calibration refitted to them{err}, saved in {self.refit_path} (the next wrap reads it)."
        why = self.fit.rejection.message() if self.fit.rejection is not None else "no fit predicts them better"
        return head + f"; calibration kept ({why})."


def _ledger_path(state: Applied) -> Path:
    folder = cache_subdir("runs", create=True)
    assert folder is not None
    blob = json.dumps({"model": state.profile.fingerprint, "sample": sample_signature(state.profile)},
                      sort_keys=True).encode()
    return folder / f"{state.topology.fingerprint()}@{hashlib.sha256(blob).hexdigest()[:32]}.yaml"


def _read_ledger(path: Path, state: Applied) -> dict[str, dict[str, Any]]:
    """The ledger's plans by key ({} when there is none); CacheError for a file autopar did not write."""
    raw = read_private_bytes(path, max_bytes=MAX_LEDGER_BYTES, what="run ledger")
    if raw is None:
        return {}
    remedy = "Delete it; the next run writes it again."
    try:
        data = load_yaml(raw.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise CacheError(f"{path} is not a run ledger ({type(exc).__name__}). {remedy}") from None
    expected = {_LEDGER_FIELD: LEDGER_VERSION, "model_fingerprint": state.profile.fingerprint,
                "sample_signature": sample_signature(state.profile),
                "topology_fingerprint": state.topology.fingerprint()}
    if not isinstance(data, Mapping) or any(data.get(k) != v for k, v in expected.items()) or \
            not isinstance(data.get("plans"), Mapping):
        raise CacheError(f"{path} is not this model's run ledger (layout {LEDGER_VERSION}). {remedy}")
    return {str(k): dict(v) for k, v in data["plans"].items() if isinstance(v, Mapping)}


def _records(entries: Mapping[str, Mapping[str, Any]]) -> tuple[dict[str, Plan], list[Measured]]:
    plans, records = {}, []
    for number, (key, entry) in enumerate(entries.items()):
        try:
            plan = Plan.from_dict(entry["plan"])
            step, throughput = float(entry["step_s"]), float(entry["throughput"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CacheError(f"a run ledger entry for plan {key} is not valid ({exc}): delete the ledger.") from None
        plans[key] = plan
        records.append(Measured(key, number, step, throughput))
    return plans, records


def feed_back(state: Applied, measured: StepMeasurement, *, variants: Mapping[str, Any] | None = None) -> FeedBack:
    """Record this run's plan and measurement in this model's run ledger (rank 0 only), and refit the
    calibration to every plan the ledger holds, as a study refits after each trial (the module docstring)."""
    path = _ledger_path(state)
    entries = _read_ledger(path, state)
    key = state.plan.key()
    entries.pop(key, None)  # the latest measurement of a plan replaces the earlier one, and goes last
    entries[key] = {"plan": state.plan.replace(prediction=None, measurement=None).to_dict(),
                    "step_s": measured.step_s, "throughput": measured.throughput}
    while len(entries) > MAX_LEDGER_PLANS:
        entries.pop(next(iter(entries)))
    doc = {_LEDGER_FIELD: LEDGER_VERSION, "model_fingerprint": state.profile.fingerprint,
           "sample_signature": sample_signature(state.profile), "topology_fingerprint": state.topology.fingerprint(),
           "plans": entries}
    atomic_write_text(path, yaml.safe_dump(doc, sort_keys=False), mode=0o600)
    plans, records = _records(entries)
    if len(records) < 2 or not state.profile.traced:
        return FeedBack(ledger_path=path, plans_measured=len(records), fit=None, refit_path=None)
    base = calibration_for(state.topology)  # the topology's, not this model's last refit: refits never compound
    fit = StepModel(state.profile, state.topology, dict(variants or {}), plans, base).refit(records)
    saved = None
    if fit.accepted:
        saved = save_refit(fit.calibration, topology_fingerprint=state.topology.fingerprint(),
                           model_fingerprint=state.profile.fingerprint,
                           sample_signature=sample_signature(state.profile))
    return FeedBack(ledger_path=path, plans_measured=len(records), fit=fit, refit_path=saved)
