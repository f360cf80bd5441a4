"""The report's charts (autopar/tune/plots.py, matplotlib): valid PNGs, points where they belong, and a line that
says how to get matplotlib where it is missing."""

from __future__ import annotations

import sys

import pytest

from autopar.errors import AutoparError
from autopar.plans import Plan
from autopar.tune import plots
from autopar.tune.plots import CHARTS_HINT, charts_hint, measured_vs_predicted, optimisation_history
from autopar.tune.report import TuneReport, TuneRow, write_plots

matplotlib = pytest.importorskip("matplotlib")  # the autopar[report] extra (and the test extra)
image = pytest.importorskip("matplotlib.image")
PIL_Image = pytest.importorskip("PIL.Image")  # installed with matplotlib

BLUE, ORANGE, RED = (31, 119, 180), (255, 127, 14), (214, 39, 40)  # tab:blue, tab:orange, tab:red
GREY = (128, 128, 128)


def _pixels(path):
    """The PNG's pixels as rows of (r, g, b) in 0..255, read back by matplotlib."""
    data = image.imread(str(path))
    assert data.ndim == 3 and data.shape[2] in (3, 4)
    return [[tuple(int(round(float(c) * 255)) for c in px[:3]) for px in row] for row in data]


def _close(a, b, tol=3) -> bool:
    return all(abs(x - y) <= tol for x, y in zip(a, b))


def _near(pixels, col, row, color, radius=1, tol=40) -> bool:
    """Whether a pixel within `radius` of (col, row) is about `color` (lines are antialiased)."""
    return any(_close(pixels[row + dy][col + dx], color, tol)
               for dy in range(-radius, radius + 1) for dx in range(-radius, radius + 1))


def _report() -> TuneReport:
    def row(number, status, *, pred=None, meas=None, step=None, fitted=None):
        return TuneRow(number=number, key=f"k{number}", plan=Plan(micro_batch_size=number + 1), status=status,
                       predicted_throughput=pred, measured_throughput=meas, measured_step_s=step, fitted_step_s=fitted)

    rows = (row(0, "ok", pred=1000.0, meas=1500.0, step=0.2, fitted=0.21), row(1, "oom"),
            row(2, "ok", pred=4000.0, meas=3000.0, step=0.1, fitted=0.095), row(3, "pruned"),
            row(4, "ok", pred=2500.0, meas=2000.0, step=0.15, fitted=0.16))
    return TuneReport(rows=rows, best=None, best_number=2, study_path=None, wall_s=1.0, trials_run=4)


def test_write_plots_writes_two_valid_pngs_with_their_axes(tmp_path):
    paths = write_plots(_report(), tmp_path / "charts", prefix="s")
    assert [p.name for p in paths] == ["s-throughput.png", "s-history.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (len(_pixels(path)), len(_pixels(path)[0])) == (480, 640)
        with PIL_Image.open(path) as png:
            assert png.size == (640, 480) and png.text["autopar-axes"].startswith("x=")
    with PIL_Image.open(paths[0]) as png:  # measured vs predicted: the same range on both axes, from 0
        assert png.text["autopar-axes"].startswith("x=0..") and "y=0.." in png.text["autopar-axes"]
        lo_hi = png.text["autopar-axes"].split()
        assert lo_hi[0][2:] == lo_hi[1][2:]


def test_scatter_points_land_where_expected(tmp_path):
    before = [(100.0, 150.0), (400.0, 300.0)]
    after = [(160.0, 150.0), (290.0, 300.0)]
    chart = measured_vs_predicted([("before", before, "tab:blue"), ("after", after, "tab:orange")],
                                  tmp_path / "t.png", unit="tokens/s")
    pixels = _pixels(chart.path)
    ax = chart.axes
    assert ax.get_xlim() == ax.get_ylim() and ax.get_xlim()[0] == 0 and ax.get_xlim()[1] >= 400
    for pts, color in ((before, BLUE), (after, ORANGE)):
        for x, y in pts:
            col, row = chart.to_pixel(x, y)
            assert _close(pixels[row][col], color)
    # the y = x line, in grey, away from the points and the grid
    top = ax.get_xlim()[1]
    for v in (0.37 * top, 0.83 * top):
        assert _near(pixels, *chart.to_pixel(v, v), GREY)
    # larger values to the right and up
    assert chart.to_pixel(400, 300)[0] > chart.to_pixel(100, 150)[0]
    assert chart.to_pixel(400, 300)[1] < chart.to_pixel(100, 150)[1]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["y = x", "before", "after"]
    assert ax.get_xlabel() == "predicted tokens/s" and ax.get_ylabel() == "measured tokens/s"


def test_history_chart_is_optunas_with_the_failed_trials_marked(tmp_path):
    measured = {0: 1000.0, 1: 800.0, 3: 1500.0, 4: 1200.0}
    chart = optimisation_history(measured, [2], tmp_path / "h.png", unit="tokens/s", trials=6)
    pixels = _pixels(chart.path)
    ax = chart.axes
    assert ax.get_title() == "Optimization History Plot"  # Optuna's chart
    for x in (1, 4):  # the points below the best-so-far line (Optuna draws it over the others)
        col, row = chart.to_pixel(x, measured[x])
        assert _close(pixels[row][col], BLUE)
    points = [sorted(map(tuple, c.get_offsets().tolist())) for c in ax.collections]
    assert sorted(measured.items()) in points and [(2.0, 0.0)] in points
    best = next(line for line in ax.lines if line.get_label() == "Best Value")  # Optuna's best-so-far line
    assert list(best.get_ydata())[:5] == [1000.0, 1000.0, 1000.0, 1500.0, 1500.0]
    assert _near(pixels, *chart.to_pixel(2.0, 0.0), RED, radius=2, tol=10)  # the failed trial's cross
    assert ax.get_ylim()[0] == 0 and ax.get_xlim()[0] < 0 < 5 < ax.get_xlim()[1]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["measured tokens/s", "Best Value", "failed"]


def test_charts_leave_matplotlibs_settings_as_they_were(tmp_path):
    before = dict(matplotlib.rcParams)
    optimisation_history({0: 1.0}, [], tmp_path / "h.png", unit="samples/s")  # Optuna sets the ggplot style
    measured_vs_predicted([("before", [(1.0, 1.0)], "tab:blue")], tmp_path / "t.png", unit="samples/s")
    assert dict(matplotlib.rcParams) == before
    import matplotlib.pyplot as plt

    assert plt.get_fignums() == []  # every figure closed


def test_without_matplotlib_there_are_no_charts_and_a_line_says_how_to_get_them(tmp_path, monkeypatch):
    assert charts_hint() is None
    for name in ["matplotlib"] + [m for m in sys.modules if m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)  # as where the autopar[report] extra is not installed
    assert charts_hint() == CHARTS_HINT and 'pip install -e ".[report]"' in CHARTS_HINT
    with pytest.raises(AutoparError, match=r'pip install -e "\.\[report\]"'):
        write_plots(_report(), tmp_path / "charts")
    assert not (tmp_path / "charts").exists()
    with pytest.raises(ImportError):
        plots.measured_vs_predicted([], tmp_path / "t.png", unit="tokens/s")
