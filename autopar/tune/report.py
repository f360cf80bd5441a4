"""What a tuning study found: `TuneReport` (one row per trial), read back from the study database alone.

`autopar tune` and `autopar.autotune` end by building this report from the study they ran, and
`autopar report STUDY` builds the same one from the SQLite file later, so the three print the same table.
Everything the report needs is stored in the study itself (autopar.tune.engine writes it): the search
space with each plan's YAML and its prediction (study user attribute `autopar.space`), the calibration at
the start (`autopar.calibration_before`) and the last fit with its predictions of the measured plans
(`autopar.fit`), and, on each trial, the plan's key, the status, the cause and what was measured. The
charts (`write_plots`) need matplotlib, the optional extra autopar[report].

Prediction error is on the step time: predicted / measured - 1 (+20% means the model predicted a step 20%
slower than measured, i.e. a throughput 17% lower). "before" uses the calibration the study started from;
"after" the calibration fitted to every plan measured in the study (autopar.cost.calibration.fit).
Memory compares allocated peaks: the prediction's `allocated_bytes` (what torch.cuda.max_memory_allocated
reports) with the largest peak any rank measured; without a GPU nothing is measured ("-").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..errors import AutoparError
from ..planning import short_name
from ..plans import Plan
from .plots import charts_hint, measured_vs_predicted, optimisation_history
from .schema import (FAILED, PARAM, STUDY_BEST, STUDY_CAL_BEFORE, STUDY_FIT, STUDY_META, STUDY_QUEUE, STUDY_SPACE,
                     STUDY_WALL, trial_key)
from .storage import check_study_file

GiB = 2**30


# The statuses of a row: a trial that ran ("ok", or how it failed: FAILED, the trial runner's "oom", "crash",
# "exit", "timeout"), one pruned on its prediction before it ran, one whose tuner was killed while it ran
# ("stale": its plan is tried again) or stopped by SIGTERM or SIGINT ("interrupted": the same), one still running
# (a report read while the tuner works). The study's attribute names (STUDY_*, PARAM, FAILED) are
# autopar.tune.schema's, importable from here too.
@dataclass(frozen=True)
class TuneRow:
    """One trial of a study (repeats answered from earlier trials are not rows; see TuneReport.repeats)."""

    number: int  # the Optuna trial number
    key: str  # Plan.key()
    plan: Plan
    status: str  # ok, oom, crash, exit, timeout, pruned, stale, interrupted, running
    predicted_step_s: float | None = None  # with the calibration the study started from
    predicted_throughput: float | None = None  # tokens/s (or samples/s: TuneReport.unit)
    predicted_memory_bytes: float | None = None  # peak per GPU: allocated + allocator reserve + context
    predicted_allocated_bytes: float | None = None  # what torch.cuda.max_memory_allocated would report
    measured_step_s: float | None = None
    measured_throughput: float | None = None
    measured_allocated_bytes: float | None = None  # the largest allocated peak over the ranks
    measured_reserved_bytes: float | None = None
    fitted_step_s: float | None = None  # predicted with the calibration fitted at the end
    cause: str | None = None
    wall_s: float | None = None  # seconds the trial took, start-up included
    source: str | None = None  # why it ran: enqueued (predicted rank), sampled, retry of a stale trial

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def error_before(self) -> float | None:
        """Predicted / measured step time - 1, with the calibration the study started from."""
        return _ratio(self.predicted_step_s, self.measured_step_s)

    @property
    def error_after(self) -> float | None:
        """The same with the calibration fitted to the study's measurements."""
        return _ratio(self.fitted_step_s, self.measured_step_s)

    @property
    def short(self) -> str:
        return short_name(self.plan)


def _ratio(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return predicted / measured - 1.0


@dataclass(frozen=True)
class TuneReport:
    """The outcome of a study: every trial, the best measured plan, and how well the cost model predicted."""

    rows: tuple[TuneRow, ...]
    best: Plan | None  # the fastest plan measured (with its measurement), None if none ran ok
    best_number: int | None
    study_path: str | None
    wall_s: float  # seconds: this call's for tune/autotune; every tuner run's together when read back
    trials_run: int  # plans measured in the study (ok or failed), resumed runs included
    unit: str = "tokens/s"  # or "samples/s" for inputs without a sequence
    repeats: int = 0  # trials the sampler proposed for a plan already decided, answered from the study
    calibration_before: Mapping[str, Any] = field(default_factory=dict)
    calibration_after: Mapping[str, Any] = field(default_factory=dict)
    fitted_runs: int = 0  # measurements the last fit used
    fit_accepted: bool = False  # whether the fit predicted the measured steps better than the start (else kept)
    fit_rejected: str | None = None  # why the best-predicting fit was not kept: out of bounds (RefitRejection)
    cached_path: str | None = None  # where the best plan was cached
    plan_out: str | None = None  # where it was written with --plan-out
    stopped: str | None = None  # why the tuner stopped (trial budget, time budget, space exhausted)
    space_size: int = 0  # feasible plans in the search space

    # ---- summaries ---------------------------------------------------------------------------------
    @property
    def measured(self) -> tuple[TuneRow, ...]:
        return tuple(r for r in self.rows if r.ok)

    @property
    def best_row(self) -> TuneRow | None:
        return next((r for r in self.rows if r.number == self.best_number), None)

    def mean_abs_error(self, which: str = "before") -> float | None:
        """Mean |predicted / measured - 1| of the step time over the measured plans ("before" or "after" the fit)."""
        errs = [getattr(r, f"error_{which}") for r in self.measured]
        errs = [abs(e) for e in errs if e is not None]
        return sum(errs) / len(errs) if errs else None

    def count(self, *statuses: str) -> int:
        return sum(1 for r in self.rows if r.status in statuses)

    # ---- the table --------------------------------------------------------------------------------
    def table(self) -> str:
        unit = "tok/s" if self.unit == "tokens/s" else "sa/s"
        width = max([28] + [len(r.short) for r in self.rows])
        head = (f"{'trial':>5}  {'status':<7}  {'plan':<{width}}  {'pred ' + unit:>11}  {'meas ' + unit:>11}  "
                f"{'pred mem':>9}  {'meas mem':>9}  {'err before':>10}  {'err after':>9}")
        lines = [head, "-" * len(head)]
        for r in self.rows:
            star = "*" if r.number == self.best_number else " "
            lines.append(
                f"{r.number:>4}{star}  {r.status:<7}  {r.short:<{width}}  {rate_text(r.predicted_throughput):>11}  "
                f"{rate_text(r.measured_throughput):>11}  {_size(r.predicted_allocated_bytes):>9}  "
                f"{_size(r.measured_allocated_bytes):>9}  {_pct(r.error_before):>10}  {_pct(r.error_after):>9}")
            if r.cause and not r.ok:
                lines.append(f"{'':>7}  {'':<7}  {r.cause.splitlines()[0][:160]}")
        lines.append("")
        best = self.best_row
        if best is not None:
            lines.append(f"best (*): trial {best.number}, {best.short}: {rate_text(best.measured_throughput)} {self.unit} "
                         f"measured, {_ms(best.measured_step_s)} a step (predicted {rate_text(best.predicted_throughput)} "
                         f"{self.unit} before the fit)")
        else:
            lines.append("best: no plan ran to the end")
        before, after = self.mean_abs_error("before"), self.mean_abs_error("after")
        if before is not None:
            if not self.fitted_runs or after is None:
                fit = "no fit yet (it needs 2 measured plans)"
            elif self.fit_accepted:
                fit = f"{_pct(after, signed=False)} after the fit to {self.fitted_runs} measurements"
            elif self.fit_rejected:
                fit = f"{_pct(after, signed=False)} after: the starting calibration was kept ({self.fit_rejected})"
            else:
                fit = (f"{_pct(after, signed=False)} after: the fit to {self.fitted_runs} measurements predicted "
                       "them no better, so the starting calibration was kept")
            lines.append(f"step-time prediction error, mean |predicted/measured - 1| over {len(self.measured)} "
                         f"measured plan(s): {_pct(before, signed=False)} before, {fit}")
            changed = _changed_factors(self.calibration_before, self.calibration_after)
            if changed:
                lines.append("calibration: " + ", ".join(changed))
        failed = self.count(*FAILED)
        lines.append(
            f"trials: {self.trials_run} measured ({self.count('ok')} ok, {failed} failed), {self.count('pruned')} "
            f"pruned on prediction, {self.count('stale', 'interrupted')} stale (tuner stopped; plan retried), "
            f"{self.repeats} repeat(s) answered from the study; {self.space_size} feasible plans in the space")
        where = f"study {self.study_path}" if self.study_path else "study in memory"
        tail = f"; stopped: {self.stopped}" if self.stopped else ""
        lines.append(f"{where}; {self.wall_s:.1f} s{tail}")
        if self.cached_path:
            lines.append(f"best plan cached at {self.cached_path}")
        if self.plan_out:
            lines.append(f"best plan written to {self.plan_out}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _changed_factors(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    out = []
    for name in ("matmul_efficiency", "fp32_matmul_efficiency", "memory_efficiency", "launch_s"):
        a, b = before.get(name), after.get(name)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not math.isclose(a, b, rel_tol=1e-9):
            lines = f"{name} {a:.3g} -> {b:.3g}"
            out.append(lines)
    return out


def rate_text(value: float | None) -> str:
    """A throughput as the report and the progress lines print it ("-" when unknown)."""
    if value is None:
        return "-"
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:,.1f}" if value >= 10 else f"{value:.2f}"


def _size(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= GiB / 2:
        return f"{value / GiB:.2f} GiB"
    return f"{value / 2**20:.1f} MiB"


def _pct(value: float | None, *, signed: bool = True) -> str:
    if value is None:
        return "-"
    return f"{value:+.0%}" if signed else f"{value:.0%}"


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.2f} s"


# ---------------------------------------------------------------------------------------------------
# Reading a study
# ---------------------------------------------------------------------------------------------------
def _plan_of(entry: Mapping[str, Any]) -> Plan:
    return Plan.from_yaml(entry["plan"], source="the study's search space")


def report_from_study(study: Any, *, study_path: str | None = None, wall_s: float | None = None,
                      stopped: str | None = None) -> TuneReport:
    """The report of an Optuna study autopar made (autopar.tune.engine), from its stored attributes only; it
    reads every study format (autopar.tune.schema)."""
    from optuna.trial import TrialState  # lazy: optuna loads when a study is read, not on `import autopar`

    attrs = study.user_attrs
    if STUDY_SPACE not in attrs:
        raise AutoparError(f"{study_path or 'this study'} is not an autopar study (no search space recorded in it).")
    meta = attrs.get(STUDY_META, {})
    space = {e["key"]: e for e in attrs[STUDY_SPACE]}
    keys_by_name = {e["name"]: k for k, e in space.items() if e.get("name")}
    fit = attrs.get(STUDY_FIT) or {}
    fitted = fit.get("step_s", {}) if fit.get("runs", 0) >= 2 else {}
    rows: list[TuneRow] = []
    repeats = 0
    for t in study.get_trials(deepcopy=False):
        if t.state == TrialState.WAITING:
            continue
        ua = t.user_attrs
        if ua.get("repeat_of") is not None:
            repeats += 1
            continue
        key = trial_key(t.params, ua, keys_by_name)
        if key not in space:
            continue
        entry = space[key]
        pred = entry.get("predicted", {})
        measured = ua.get("measured") or {}
        if t.state == TrialState.RUNNING:
            status = "running"
        elif t.state == TrialState.COMPLETE:
            status = "ok"
        elif t.state == TrialState.PRUNED:
            status = "pruned"
        else:
            status = ua.get("status") or "crash"
        ok = status == "ok"
        rows.append(TuneRow(
            number=t.number, key=key, plan=_plan_of(entry), status=status,
            predicted_step_s=pred.get("step_s"), predicted_throughput=pred.get("throughput"),
            predicted_memory_bytes=pred.get("memory_bytes"), predicted_allocated_bytes=pred.get("allocated_bytes"),
            measured_step_s=measured.get("step_s") if ok else None,
            measured_throughput=(t.value if ok else None),
            measured_allocated_bytes=measured.get("peak_allocated_bytes"),
            measured_reserved_bytes=measured.get("peak_reserved_bytes"),
            fitted_step_s=fitted.get(key) if ok else None,
            cause=ua.get("cause"), wall_s=measured.get("wall_s"), source=ua.get("source")))
    ok_rows = [r for r in rows if r.ok and r.measured_throughput is not None]
    best_row = max(ok_rows, key=lambda r: r.measured_throughput) if ok_rows else None
    best = None
    if best_row is not None:
        best = best_row.plan.replace(measurement=_measurement_of(best_row, meta))
    stored_best = attrs.get(STUDY_BEST) or {}
    if stored_best.get("key") != (best_row.key if best_row else None):
        stored_best = {}
    return TuneReport(
        rows=tuple(rows), best=best, best_number=best_row.number if best_row else None,
        study_path=study_path, wall_s=float(attrs.get(STUDY_WALL, 0.0) if wall_s is None else wall_s),
        trials_run=sum(1 for r in rows if r.ok or r.status in FAILED), unit=meta.get("unit", "tokens/s"),
        repeats=repeats, calibration_before=dict(attrs.get(STUDY_CAL_BEFORE) or {}),
        calibration_after=dict(fit.get("calibration") or attrs.get(STUDY_CAL_BEFORE) or {}),
        fitted_runs=int(fit.get("runs", 0)) if fit.get("runs", 0) >= 2 else 0, fit_accepted=bool(fit.get("accepted")),
        fit_rejected=fit.get("rejected"),
        cached_path=stored_best.get("cached"), plan_out=stored_best.get("plan_out"), stopped=stopped,
        space_size=len(space))


def _measurement_of(row: TuneRow, meta: Mapping[str, Any]) -> dict[str, Any]:
    """The numbers stored with the best plan (Plan.measurement, the plan cache): plain floats and strings."""
    out: dict[str, Any] = {"step_s": float(row.measured_step_s or 0.0)}
    key = "tokens_per_s" if meta.get("unit", "tokens/s") == "tokens/s" else "samples_per_s"
    if row.measured_throughput is not None:
        out[key] = float(row.measured_throughput)
    if row.measured_allocated_bytes is not None:
        out["peak_allocated_bytes"] = float(row.measured_allocated_bytes)
    if row.measured_reserved_bytes is not None:
        out["peak_reserved_bytes"] = float(row.measured_reserved_bytes)
    out["source"] = f"autopar tune, trial {row.number}"
    return out


def open_study(path: str | Path) -> Any:
    """An autopar study's SQLite file, opened for reading (it must exist: nothing is created)."""
    import optuna  # lazy: optuna loads when a study is read, not on `import autopar`

    path = Path(path)
    if not path.is_file():
        raise AutoparError(f"{path} does not exist: give the --study file that autopar tune wrote.")
    check_study_file(path)  # not SQLite, or damaged: refused in one line naming it
    try:
        storage = optuna.storages.RDBStorage(f"sqlite:///{path.resolve()}", skip_table_creation=True)
        names = storage.get_all_studies()
        if len(names) != 1:
            raise AutoparError(f"{path} holds {len(names)} studies; an autopar study file holds one.")
        return optuna.load_study(study_name=names[0].study_name, storage=storage)
    except AutoparError:
        raise
    except Exception as exc:  # noqa: BLE001 - say which file, in a sentence
        raise AutoparError(f"{path} holds no single Optuna study autopar can read ({exc}).") from None


def load_report(path: str | Path) -> TuneReport:
    """`autopar report STUDY`: the report of a study file."""
    return report_from_study(open_study(path), study_path=str(path))


# ---------------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------------
def write_plots(report: TuneReport, out_dir: str | Path, *, prefix: str = "autopar") -> list[Path]:
    """Two PNGs (autopar.tune.plots, with matplotlib: the extra autopar[report]): `<prefix>-throughput.png`,
    measured vs predicted throughput per measured trial (blue: the calibration at the start, orange: after
    the fit; the grey line is y = x), and `<prefix>-history.png`, Optuna's optimization history (each
    trial's measured throughput, in trial order, and the best so far; red crosses on the x axis: failed
    trials). Returns their paths. Without matplotlib it raises AutoparError with the line `charts_hint()`
    returns (pip install -e ".[report]"), having written nothing."""
    hint = charts_hint()
    if hint is not None:
        raise AutoparError(hint)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    before = [(r.predicted_throughput, r.measured_throughput) for r in report.measured
              if r.predicted_throughput and r.measured_throughput]
    after = [(r.measured_throughput * r.measured_step_s / r.fitted_step_s, r.measured_throughput)
             for r in report.measured if r.fitted_step_s and r.measured_throughput and r.measured_step_s]
    throughput = measured_vs_predicted([("before fit", before, "tab:blue"), ("after fit", after, "tab:orange")],
                                       out / f"{prefix}-throughput.png", unit=report.unit)
    measured = {r.number: r.measured_throughput for r in report.rows if r.ok and r.measured_throughput is not None}
    failed = [r.number for r in report.rows if r.status in FAILED]
    last = max((r.number for r in report.rows), default=-1)
    history = optimisation_history(measured, failed, out / f"{prefix}-history.png", unit=report.unit,
                                   trials=last + 1)
    return [throughput.path, history.path]


__all__ = ["FAILED", "PARAM", "STUDY_BEST", "STUDY_CAL_BEFORE", "STUDY_FIT", "STUDY_META", "STUDY_QUEUE",
           "STUDY_SPACE", "STUDY_WALL", "TuneReport", "TuneRow", "charts_hint", "load_report", "open_study",
           "report_from_study", "write_plots"]
