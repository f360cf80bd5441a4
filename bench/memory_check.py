"""Measured GPU memory against autopar's memory model, before and after: re-predicts the runs of result files.

For each run the model is rebuilt at its size on the meta device, traced on this machine (CPU only: autopar.predict
with topology "1xH200"), its plan rebuilt, and the prediction compared with what the GPU measured. "before" is the
prediction the record holds (the model when it was measured), "after" today's. Two record formats:

- bench/zoo_h200.py records (`family`, `mode` hand / hand_compile / wrap): allocated, and reserved + the CUDA
  context (both measured there) against the predicted peak (reserved + context);
- bench/tune_h200.py records (`what` grid / tune, `model`, `plan` as a short name): allocated and reserved (no
  context is measured there: the predicted peak less the calibration's context).

    python -m bench.memory_check bench/results/zoo_h200_2026-12-01.jsonl [bench/results/tune_h200_2026-11-29.jsonl]

Exit status 1 where a run misses issue 10's bounds (allocated within 10%; reserved + context within 10% and never
under-predicted by more than 5%).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

import autopar
from autopar.planning import calibration_for, profile_variants
from bench._common import build, token_batch
from bench.zoo import ZOO, build_model, make_sample

GiB = 2**30
TOPOLOGY = "1xH200"
ALLOC_BOUND, RESERVED_BOUND, RESERVED_UNDER = 0.10, 0.10, 0.05


@dataclass(frozen=True)
class Run:
    """One measured run and what autopar predicts for it, before and after."""

    name: str  # family or model
    plan: str  # the plan's short name
    measured_alloc: float
    measured_reserved: float | None  # reserved + context (zoo) or reserved (tune)
    before_alloc: float | None
    before_reserved: float | None
    after_alloc: float
    after_reserved: float
    with_context: bool

    def errors(self) -> tuple[float | None, float | None, float | None, float | None]:
        return (_err(self.before_alloc, self.measured_alloc), _err(self.after_alloc, self.measured_alloc),
                _err(self.before_reserved, self.measured_reserved), _err(self.after_reserved, self.measured_reserved))

    def misses(self) -> list[str]:
        _, alloc, _, reserved = self.errors()
        out = []
        if alloc is not None and abs(alloc) > ALLOC_BOUND:
            out.append(f"allocated {alloc:+.1%}")
        if reserved is not None and (abs(reserved) > RESERVED_BOUND or reserved < -RESERVED_UNDER):
            out.append(f"reserved {reserved:+.1%}")
        return out


def _err(predicted: float | None, measured: float | None) -> float | None:
    return None if predicted is None or not measured else predicted / measured - 1


class Traces:
    """Profiles (with their precision variants) traced once per model, on first use."""

    def __init__(self) -> None:
        self.topology = autopar.Topology.from_spec(TOPOLOGY)
        self._cache: dict[str, tuple[Any, Any]] = {}

    def get(self, key: str, make: Callable[[], tuple[torch.nn.Module, Any, Any]]) -> tuple[Any, Any]:
        if key not in self._cache:
            model, sample, loss_fn = make()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._cache[key] = profile_variants(model, sample, self.topology, loss_fn=loss_fn, warn=False)
        return self._cache[key]

    def predict(self, key: str, make: Callable, plan: autopar.Plan) -> Any:
        profile, variants = self.get(key, make)
        return autopar.predict(profile, plan, topology=self.topology, variants=variants)


def zoo_run(rec: dict[str, Any], traces: Traces) -> Run | None:
    """A bench/zoo_h200.py record re-predicted (hand and hand_compile: the recipe as a plan; wrap: its plan)."""
    family = next((f for f in ZOO if f.name == rec["family"]), None)
    if family is None or rec.get("status") != "ok" or rec.get("peak_allocated_bytes") is None:
        return None
    batch = rec["batch"]
    if rec["mode"] == "wrap" and isinstance(rec.get("plan"), dict):
        plan = autopar.Plan.from_dict(rec["plan"])
    else:
        plan = autopar.Plan(micro_batch_size=batch, precision="bf16", compile=rec["mode"] == "hand_compile")
    def make() -> tuple[torch.nn.Module, Any, Any]:
        return build_model(family, "realistic"), make_sample(family, "realistic", batch), family.loss_fn

    pred = traces.predict(f"zoo:{family.name}:{batch}", make, plan)
    measured = rec["peak_reserved_bytes"] + rec["context_bytes"] if rec.get("context_bytes") is not None else None
    return Run(name=family.name, plan=f"{rec['mode']}: {autopar.planning.short_name(plan)}",
               measured_alloc=rec["peak_allocated_bytes"], measured_reserved=measured,
               before_alloc=rec.get("predicted_allocated_bytes"), before_reserved=rec.get("predicted_peak_bytes"),
               after_alloc=pred.memory.allocated_bytes, after_reserved=pred.memory.peak_bytes, with_context=True)


_SHORT = re.compile(r"^1gpu mb(?P<mb>\d+)(?: acc(?P<acc>\d+))?(?: ac:(?P<ac>\w+))? (?P<prec>bf16|fp32)(?P<compile> compile)?$")
_OLD_CONTEXT = 0.55 * GiB  # the calibration's context when the tune runs were predicted


def tune_run(rec: dict[str, Any], traces: Traces) -> Run | None:
    """A bench/tune_h200.py record (one GPU) re-predicted; reserved against the predicted peak less the context."""
    m = _SHORT.match(rec.get("plan", ""))
    if rec.get("status") != "ok" or not rec.get("measured_allocated_bytes") or m is None:
        return None
    plan = autopar.Plan(micro_batch_size=int(m["mb"]), grad_accum=int(m["acc"] or 1), precision=m["prec"],
                        checkpointing=m["ac"] or "none", compile=bool(m["compile"]))
    name = rec["model"]

    def make() -> tuple[torch.nn.Module, Any, Any]:
        with torch.device("meta"):
            model = build(name)
        return model, token_batch(name, 1), None

    pred = traces.predict(f"tune:{name}", make, plan)
    context = calibration_for(traces.topology).context_bytes
    before = rec.get("predicted_memory_bytes")
    return Run(name=name, plan=rec["plan"], measured_alloc=rec["measured_allocated_bytes"],
               measured_reserved=rec.get("measured_reserved_bytes"), before_alloc=rec.get("predicted_allocated_bytes"),
               before_reserved=None if before is None else before - _OLD_CONTEXT,
               after_alloc=pred.memory.allocated_bytes, after_reserved=pred.memory.peak_bytes - context,
               with_context=False)


def runs_of(path: Path, traces: Traces) -> tuple[list[Run], list[str]]:
    """The file's runs re-predicted, and a line for each measured run that cannot be predicted here."""
    out, skipped, seen = [], [], set()
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        name = rec.get("family") or rec.get("model")
        key = (name, rec.get("mode"), rec.get("plan") if "what" in rec else None)
        if key in seen:
            continue
        seen.add(key)
        family = next((f for f in ZOO if f.name == rec.get("family")), None)
        why = family.unavailable() if family is not None else None
        if why is not None:
            skipped.append(f"{name} {rec.get('mode')}: not predicted here ({why})")
            continue
        try:
            run = zoo_run(rec, traces) if "family" in rec else tune_run(rec, traces) if "what" in rec else None
        except Exception as exc:  # a model that cannot be traced here (any cause): reported, the others still run
            skipped.append(f"{name} {rec.get('mode')}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
            continue
        if run is not None:
            out.append(run)
    return out, skipped


def table(runs: list[Run], title: str) -> str:
    what = "reserved+ctx" if runs and runs[0].with_context else "reserved"
    lines = [title, f"{'model':12s} {'plan':36s} | {'alloc GiB':>9s} {'before':>14s} {'after':>14s} | "
                    f"{what + ' GiB':>16s} {'before':>14s} {'after':>14s}"]
    for r in runs:
        eb_a, ea_a, eb_r, ea_r = r.errors()
        lines.append(f"{r.name:12s} {r.plan:36s} | {r.measured_alloc / GiB:9.2f} {_cell(r.before_alloc, eb_a)} "
                     f"{_cell(r.after_alloc, ea_a)} | {_gib(r.measured_reserved):>16s} {_cell(r.before_reserved, eb_r)} "
                     f"{_cell(r.after_reserved, ea_r)}" + (f"   MISS: {', '.join(r.misses())}" if r.misses() else ""))
    for label, index in (("allocated", 1), (what, 3)):
        after = [r.errors()[index] for r in runs if r.errors()[index] is not None]
        before = [r.errors()[index - 1] for r in runs if r.errors()[index - 1] is not None]
        if after:
            lines.append(f"  {label}: after max |err| {max(map(abs, after)):.1%}, worst under {min(after):+.1%}"
                         + (f"; before max |err| {max(map(abs, before)):.1%}, worst under {min(before):+.1%}"
                            if before else ""))
    return "\n".join(lines)


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / GiB:.2f}"


def _cell(x: float | None, err: float | None) -> str:
    return f"{'-':>14s}" if x is None else f"{x / GiB:7.2f} ({err:+.0%})".rjust(14)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args(argv)
    traces, missed = Traces(), 0
    for path in args.files:
        runs, skipped = runs_of(path, traces)
        print(table(runs, f"== {path} ({len(runs)} runs; predicted on {TOPOLOGY}, torch {torch.__version__})"))
        for line in skipped:
            print(f"  skipped {line}")
        print()
        missed += sum(1 for r in runs if r.misses())
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
