"""The two charts of `autopar report`, drawn with matplotlib (the optional extra: pip install -e ".[report]" in
autopar's clone).

- `measured_vs_predicted`: one point per measured trial, measured against predicted throughput, for each
  series (the calibration at the start, after the fit), with the line y = x; both axes from 0.
- `optimisation_history`: Optuna's own optimization-history chart
  (optuna.visualization.matplotlib.plot_optimization_history: each measured trial's throughput and the
  best so far), with red crosses on the x axis for the trials that failed.

Both are written as 640 x 480 PNGs with the Agg backend (a notebook that already imported pyplot keeps
its own), and each PNG carries its axes' ranges in a tEXt chunk ("autopar-axes": "x=LO..HI y=LO..HI").
matplotlib is imported only when a chart is drawn; without it, `charts_hint()` says how to get it.

    chart = measured_vs_predicted([("before fit", [(1000.0, 1200.0)], "tab:blue")], "t.png", unit="tokens/s")
    chart.to_pixel(1000.0, 1200.0)   # (column, row) of that point's centre in the PNG
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

#: What `autopar report` says instead of drawing when matplotlib is missing.
CHARTS_HINT = 'no charts: they need matplotlib, an optional extra: pip install -e ".[report]" in autopar\'s clone'
WIDTH_IN, HEIGHT_IN, DPI = 6.4, 4.8, 100  # 640 x 480 pixels
Series = tuple[str, Sequence[tuple[float, float]], str]  # label, [(x, y)], a matplotlib colour


def charts_hint() -> str | None:
    """None when the charts can be drawn; else the line that says how to get matplotlib."""
    try:
        import matplotlib  # noqa: F401 - optional: the autopar[report] extra
    except ImportError:
        return CHARTS_HINT
    return None


@dataclass(frozen=True)
class Chart:
    """A chart written to `path`, with the matplotlib Axes that map its data to the PNG's pixels."""

    path: Path
    axes: Any  # matplotlib.axes.Axes
    width_px: int
    height_px: int

    def to_pixel(self, x: float, y: float) -> tuple[int, int]:
        """The (column, row) of the data point (x, y) in the PNG, row 0 at the top."""
        px, py = self.axes.transData.transform((x, y))
        return int(round(px)), int(round(self.height_px - py))

    def describe(self) -> str:
        (x0, x1), (y0, y1) = self.axes.get_xlim(), self.axes.get_ylim()
        return f"x={x0:.6g}..{x1:.6g} y={y0:.6g}..{y1:.6g}"


def _pyplot() -> Any:
    """matplotlib.pyplot, on the Agg backend unless pyplot was already imported (a notebook keeps its own)."""
    import matplotlib  # optional: the autopar[report] extra

    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, ax: Any, path: str | Path, title: str) -> Chart:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.set_size_inches(WIDTH_IN, HEIGHT_IN)
    fig.set_dpi(DPI)
    fig.canvas.draw()  # the layout, so that the axes' ranges below are the ones drawn
    chart = Chart(path, ax, int(WIDTH_IN * DPI), int(HEIGHT_IN * DPI))
    fig.savefig(path, dpi=DPI, format="png", metadata={"autopar-axes": chart.describe(), "Title": title})
    return chart


def measured_vs_predicted(series: Sequence[Series], path: str | Path, *, unit: str) -> Chart:
    """Points of each series (label, [(predicted, measured)], colour) on one range from 0 on both axes, with
    the line y = x in grey (points above it ran faster than predicted)."""
    plt = _pyplot()
    values = [v for _, points, _ in series for p in points for v in p]
    top = max(values) * 1.06 if values else 1.0
    with plt.style.context("default"):
        fig, ax = plt.subplots(figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI, layout="tight")
        try:
            ax.plot([0.0, top], [0.0, top], color="grey", linewidth=1, label="y = x", zorder=1)
            for label, points, color in series:
                if points:
                    ax.scatter([x for x, _ in points], [y for _, y in points], color=color, label=label, zorder=3)
            ax.set_xlim(0.0, top)
            ax.set_ylim(0.0, top)
            ax.set_xlabel(f"predicted {unit}")
            ax.set_ylabel(f"measured {unit}")
            ax.grid(True, color="0.9")
            ax.legend(loc="upper left")
            title = f"Measured vs predicted {unit}"
            ax.set_title(title)
            return _save(fig, ax, path, title)
        finally:
            plt.close(fig)


@contextlib.contextmanager
def _quiet_optuna() -> Iterator[None]:
    """Optuna, without its experimental-feature warning and its log lines (a new study in memory, an empty
    history)."""
    import optuna  # lazy: optuna loads when a chart is drawn, not on `import autopar`

    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            yield
    finally:
        optuna.logging.set_verbosity(verbosity)


def _history_study(measured: Mapping[int, float], trials: int) -> Any:
    """An in-memory Optuna study with one trial per trial number 0..trials-1: COMPLETE with its measured value
    where it has one, else FAIL (failed, pruned, stale, or a repeat), so that the numbers are the study's."""
    import optuna  # lazy: as in _quiet_optuna
    from optuna.study import StudyDirection
    from optuna.trial import TrialState, create_trial

    storage = optuna.storages.InMemoryStorage()
    storage.create_new_study(directions=[StudyDirection.MAXIMIZE], study_name="autopar-report")
    study = optuna.load_study(study_name="autopar-report", storage=storage)
    study.add_trials([create_trial(state=TrialState.COMPLETE, value=float(measured[n])) if n in measured
                      else create_trial(state=TrialState.FAIL) for n in range(trials)])
    return study


def optimisation_history(measured: Mapping[int, float], failed: Sequence[int], path: str | Path, *, unit: str,
                         trials: int | None = None) -> Chart:
    """Optuna's optimization history of the measured throughputs (trial number -> value; the best so far as
    a line) over trial numbers 0..`trials`-1 (default: up to the last one given), from 0 on the y axis, with
    a red cross on the x axis for each trial in `failed`."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator  # optional: the autopar[report] extra
    from optuna.visualization.matplotlib import plot_optimization_history

    count = trials if trials is not None else max([*measured, *failed], default=-1) + 1
    with plt.rc_context(), _quiet_optuna():  # Optuna sets the ggplot style: kept to this chart
        ax = plot_optimization_history(_history_study(measured, count), target_name=f"measured {unit}")
        fig = ax.figure
        try:
            ax.set_ylim(bottom=0.0)
            if failed:
                ax.scatter(list(failed), [0.0] * len(failed), marker="x", color="tab:red", s=60, linewidths=2,
                           label="failed", clip_on=False, zorder=4)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlim(-0.5, max(count - 0.5, 0.5))
            ax.legend(loc="best")
            return _save(fig, ax, path, ax.get_title())
        finally:
            plt.close(fig)
