"""autopar._util.progress: a phase that takes long says what it does while it runs, and its time; a short one
says nothing (issue 33, item 4)."""

from __future__ import annotations

import logging
import time

import pytest
import torch
import torch.nn as nn

import autopar
import autopar._util.progress as progress
from autopar._util.log import get_logger


@pytest.fixture()
def lines(monkeypatch):
    monkeypatch.setattr(progress, "AFTER_S", 0.05)
    monkeypatch.setattr(progress, "EVERY_S", 0.1)
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Keep()
    logger = get_logger()
    logger.addHandler(handler)
    yield seen
    logger.removeHandler(handler)


def test_a_long_phase_says_what_it_does_while_it_runs_and_its_time_at_the_end(lines):
    with progress.phase("tracing a step"):
        time.sleep(0.4)
    assert lines[0].startswith("tracing a step... (") and lines[0].endswith(" s so far)")
    assert len(lines) >= 3  # announced, then again every EVERY_S
    assert lines[-1].startswith("tracing a step: done in ") and lines[-1].endswith(" s")


def test_a_short_phase_a_silent_one_and_a_failed_one_say_nothing_more(lines):
    with progress.phase("quick"):
        pass
    with progress.phase("quiet", say=False):
        time.sleep(0.2)
    with pytest.raises(ValueError):
        with progress.phase("failing"):
            time.sleep(0.1)
            raise ValueError("no")
    assert not any(line.startswith(("quick", "quiet")) for line in lines)
    assert not any("failing: done" in line for line in lines)


def test_plan_records_its_planning_time_and_its_summary_shows_it():
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3)])
    chosen = autopar.plan(model, sample=torch.randn(8, 32), topology="1xH200")
    assert chosen.prediction["planning_s"] >= 0
    assert f"planned in    {chosen.prediction['planning_s']:.1f} s" in chosen.describe()


class _Terminal:
    """A stream that says it is a terminal, and keeps what is written to it."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, s: str) -> int:
        self.text += s
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True


@pytest.fixture()
def terminal(monkeypatch):
    monkeypatch.setattr(progress, "AFTER_S", 0.05)
    monkeypatch.setattr(progress, "TICK_S", 0.05)
    logger = get_logger()
    (handler,) = [h for h in logger.handlers if getattr(h, "_autopar_own", False)]
    tty = _Terminal()
    monkeypatch.setattr(handler, "stream", tty)
    return tty


def test_on_a_terminal_a_long_phase_is_one_line_redrawn_in_place_then_a_line_that_stays(terminal):
    with progress.phase("tracing a step"):
        time.sleep(0.4)
    redraws = terminal.text.count("\r\033[K[autopar] ")
    assert redraws >= 3  # redrawn in place while it runs
    assert "s so far" not in terminal.text  # not the log file's lines
    final = terminal.text.rsplit("\r\033[K", 1)[1]  # what stays after the status line is erased
    assert final.startswith("[autopar] tracing a step: done in ") and final.endswith(" s\n")
    assert terminal.text.count("\n") == 1


def test_on_a_terminal_a_short_or_failed_phase_draws_nothing_that_stays(terminal):
    with progress.phase("quick"):
        pass
    assert terminal.text == ""
    with pytest.raises(ValueError):
        with progress.phase("failing"):
            time.sleep(0.2)
            raise ValueError("no")
    assert terminal.text.endswith("\r\033[K") and "\n" not in terminal.text  # its status line erased


def test_a_handler_the_user_added_gets_log_lines_not_the_terminal_line(terminal, lines):
    with progress.phase("tracing a step"):
        time.sleep(0.3)
    assert lines[0].startswith("tracing a step... (")
    assert "\r" not in terminal.text
