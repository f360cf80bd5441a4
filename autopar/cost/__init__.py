"""The cost model: per-GPU memory and step time of a plan, before running it.

    pred = autopar.predict(model_or_profile, plan, sample=batch, topology=topo)
    pred.memory.peak_bytes, pred.time.step_s, pred.tokens_per_s, pred.mfu

`memory.py` and `time.py` hold the terms (each with its meaning, unit and source), `calibration.py` the
measured factors, `exact.py` the exact memory check (one traced step under FakeTensorMode).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..plans import Plan
from ..profile import ModelProfile
from ..topology import Topology
from .calibration import Calibration
from .memory import MemoryPrediction, predict_memory
from .time import TimePrediction, model_flops_per_step, time_terms


@dataclass(frozen=True)
class Prediction:
    """What a plan is predicted to cost on its most loaded GPU."""

    plan: Plan
    memory: MemoryPrediction
    time: TimePrediction
    tokens_per_s: float | None  # global tokens per second (None for inputs without a sequence)
    samples_per_s: float
    mfu: float  # model FLOPs utilisation: 6 N + 12 L h s per token over the world's bf16 peak
    calibration_source: str = ""  # where the calibration's factors come from (Calibration.source: a cached file's path)

    @property
    def memory_bytes(self) -> float:
        return self.memory.peak_bytes

    @property
    def step_s(self) -> float:
        return self.time.step_s

    def summary(self) -> dict[str, float]:
        """The numbers a Plan records as its prediction (plain floats)."""
        out = {"memory_bytes": float(self.memory.peak_bytes), "allocated_bytes": float(self.memory.allocated_bytes),
               "step_s": float(self.time.step_s), "samples_per_s": float(self.samples_per_s),
               "mfu": float(self.mfu),
               # the optimizer step and CPU offload's copies: the part of a step a forward + backward measured on
               # the device leaves out (autopar.api's compile race)
               "optimizer_s": float(self.time.optimizer_s + self.time.offload_s),
               # the optimizer's state: what a forward + backward measured on the device holds less than training
               "optimizer_state_bytes": float(self.memory.optimizer_bytes),
               # the CUDA context, inside memory_bytes: what a reserve measured on the device leaves out
               "context_bytes": float(self.memory.context_bytes)}
        if self.tokens_per_s is not None:
            out["tokens_per_s"] = float(self.tokens_per_s)
        return out


def predict_profile(profile: ModelProfile, plan: Plan, topology: Topology, calibration: Calibration | None = None,
                    *, variants: Mapping[str, ModelProfile] | None = None,
                    memory: MemoryPrediction | None = None) -> Prediction:
    """Predict `plan` for a profiled model (fp32 trace) on `topology`. `variants` holds the same model traced
    in other precisions ("bf16": autocast, "bf16-pure": bf16 weights as under FSDP) for bf16 plans.
    `memory`: the plan's memory prediction when the caller has it already (the search predicts memory first)."""
    cal = calibration or Calibration()
    if memory is None:
        memory = predict_memory(profile, plan, cal, variants=variants)
    time, _ = time_terms(profile, plan, topology, cal, variants=variants)
    step = time.step_s
    samples = plan.global_batch_size / step
    tokens = samples * profile.tokens_per_sample if profile.tokens_per_sample else None
    peak = topology.device.peak_flops("bf16" if topology.device.supports("bf16") else "fp32") * plan.world_size
    mfu = model_flops_per_step(profile, plan) / step / peak
    return Prediction(plan=plan, memory=memory, time=time, tokens_per_s=tokens, samples_per_s=samples, mfu=mfu,
                      calibration_source=cal.source)


__all__ = ["Calibration", "MemoryPrediction", "Prediction", "TimePrediction", "predict_profile"]
