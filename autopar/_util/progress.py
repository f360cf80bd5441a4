"""What autopar is doing, said while it takes long: a phase that runs past `AFTER_S` seconds is announced on
the autopar logger ("[autopar] tracing ... (2 s so far)"), then every `EVERY_S` seconds, and its end with its
time. Short phases say nothing. A line each on a terminal and in a log file alike (no carriage returns, which
a log collector would keep)."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

from .log import get_logger

AFTER_S = 2.0  # a phase says what it does once it has run this long
EVERY_S = 10.0  # and again this often


@contextlib.contextmanager
def phase(what: str, *, say: bool = True) -> Iterator[None]:
    """Run the body; if it takes over AFTER_S seconds (and `say`), log what it is doing while it runs and how
    long it took when it ends (an error ends it silently: the error says enough)."""
    if not say:
        yield
        return
    start = time.perf_counter()
    done = threading.Event()
    announced = threading.Event()

    def watch() -> None:
        wait = AFTER_S
        while not done.wait(wait):
            announced.set()
            get_logger().info("%s... (%.0f s so far)", what, time.perf_counter() - start)
            wait = EVERY_S

    watcher = threading.Thread(target=watch, name="autopar-progress", daemon=True)
    watcher.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        done.set()
        watcher.join()
        if ok and announced.is_set():
            get_logger().info("%s: done in %.1f s", what, time.perf_counter() - start)
