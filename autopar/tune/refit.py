"""The calibration refit of a study: the time model fitted to every plan measured, and whether it is trusted
enough to prune on.

autopar.cost.calibration.fit is a linear least-squares fit of the time terms at the calibration it is
given (matmul, memory-bound, launch), while the model is not linear in its factors (launch time hides
behind GPU work, a pipeline's bubble grows with the stage's compute but counts as fixed, efficiencies are
capped at 1), and with few runs its three factors are barely determined. So the candidates are: one common
scale of every rate (a 1-D search of the step-time error: well determined from one run), and `fit`
repeated from the start and from that scale, each round re-linearised at the last (like Gauss-Newton),
`FIT_ROUNDS` rounds. The calibration kept is whichever of the start and the candidates predicts the
measured steps best (mean |predicted / measured - 1|): a fit never makes the predictions worse.

Only a candidate within bounds is kept (autopar.cost.calibration.check_refit): no factor more than
MAX_REFIT_RATIO from the start, no efficiency above a GPU's datasheet peak, and the measured steps predicted
within MAX_REFIT_RESIDUAL. Where a candidate predicts better but none is within them, the start is kept and
the Fit says why (`rejection`, one line naming the factor, its fitted value, the bound and the likely cause).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..cost.calibration import Calibration, RefitRejection, check_refit, fit
from ..cost.time import time_terms
from ..plans import Plan
from .ledger import Measured

#: Rounds of the calibration fit (each re-linearised at the previous result); the best one is kept.
FIT_ROUNDS = 3
#: Pruning starts once this many plans have been measured (the correction needs measurements).
PRUNE_AFTER = 2
#: ... and only while the fitted predictions, corrected by the median measured/predicted ratio, are within this
#: share of every measured plan's step time (a model that mispredicts this hardware prunes nothing).
PRUNE_TRUST = 0.25
#: The common scale of the rates is searched in [1/SCALE_RANGE, SCALE_RANGE].
SCALE_RANGE = 64.0


@dataclass(frozen=True)
class Fit:
    """The calibration kept after a refit, and what it predicts of the measured plans."""

    calibration: Calibration  # the starting one when no candidate predicted better
    accepted: bool  # whether it is a fitted one (not the start)
    runs: int  # measured plans it was fitted to
    error_before: float | None  # mean |predicted / measured - 1| with the starting calibration
    error_after: float | None  # the same with `calibration`
    step_s: Mapping[str, float]  # each measured plan's predicted step with `calibration`, by key
    ratio: float = 1.0  # median measured / predicted step with `calibration`
    trusted: bool = False  # whether pruning may use the predictions (PRUNE_AFTER, PRUNE_TRUST)
    rejection: RefitRejection | None = None  # why the best-predicting candidate was not kept (out of bounds)

    def to_attr(self) -> dict[str, Any]:
        """The study attribute `autopar.fit`."""
        return {"calibration": self.calibration.to_dict(), "runs": self.runs, "accepted": self.accepted,
                "error_before": self.error_before, "error_after": self.error_after, "step_s": dict(self.step_s),
                "rejected": self.rejection.message() if self.rejection is not None else None}


class StepModel:
    """The time model of one study's job: a plan's predicted step at a calibration, and the refit."""

    def __init__(self, profile: Any, topology: Any, variants: Mapping[str, Any], plans: Mapping[str, Plan],
                 base: Calibration) -> None:
        self.profile, self.topology, self.variants, self.plans, self.base = profile, topology, variants, plans, base

    def predict_step(self, plan: Plan, cal: Calibration) -> float:
        return float(time_terms(self.profile, plan, self.topology, cal, variants=self.variants)[0].step_s)

    def unfitted(self) -> Fit:
        return Fit(calibration=self.base, accepted=False, runs=0, error_before=None, error_after=None, step_s={})

    def refit(self, records: Sequence[Measured]) -> Fit:
        """The best calibration for `records` within bounds (the module docstring), from the starting one."""
        if not records:
            return self.unfitted()
        base_err, base_steps = self._error(self.base, records)
        better = sorted((c for c in self._candidates(records) if c[0] < base_err), key=lambda c: c[0])
        checked = [(c, check_refit(self.base, c[2], runs=len(records), residual=c[0], is_gpu=self.topology.is_gpu))
                   for c in better]
        kept = next((c for c, why in checked if why is None), None)
        rejection = checked[0][1] if kept is None and checked else None
        err, steps, cal = kept if kept is not None else (base_err, base_steps, self.base)
        accepted = kept is not None
        if accepted:
            cal = cal.replace(fitted_runs=self.base.fitted_runs + len(records),
                              source=f"fitted to {len(records)} measured steps (autopar tune)")
        # Pruning trusts the predictions only where, corrected by the median measured/predicted ratio, they
        # predict every measured plan within PRUNE_TRUST.
        ratio = statistics.median(r.step_s / steps[r.key] for r in records)
        trusted = len(records) >= PRUNE_AFTER and all(
            abs(steps[r.key] * ratio / r.step_s - 1) <= PRUNE_TRUST for r in records)
        return Fit(calibration=cal, accepted=accepted, runs=len(records), error_before=base_err, error_after=err,
                   step_s=steps, ratio=ratio, trusted=trusted, rejection=rejection)

    def _candidates(self, records: Sequence[Measured]) -> list[tuple[float, dict[str, float], Calibration]]:
        """(error, predicted steps, calibration) of each candidate: none from fewer than 2 measured plans."""
        if len(records) < 2:
            return []
        scaled = self._scaled(self.base, self._best_scale(records))
        cals = (scaled, *self._linearised(self.base, records), *self._linearised(scaled, records))
        return [(*self._error(cal, records), cal) for cal in cals]

    def prune_reason(self, plan: Plan, fitted: Fit, best_step_s: float, factor: float) -> str | None:
        """Why `plan` is clearly slower than the best measured step (docs/tuning.md, point 6), or None."""
        if not fitted.trusted:
            return None
        estimate = self.predict_step(plan, fitted.calibration) * fitted.ratio
        if estimate > factor * best_step_s:
            return (f"pruned: predicted {estimate * 1e3:.1f} ms a step (fitted, corrected by the measured ratio), "
                    f"{estimate / best_step_s:.2f}x the best measured {best_step_s * 1e3:.1f} ms (> {factor:g}x)")
        return None

    # ---- the candidates ----------------------------------------------------------------------------------
    def _error(self, cal: Calibration, records: Sequence[Measured]) -> tuple[float, dict[str, float]]:
        steps = {r.key: self.predict_step(self.plans[r.key], cal) for r in records}
        return sum(abs(steps[r.key] / r.step_s - 1) for r in records) / len(records), steps

    def _scaled(self, cal: Calibration, s: float) -> Calibration:
        """`cal` with every rate it fits scaled by `s` (s < 1: the hardware is slower than assumed); capped at
        1 on GPUs, whose datasheet peaks are upper bounds, not on CPUs, whose figures are nominal."""
        cap = 1.0 if self.topology.is_gpu else math.inf
        return cal.replace(matmul_efficiency=min(cap, cal.matmul_efficiency * s),
                           fp32_matmul_efficiency=min(cap, cal.fp32_matmul_efficiency * s),
                           memory_efficiency=min(cap, cal.memory_efficiency * s), launch_s=cal.launch_s / s,
                           backward_launch_s=cal.backward_launch_s / s)

    def _best_scale(self, records: Sequence[Measured]) -> float:
        """One common scale of the rates: a golden-section search of log(s) in [1/SCALE_RANGE, SCALE_RANGE]."""
        def err(log_s: float) -> float:
            return self._error(self._scaled(self.base, math.exp(log_s)), records)[0]

        lo, hi, g = -math.log(SCALE_RANGE), math.log(SCALE_RANGE), (math.sqrt(5) - 1) / 2
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        fa, fb = err(a), err(b)
        while hi - lo > 0.01:
            if fa < fb:
                hi, b, fb = b, a, fa
                a = hi - g * (hi - lo)
                fa = err(a)
            else:
                lo, a, fa = a, b, fb
                b = lo + g * (hi - lo)
                fb = err(b)
        return math.exp((lo + hi) / 2)

    def _linearised(self, start: Calibration, records: Sequence[Measured]) -> list[Calibration]:
        """`fit` from `start`, each round re-linearised at the last result: up to FIT_ROUNDS calibrations."""
        out, cal = [], start
        for _ in range(FIT_ROUNDS):
            runs = [(time_terms(self.profile, self.plans[r.key], self.topology, cal, variants=self.variants)[1],
                     r.step_s) for r in records]
            new = fit(cal, runs)
            if new is cal:
                break
            out.append(new)
            cal = new
        return out
