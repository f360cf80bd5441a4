"""bench/suite.py (issue 14's suite): one command measures the suite's models in the modes fp32, hand,
hand_compile, wrap, oracle (every plan of autopar's one-GPU candidate space, the fastest kept) and tune
(autopar.autotune's trials, then wrap given the study's best plan) through the zoo
script, and writes the records in the suite's keys with a Markdown table of wrap against the best hand column and
the oracle. Here on a CPU, one tiny family (compile is measured on the GPU only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.suite import MODELS, markdown, ratios
from bench.zoo import FAMILIES, SIZED, ZOO, build_model
from tests._training import TORCHRUN_VARS

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("model", "mode", "per_s", "step_s", "device", "torch", "date", "command")  # and peak_bytes (GPU only)


def test_the_suite_measures_a_tiny_model_in_its_modes_and_writes_its_table(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    out = tmp_path / "suite.jsonl"
    proc = subprocess.run([sys.executable, "-m", "bench", "suite", "--models", "mlp", "--modes",
                           "fp32,hand,wrap,oracle,tune", "--out", str(out), "--", "--device", "cpu", "--size",
                           "tiny", "--steps", "2", "--warmup", "1", "--tune-trials", "2"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (json_path,) = tmp_path.glob("suite_*.json")
    records = json.loads(json_path.read_text())
    assert [r["mode"] for r in records] == ["fp32", "hand", "wrap", "oracle", "tune"]
    assert all(all(r.get(k) is not None for k in KEYS) and "peak_bytes" in r and r["status"] == "ok"
               and r["model"] == "mlp" and r["per_s_unit"] == "samples/s" for r in records)
    fp32, hand, wrap, oracle, tune = records
    assert fp32["plan"] == "1gpu mb4 fp32" and hand["plan"] == "1gpu mb4 bf16"
    # the oracle: autopar's candidates for one CPU device (fp32; no checkpointing, selective, alternate, gemms,
    # full), each measured; its record is the fastest's
    grid = oracle["grid"]
    assert sorted(g["plan_short"] for g in grid) == sorted(["1gpu mb4 fp32", "1gpu mb4 ac:selective fp32",
                                                           "1gpu mb4 ac:alternate fp32", "1gpu mb4 ac:gemms fp32",
                                                           "1gpu mb4 ac:full fp32"])
    assert all(g["status"] == "ok" for g in grid)
    assert oracle["step_s"] == min(g["step_s"] for g in grid)
    # tune: the study's trials (plans of the same space) in its grid, and the measured plan the best trial's
    assert tune["grid"] and all(g["plan_short"] in {o["plan_short"] for o in grid} for g in tune["grid"])
    best = min((g for g in tune["grid"] if g["status"] == "ok"), key=lambda g: g["step_s"])
    assert tune["plan"] == best["plan_short"]
    table = (tmp_path / json_path.name.replace(".json", ".md")).read_text()
    assert "| mlp | 4 |" in table and "wrap / oracle" in table and "tune / oracle" in table


def test_the_ratios_are_wrap_over_the_best_hand_column_and_over_the_oracle():
    def rec(mode, per_s, status="ok"):
        return {"model": "m", "mode": mode, "per_s": per_s, "status": status, "plan": mode, "batch": 8}

    recs = {r["mode"]: r for r in (rec("hand", 100.0), rec("hand_compile", 150.0), rec("wrap", 120.0),
                                   rec("oracle", 160.0), rec("fp32", 0.0, "oom"), rec("tune", 168.0))}
    r = ratios(recs)
    assert r["wrap_over_best_hand"] == pytest.approx(0.8) and r["wrap_over_oracle"] == pytest.approx(0.75)
    assert r["wrap_over_hand_compile"] == pytest.approx(0.8) and r["tune_over_oracle"] == pytest.approx(1.05)
    assert ratios({"wrap": rec("wrap", 1.0)}) == {"wrap_over_best_hand": None, "wrap_over_hand_compile": None,
                                                  "wrap_over_oracle": None, "tune_over_oracle": None}
    assert "| m | 8 | oom | 100 | 150 | 120 | 160 | 168 |" in markdown(list(recs.values()))


def test_the_suites_sizes_are_families_outside_the_zoos_own_list():
    assert all(m in FAMILIES for m in MODELS)
    assert not {f.name for f in SIZED} & {f.name for f in ZOO}  # the zoo's "all", tests and tables: unchanged
    params = {f.name: sum(p.numel() for p in build_model(f, "realistic").parameters()) for f in SIZED}
    assert 3.3e8 < params["gpt2-355m"] < 3.7e8 and 1.5e9 < params["gpt2-1.5b"] < 1.6e9
    assert 3.1e9 < params["llama-3b"] < 3.3e9 and params["llama-3b-b16"] == params["llama-3b"]
    tiny = build_model(FAMILIES["gpt2-1.5b"], "tiny")  # the base family's tiny size
    assert sum(p.numel() for p in tiny.parameters()) == sum(p.numel() for p in build_model(FAMILIES["gpt2"], "tiny")
                                                           .parameters())
