"""What autopar is doing, said while it takes long: a phase that runs past `AFTER_S` seconds is announced.

- On a terminal (autopar's own stderr handler, stderr a TTY): from `TTY_AFTER_S`, one status line redrawn in
  place every `TICK_S` seconds ("[autopar] | tracing ...  4 s"; a phase of counted parts draws a bar,
  "[######..............] 1/3"), erased at the end; a phase that ran past AFTER_S leaves a line that stays
  ("[autopar] tracing ...: done in 4.2 s").
- Otherwise (a log file, a collector, a handler the user installed): a line on the autopar logger when the
  phase passes AFTER_S ("tracing ... (2 s so far)"), again every `EVERY_S` seconds, and its end with its time;
  no carriage returns, which a log collector would keep.

Short phases leave nothing; a phase that raises ends silently (the error says enough). A phase of parts
counts them through the object it yields (`with phase("checking 3 plans") as p: ... p.count(i, 3)`).
Hand-written rather than rich or tqdm: one status line is all it draws, and autopar adds no dependency for it."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import shutil
import threading
import time
from typing import Iterator, TextIO

from .log import get_logger

AFTER_S = 2.0  # a phase says what it does once it has run this long (log lines; the line that stays)
TTY_AFTER_S = 0.5  # on a terminal the status line starts this early
EVERY_S = 10.0  # and again this often (log lines)
TICK_S = 0.5  # the terminal line's redraw period
_SPIN = "|/-\\"
_CLEAR = "\r\033[K"  # carriage return, then erase to the end of the line
#: Where `recording()` collects the seconds of the phases given a `key` (None: not recording).
_RECORD: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar("autopar_phases", default=None)


@contextlib.contextmanager
def recording() -> Iterator[dict[str, float]]:
    """Collect the seconds of each keyed phase run in the body (`phase(..., key="tracing")`): {key: seconds},
    a key met twice summed. wrap puts them in the plan's prediction (where its time before the first step went)."""
    seconds: dict[str, float] = {}
    token = _RECORD.set(seconds)
    try:
        yield seconds
    finally:
        _RECORD.reset(token)


def _record(key: str | None, seconds: float) -> None:
    record = _RECORD.get()
    if key is not None and record is not None:
        record[key] = round(record.get(key, 0.0) + seconds, 3)


def _terminal() -> TextIO | None:
    """stderr when autopar's INFO lines go to a terminal through autopar's own handler only; else None."""
    logger = get_logger()
    if not logger.isEnabledFor(logging.INFO) or len(logger.handlers) != 1:
        return None
    handler = logger.handlers[0]
    stream = getattr(handler, "stream", None)
    if not getattr(handler, "_autopar_own", False) or stream is None:
        return None
    try:
        return stream if stream.isatty() else None
    except (AttributeError, ValueError, OSError):  # a closed or odd stream: log lines instead
        return None


class Phase:
    """What a phase yields: `count(done, total)` says how many of its parts are done (a bar on a terminal)."""

    def __init__(self) -> None:
        self.done = 0
        self.total = 0

    def count(self, done: int, total: int) -> None:
        self.done, self.total = done, total

    def text(self) -> str:
        if self.total <= 0:
            return ""
        filled = min(20, round(20 * self.done / self.total))
        return f" [{'#' * filled}{'.' * (20 - filled)}] {self.done}/{self.total}"


@contextlib.contextmanager
def phase(what: str, *, say: bool = True, key: str | None = None) -> Iterator[Phase]:
    """Run the body; if it takes long (and `say`), show what it is doing while it runs and how long it took
    when it ends: a line redrawn in place on a terminal, log lines otherwise. A `key`ed phase that ends without
    raising adds its seconds to `recording()`'s dict, said or not."""
    parts = Phase()
    start = time.perf_counter()
    if not say:
        yield parts
        _record(key, time.perf_counter() - start)
        return
    done = threading.Event()
    drawn = threading.Event()
    tty = _terminal()

    def watch_log() -> None:
        wait = AFTER_S
        while not done.wait(wait):
            drawn.set()
            counted = f"{parts.done}/{parts.total} done, " if parts.total else ""
            get_logger().info("%s... (%s%.0f s so far)", what, counted, time.perf_counter() - start)
            wait = EVERY_S

    def watch_tty() -> None:
        assert tty is not None
        wait, tick = TTY_AFTER_S, 0
        while not done.wait(wait):
            drawn.set()
            tail = f"{parts.text()}  {time.perf_counter() - start:.0f} s"
            head = f"[autopar] {_SPIN[tick % len(_SPIN)]} {what}"
            room = shutil.get_terminal_size().columns - 1 - len(tail)  # one row: a wrapped line is not erased
            if len(head) > room:
                head = head[:max(room - 3, 0)] + "..."
            tty.write(f"{_CLEAR}{head}{tail}")
            tty.flush()
            wait, tick = TICK_S, tick + 1

    watcher = threading.Thread(target=watch_log if tty is None else watch_tty, name="autopar-progress", daemon=True)
    watcher.start()
    ok = False
    try:
        yield parts
        ok = True
    finally:
        done.set()
        watcher.join()
        if tty is not None and drawn.is_set():
            tty.write(_CLEAR)  # the status line goes; the end's line (or the error) takes its place
            tty.flush()
        took = time.perf_counter() - start
        if ok:
            _record(key, took)
        if ok and drawn.is_set() and took >= AFTER_S:
            get_logger().info("%s: done in %.1f s", what, took)
