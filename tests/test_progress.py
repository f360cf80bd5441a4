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


def _until(condition, timeout_s: float = 60.0) -> None:
    """Wait (inside a phase) until the progress thread has said what the test reads: a fixed sleep was too short
    when the suite's other workers held the cores (the thread had not run yet)."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.fixture()
def logger_on(monkeypatch):
    """autopar's logger as a fresh process has it (INFO on, enabled): the suite's earlier tests in one worker
    (in-process fits, trials and library code they run) may have left it otherwise, and a phase's lines are
    INFO lines. What was found is kept for a failure's message."""
    logger = get_logger()
    found = {"level": logger.level, "disabled": logger.disabled, "disable": logging.root.manager.disable,
             "handlers": list(logger.handlers)}
    monkeypatch.setattr(logger, "disabled", False)
    monkeypatch.setattr(logging.root.manager, "disable", logging.NOTSET)
    level = logger.level
    logger.setLevel(logging.INFO)
    yield found
    logger.setLevel(level)


@pytest.fixture()
def lines(monkeypatch, logger_on):
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
        _until(lambda: len(lines) >= 2)
    assert lines, f"no progress line; the logger as the test found it: {logger_on}"
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
def terminal(monkeypatch, logger_on):
    monkeypatch.setattr(progress, "AFTER_S", 0.05)
    monkeypatch.setattr(progress, "TTY_AFTER_S", 0.05)
    monkeypatch.setattr(progress, "TICK_S", 0.05)
    logger = get_logger()
    (handler,) = [h for h in logger.handlers if getattr(h, "_autopar_own", False)]
    # autopar's own handler alone, as in a fresh process: a handler an earlier test in this worker left behind
    # makes the progress line go to log lines instead (CI: nothing drawn on the terminal in 60 s)
    monkeypatch.setattr(logger, "handlers", [handler])
    tty = _Terminal()
    monkeypatch.setattr(handler, "stream", tty)
    return tty


def test_on_a_terminal_a_long_phase_is_one_line_redrawn_in_place_then_a_line_that_stays(terminal, logger_on):
    with progress.phase("tracing a step"):
        time.sleep(0.4)
        _until(lambda: terminal.text.count("\r\033[K[autopar] ") >= 3)
    redraws = terminal.text.count("\r\033[K[autopar] ")
    assert redraws >= 3, f"redrawn in place while it runs; the logger as the test found it: {logger_on}"
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


def test_on_a_terminal_a_phase_under_two_seconds_is_drawn_from_its_first_second_and_leaves_nothing(terminal,
                                                                                                  monkeypatch):
    monkeypatch.setattr(progress, "AFTER_S", 5.0)
    with progress.phase("ranking"):
        time.sleep(0.3)
    assert "[autopar] " in terminal.text and "ranking" in terminal.text
    assert terminal.text.endswith("\r\033[K") and "\n" not in terminal.text


def test_a_phase_of_counted_parts_draws_a_bar_on_a_terminal_and_counts_in_log_lines(terminal, lines):
    logger = get_logger()
    others = [h for h in logger.handlers if not getattr(h, "_autopar_own", False)]
    for h in others:  # the terminal alone first
        logger.removeHandler(h)
    with progress.phase("checking 2 plans") as p:
        p.count(0, 2)
        time.sleep(0.2)
        p.count(1, 2)
        time.sleep(0.2)
    assert "[" + "." * 20 + "] 0/2" in terminal.text and "[" + "#" * 10 + "." * 10 + "] 1/2" in terminal.text
    for h in others:
        logger.addHandler(h)
    with progress.phase("checking 2 plans") as p:
        p.count(1, 2)
        time.sleep(0.3)
    assert any(line.startswith("checking 2 plans... (1/2 done, ") for line in lines)


def test_verify_candidates_counts_the_plans_it_checks():
    from autopar.planning import candidates, verify_candidates
    from autopar.profile import profile_model

    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3)])
    sample = torch.randn(8, 32)
    topo = autopar.Topology.from_spec("2xH200")
    ranked = candidates(profile_model(model, sample, warn=False), topology=topo, world_size=2, global_batch_size=16)
    seen: list[tuple[int, int]] = []
    build = lambda: nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3)])  # noqa: E731
    verify_candidates(ranked, build, sample, top=2, topology=topo, progress=lambda d, t: seen.append((d, t)))
    assert seen == [(0, 2), (1, 2), (2, 2)]


def test_the_terminal_line_fits_the_terminal_width(terminal, monkeypatch):
    import os
    monkeypatch.setattr(progress.shutil, "get_terminal_size", lambda: os.terminal_size((50, 24)))
    with progress.phase("checking the 2 best plan(s) with the exact memory check (a full-model trace each)") as p:
        p.count(1, 2)
        time.sleep(0.2)
        _until(lambda: "[autopar] " in terminal.text)
    drawn = [line for line in terminal.text.split("\r\033[K") if line and "done in" not in line]
    assert drawn and all(len(line) <= 49 and line.startswith("[autopar] ") for line in drawn), drawn
    assert all(line.endswith(" s") and "1/2" in line for line in drawn)  # the count and the time are kept


def test_recording_collects_the_seconds_of_keyed_phases_said_or_not_and_not_of_failed_ones():
    from autopar._util.progress import recording

    with recording() as seconds:
        with progress.phase("a", key="tracing", say=False):
            time.sleep(0.02)
        with progress.phase("b", key="tracing"):  # a key met twice: summed
            time.sleep(0.02)
        with progress.phase("c"):  # no key: not recorded
            pass
        with pytest.raises(ValueError), progress.phase("d", key="failed"):
            raise ValueError
    assert set(seconds) == {"tracing"} and seconds["tracing"] >= 0.04
    with progress.phase("outside", key="tracing"):  # no recording open: nothing kept anywhere
        pass
    assert set(seconds) == {"tracing"}
