"""bench/zoo_race.py (wrap against the hand recipes, timed interleaved): its ratios, and a tiny run on a CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.zoo_race import paired, ratios, report
from tests._training import TORCHRUN_VARS

ROOT = Path(__file__).resolve().parents[2]


def _record(hand: list[float], compiled: list[float], wrap: list[float]) -> dict:
    def mode(rounds: list[float], plan: str) -> dict:
        return {"status": "ok", "plan_short": plan, "step_s": sorted(rounds)[len(rounds) // 2], "round_step_s": rounds}

    return {"family": "f", "batch": 8, "rounds": len(wrap), "steps": 10, "host_op_us_rounds": [7.0, 9.0, 11.0],
            "modes": {"hand": mode(hand, "1gpu mb8 bf16"), "hand_compile": mode(compiled, "1gpu mb8 bf16 compile"),
                      "wrap": mode(wrap, "1gpu mb8 bf16 compile")}}


def test_paired_ratios_cancel_a_drift_of_the_host_that_the_medians_do_not():
    # The host slows down round by round; wrap and hand_compile run the same plan, each 2% apart within a round.
    rec = _record(hand=[0.040, 0.060, 0.080], compiled=[0.0204, 0.0306, 0.0408], wrap=[0.020, 0.030, 0.060])
    assert ratios(rec) == {"hand": pytest.approx(0.060 / 0.030), "hand_compile": pytest.approx(0.0306 / 0.030)}
    pair = paired(rec)
    assert pair["hand"] == pytest.approx((2.0 * 2.0 * (0.080 / 0.060)) ** (1 / 3))
    assert pair["hand_compile"] == pytest.approx((1.02 * 1.02 * 0.68) ** (1 / 3))
    row = report([rec]).splitlines()[-1]
    assert "| f | 8 | 1gpu mb8 bf16 compile | 30.0 | 60.0 | 30.6 |" in row and "| 3 x 10 | 7.0-11.0 |" in row


def test_a_mode_that_failed_leaves_its_ratio_out():
    rec = _record(hand=[0.04] * 3, compiled=[0.02] * 3, wrap=[0.03] * 3)
    rec["modes"]["hand_compile"] = {"status": "error", "error": "RuntimeError: boom"}
    assert ratios(rec)["hand_compile"] is None and paired(rec)["hand_compile"] is None
    assert "| error |" in report([rec]).splitlines()[-1]


@pytest.mark.zoo
def test_the_race_runs_a_tiny_family_on_a_cpu(tmp_path):
    out = tmp_path / "race.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    proc = subprocess.run([sys.executable, "-m", "bench.zoo_race", "--families", "mlp", "--size", "tiny", "--modes",
                           "hand,wrap", "--rounds", "2", "--steps", "2", "--warmup", "1", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert rec["family"] == "mlp" and rec["rounds"] == 2 and len(rec["host_op_us_rounds"]) == 2
    for mode in ("hand", "wrap"):
        assert rec["modes"][mode]["status"] == "ok" and len(rec["modes"][mode]["round_step_s"]) == 2
    assert "| mlp |" in proc.stdout


@pytest.mark.zoo
def test_the_forward_compiled_mode_compiles_the_forward_in_place_and_counts_its_graphs(tmp_path):
    out = tmp_path / "race.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS} | {"AUTOPAR_COMPILE_BACKEND": "eager"}
    proc = subprocess.run([sys.executable, "-m", "bench.zoo_race", "--families", "mlp", "--size", "tiny", "--modes",
                           "hand,hand_compile_forward", "--rounds", "1", "--steps", "2", "--warmup", "1", "--out",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    compiled = rec["modes"]["hand_compile_forward"]
    assert compiled["status"] == "ok" and "forward compiled in place" in compiled["plan_short"]
    assert compiled["dynamo"].get("stats.unique_graphs", 0) >= 1  # it made a graph; eager made none
    assert not rec["modes"]["hand"].get("dynamo", {}).get("stats.unique_graphs")
