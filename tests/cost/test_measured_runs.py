"""The time model against the H200's measured validation runs (bench/results/validate_h200_2026-11-29.jsonl:
Hugging Face GPT-2-355M and Llama-1B under eight plans, torch 2.11), re-predicted on the CPU from traces on the
meta device, as `python -m bench step-check --no-grid` does. A change to what the trace or the cost model makes of
a model shows here: 5c0a108's cacheless trace priced every attention call as masked (median |error| 5.2% -> 15.6%,
Llama-1B's plain step +15.4%), which went unnoticed for two sessions (bench/NOTES.md, sixth 2026-12-06 session)."""

from __future__ import annotations

import statistics

import pytest

from bench._common import RESULTS

VALIDATE = RESULTS / "validate_h200_2026-11-29.jsonl"


def test_the_h200_validation_runs_are_predicted_within_10_percent_on_the_median():
    pytest.importorskip("transformers")
    from bench.step_time_check import predicted_runs

    runs = predicted_runs(str(VALIDATE), None)
    assert len(runs) == 8 and {name for name, *_ in runs} == {"gpt2-355m", "llama-1b"}
    errors = {f"{name} {kw}": pred.step_s / measured - 1 for name, kw, measured, _, pred in runs}
    assert statistics.median(abs(e) for e in errors.values()) <= 0.10, errors
    assert max(abs(e) for e in errors.values()) <= 0.15, errors
