"""AutoparCallback's clock: the device is synchronised only at the ends of the timed window, never between steps
(a synchronisation per step stops the host from queuing the next step, which cost the Trainer 7% on the H200:
bench/results/integrations_h200_2026-12-02.md), and the step time is the window's mean."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from autopar.integrations import hf_callback  # noqa: E402


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_window_synchronises_twice_and_averages_the_timed_steps(monkeypatch):
    syncs, clock = [], _Clock()
    monkeypatch.setattr(hf_callback, "_sync", lambda: syncs.append(clock.now))  # the name hf_callback calls
    monkeypatch.setattr(hf_callback.time, "perf_counter", clock)
    window = hf_callback._Window(warmup_steps=3)
    for step in range(1, 11):  # steps 1-3 warm up; the clock starts at the end of step 3
        clock.now += 0.5 if step <= 3 else 0.25
        window.step_end(step)
    assert syncs == [100.0 + 3 * 0.5]
    step_s, steps = window.read(10)
    assert steps == 7 and step_s == pytest.approx(0.25)
    assert len(syncs) == 2


def test_window_reads_nothing_before_a_timed_step(monkeypatch):
    monkeypatch.setattr(hf_callback, "_sync", lambda: None)
    window = hf_callback._Window(warmup_steps=2)
    window.step_end(1)
    assert window.read(1) is None
    window.step_end(2)
    assert window.read(2) is None  # the clock started at the end of step 2: nothing timed yet
