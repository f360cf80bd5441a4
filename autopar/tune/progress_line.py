"""`autopar tune`'s progress line on stderr (autopar.cli's `tune` command draws it from the study's events)."""

from __future__ import annotations

from typing import Any, TextIO

from .report import rate_text


class ProgressLine:
    """`autopar tune`'s progress on stderr: one line rewritten in place on a terminal (trial i/N, the plan
    in flight, the best so far), a line per event otherwise. Ended trials are printed as lines that stay."""

    def __init__(self, stream: TextIO, *, tty: bool | None = None) -> None:
        self.stream = stream
        self.tty = stream.isatty() if tty is None else tty
        self.shown = False

    def __call__(self, ev: Any) -> None:  # an autopar.tune.study.Progress
        unit = "tok/s" if ev.unit == "tokens/s" else "samples/s"
        best = f"best {rate_text(ev.best)} {unit} ({ev.best_plan})" if ev.best is not None else "best -"
        budget = ev.budget
        if ev.event == "trial":
            done = ev.measured
            if budget:
                filled = min(20, round(20 * done / budget))
                bar = f"[{'#' * filled}{'.' * (20 - filled)}] {done + 1}/{budget}"
            else:
                bar = f"trial {done + 1}"
            self._line(f"{bar} running {ev.plan} | {best} | {ev.elapsed_s:.0f} s", keep=False)
        elif ev.event == "result":
            what = f"{rate_text(ev.throughput)} {unit}" if ev.status == "ok" else (ev.message or "").splitlines()[0][:100]
            self._line(f"trial {ev.number}: {ev.status:<7} {ev.plan}: {what}", keep=True)
        elif ev.event == "pruned":
            self._line(f"trial {ev.number}: pruned  {ev.plan}: not run, {ev.message.split(': ', 1)[-1]}", keep=True)
        elif ev.event in ("start", "done"):
            self._line(f"{ev.message}", keep=True)

    def _line(self, text: str, *, keep: bool) -> None:
        text = f"[autopar tune] {text}"
        if not self.tty:
            self.stream.write(text + "\n")
        elif keep:
            self.stream.write("\r\033[K" + text + "\n")
            self.shown = False
        else:
            self.stream.write("\r\033[K" + text)
            self.shown = True
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
