"""SIGTERM and SIGINT in the tuner: each becomes a `TuneInterrupted` (a KeyboardInterrupt, carrying the signal),
raised in the main thread, so that the launcher ends the run in flight (its whole process group: SIGTERM, then
SIGKILL after autopar.tune.launcher.TERM_GRACE_S), the engine records the trial as interrupted, and `autopar tune`
exits with 128 + the signal's number (130, 143).

    with handling_signals():   # tune() does this around a study (in the main thread; elsewhere nothing)
        ...
        with held():           # a signal here is raised when the block ends (ending a run, recording a trial)
            ...
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator

from ..errors import TuneInterrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _State:
    hold = 0  # depth of held() blocks
    pending: int | None = None  # a signal that came while held


def _handler(signum: int, frame: Any) -> None:
    if _State.hold:
        _State.pending = _State.pending or signum
        return
    raise TuneInterrupted(signum)


@contextlib.contextmanager
def handling_signals() -> Iterator[None]:
    """SIGTERM and SIGINT raise TuneInterrupted in this block (the previous handlers come back after it). Only
    in the main thread (where Python runs signal handlers); a SIGINT the process was started to ignore stays
    ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    for s in SIGNALS:
        if not (s == signal.SIGINT and previous[s] == signal.SIG_IGN):
            signal.signal(s, _handler)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        _State.pending = None


@contextlib.contextmanager
def held() -> Iterator[None]:
    """A SIGTERM or SIGINT that comes in this block is raised (TuneInterrupted) when the block ends, not in it."""
    _State.hold += 1
    try:
        yield
    except BaseException as exc:
        _State.hold -= 1
        if _State.hold == 0 and _State.pending is not None:
            signum, _State.pending = _State.pending, None
            if not isinstance(exc, KeyboardInterrupt):
                raise TuneInterrupted(signum) from exc
        raise
    _State.hold -= 1
    if _State.hold == 0 and _State.pending is not None:
        signum, _State.pending = _State.pending, None
        raise TuneInterrupted(signum)
